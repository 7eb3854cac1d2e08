"""Block speculative decoding with KV caches: a DFlash drafter, verification by the target.

An *evaluation harness* that measures real acceptance at the lengths people measure it (2k-16k
new tokens): each verification step costs one drafter pass and one target pass over the new
block only, so the time per generated token does not grow with the length (beyond attention
itself). Every committed token is the target's own greedy token given everything before it, so
the output equals greedy decoding
(:func:`~dflash_recipes.executor.evaluation.speculative.greedy_generate`) whatever the drafter
proposes. With a :class:`~dflash_recipes.executor.evaluation.sampling.Sampling` the
verification samples at its temperature instead, by the rejection rule that keeps the target's
sampling distribution (:mod:`~dflash_recipes.executor.evaluation.sampling`; step 2 below then
accepts by that rule and draws the token after the accepted ones).

One step, with ``B`` the block size and ``a`` the position of the last committed token (the
anchor):

1. the drafter gets the block ``[token at a, mask, ..., mask]`` (positions ``a .. a+B-1``) and
   the target's tapped states at positions ``< a`` (:mod:`~dflash_recipes.executor.
   draft_context`, grown by the positions each step commits) and proposes ``D`` tokens in one
   pass (``spec.drafted_tokens``: ``B - 1`` from block positions ``1 .. B-1``, or ``B`` from
   positions ``0 .. B-1`` for a Domino/DSpark head with shift_label, as SGLang drafts them;
   the head applied position by position, Domino's prefix uncorrected);
2. the target runs once over the block (anchor + proposals) on top of its cache
   (``transformers.DynamicCache``, which holds every committed position before the anchor:
   keys and values, a window of them, or a linear-attention layer's recurrent state);
   proposals are accepted while they equal the target's greedy token, then the target's token
   at the first mismatch (or after a fully accepted block) is committed as a bonus. The step's
   acceptance length tau is accepted proposals + 1, so ``1 <= tau <= D + 1``;
3. the cache is rolled back to the accepted positions (anchor + accepted proposals) after
   every verification pass (a fully accepted block too: that crop cuts sliding-window layers
   back to their window), each kind of layer its own way
   (:mod:`~dflash_recipes.executor.evaluation.target_cache`: a crop of keys and values, the
   recurrent state recorded after the last accepted input, or, where the cache records none,
   the pass taken back and its accepted inputs run again): the bonus token is the next anchor
   and enters the cache with the next block. The same pass gave the tapped states of those
   positions, which join the drafter's context.

A batch of prompts runs as rows of one cache, each row accepting its own number of tokens.
Prompts are left-padded; a row that accepts fewer tokens than the batch's longest acceptance
keeps the slots of its rejected proposals as holes, masked out of every later attention (the
cache is cropped to the longest acceptance). Positions are given explicitly, so a row sees
exactly the positions and tokens it would see alone. A finished row leaves the batch. With one
prompt there are no holes and the cache is cropped to exactly the accepted length. A target
with sliding-window, chunked or linear-attention layers (a window counts cache slots; a
recurrent state has no slot to mask) verifies the prompts of a batch one at a time
(:func:`~dflash_recipes.executor.evaluation.target_cache.holds_holes`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel

from dflash_recipes.errors import DataError
from dflash_recipes.executor.evaluation.draft_context import context_store
from dflash_recipes.executor.evaluation.sampling import DraftRecorder, Sampling
from dflash_recipes.executor.evaluation.speculative import (
    BlockDrafter,
    SpecResult,
    as_block_drafter,
    check_prompt,
)
from dflash_recipes.executor.evaluation.target_cache import TargetCache, holds_holes
from dflash_recipes.executor.model.target_states import TapRecorder
from dflash_recipes.plan.draft_spec import ResolvedDraft


def max_positions(target: PreTrainedModel) -> int | None:
    """The target's ``max_position_embeddings`` (None when its config has none)."""
    config = getattr(target, "config", None)
    text_config = getattr(config, "get_text_config", None)
    if callable(text_config):
        config = text_config()
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


def check_positions(
    target: PreTrainedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> None:
    """DataError when a prompt plus ``max_new_tokens`` does not fit the target's positions.

    Names the first such prompt (0-based, in the order given), its length and the limit.
    """
    limit = max_positions(target)
    if limit is None:
        return
    for index, prompt in enumerate(prompts):
        needed = len(prompt) + max(max_new_tokens, 0)
        if len(prompt) >= limit:
            msg = (
                f"prompt {index} has {len(prompt)} tokens, but the target takes at most "
                f"{limit} positions (max_position_embeddings) and needs room for the answer; "
                "shorten or drop that prompt"
            )
            raise DataError(msg)
        if needed > limit:
            msg = (
                f"prompt {index} has {len(prompt)} tokens; with max_new_tokens "
                f"{max_new_tokens} it needs {needed} positions, but the target takes at most "
                f"{limit} (max_position_embeddings); lower max_new_tokens to "
                f"{limit - len(prompt)} or shorten the prompt"
            )
            raise DataError(msg)


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


class _Rows:
    """The batch's per-row state: committed tokens, generated tokens, taus, done flags."""

    def __init__(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: int | None
    ) -> None:
        self.committed = [list(p) for p in prompts]
        self.generated: list[list[int]] = [[] for _ in prompts]
        self.taus: list[list[int]] = [[] for _ in prompts]
        self.done = [False] * len(prompts)
        self.max_new_tokens = max_new_tokens
        self.eos = eos

    def commit(self, row: int, tokens: Sequence[int]) -> None:
        """Append tokens to ``row`` until a stop (eos or max_new_tokens)."""
        for token in tokens:
            self.committed[row].append(token)
            self.generated[row].append(token)
            if len(self.generated[row]) >= self.max_new_tokens or token == self.eos:
                self.done[row] = True
                return


def _forward(
    target: PreTrainedModel,
    cache_argument: str,
    cache: DynamicCache,
    input_ids: Tensor,
    positions: Tensor,
    slot_valid: Tensor,
    keep_logits: int,
    taps: Sequence[int],
) -> tuple[Tensor, Tensor]:
    """One target pass on top of ``cache``: logits of the last ``keep_logits`` inputs
    ``[R, keep_logits, V]`` and tapped states of every input ``[R, n, n_taps * H]``."""
    mask = None if bool(slot_valid.all()) else slot_valid.long()
    # the taps as training takes them: the tapped decoder layers' outputs, before any final norm
    with TapRecorder(target, taps) as recorder:
        out = target(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=keep_logits,
            **{cache_argument: cache},
        )
    logits: Tensor = out.logits
    return logits, recorder.tapped()


def _verify(
    proposals: Sequence[Sequence[int]], logits: Tensor, recorder: DraftRecorder | None
) -> list[tuple[int, list[int]]]:
    """Each row's verdict on its proposals: (accepted proposals, the tokens to commit: the
    accepted ones and the target's next token). Greedy: proposals are kept while they equal
    the target's argmax, then its argmax is committed; sampled (`recorder`, which drew the
    proposals): the rejection rule."""
    if recorder is None:
        verified = logits.argmax(dim=-1).tolist()
        verdicts: list[tuple[int, list[int]]] = []
        for drafted, target in zip(proposals, verified, strict=True):
            accepted = 0
            while accepted < len(drafted) and drafted[accepted] == target[accepted]:
                accepted += 1
            verdicts.append((accepted, target[: accepted + 1]))
        return verdicts
    drafts = torch.tensor([list(p) for p in proposals], dtype=torch.long, device=logits.device)
    accepted_t, next_t = recorder.verify(drafts, logits)
    return [
        (accepted, [*row_proposals[:accepted], next_token])
        for row_proposals, accepted, next_token in zip(
            proposals, accepted_t.tolist(), next_t.tolist(), strict=True
        )
    ]


@torch.no_grad()
def speculative_generate_batch(
    target: PreTrainedModel,
    drafter: nn.Module | BlockDrafter,
    spec: ResolvedDraft,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    sampling: Sampling | None = None,
) -> list[SpecResult]:
    """Speculative generation of every prompt as one batch; one result per prompt, in order.

    Each row stops after eos or ``max_new_tokens``; its tokens equal greedy decoding's and its
    taus are what the row would measure alone. With `sampling` the verification samples at
    its temperature instead (:mod:`~dflash_recipes.executor.evaluation.sampling`): every token
    has the target's sampling distribution, and ``sampling.seed`` fixes the draws (the rows of
    a batch draw from one generator, so a row's tokens depend on the batch it ran in).
    DataError when a prompt plus ``max_new_tokens`` does not fit the target's positions;
    ValueError for sampling with a drafter that proposes tokens without their distributions
    (a bare :class:`BlockDrafter`).
    """
    for prompt in prompts:
        check_prompt(prompt)
    size = spec.block_size
    if max_new_tokens <= 0 or not prompts:
        return [SpecResult(tokens=[], accepted_per_step=[], block_size=size) for _ in prompts]
    check_positions(target, prompts, max_new_tokens)
    if len(prompts) > 1 and not holds_holes(target):
        return [
            speculative_generate_batch(
                target,
                drafter,
                spec,
                [prompt],
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_token_id,
                sampling=sampling,
            )[0]
            for prompt in prompts
        ]
    block_drafter = as_block_drafter(drafter, target, spec)
    device = _device_of(target)
    recorder = None if sampling is None else DraftRecorder(sampling, sampling.generator(device))
    state = _Rows(prompts, max_new_tokens, eos_token_id)
    store = context_store(block_drafter, len(prompts), size)
    taps = spec.target_layer_ids

    # Prefill, left-padded: slot s of row r holds position s - pad[r].
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, pads[row] :] = torch.tensor(list(prompt), dtype=torch.long, device=device)
    pad_t = torch.tensor(pads, dtype=torch.long, device=device).unsqueeze(1)
    slots = torch.arange(width, device=device).unsqueeze(0)
    slot_valid = slots >= pad_t
    positions = (slots - pad_t).clamp(min=0)
    drafted = spec.drafted_tokens  # proposals per block; the verified block is one longer
    target_cache = TargetCache(target)
    cache_argument, cache = target_cache.argument, target_cache.cache
    logits, tapped = _forward(target, cache_argument, cache, ids, positions, slot_valid, 1, taps)
    target_cache.start_recording(drafted + 1)  # after the prefill: nothing of it to roll back
    last = logits[:, -1]
    first_tokens = (last.argmax(dim=-1) if recorder is None else recorder.sample(last)).tolist()
    for row in range(len(prompts)):
        store.extend(row, tapped[row, pads[row] :])
        state.commit(row, [int(first_tokens[row])])

    active = list(range(len(prompts)))  # the prompt index of each cache row
    offsets = torch.arange(drafted + 1, device=device).unsqueeze(0)
    while True:
        still = [i for i, prompt_index in enumerate(active) if not state.done[prompt_index]]
        if not still:
            break
        if len(still) < len(active):
            keep = torch.tensor(still, dtype=torch.long, device=device)
            cache.batch_select_indices(keep)
            slot_valid = slot_valid.index_select(0, keep)
            store.keep(still)
            active = [active[i] for i in still]
        committed = [state.committed[p] for p in active]
        proposals = store.propose(committed, None if recorder is None else recorder.new_block())
        for row_proposals in proposals:
            if len(row_proposals) != drafted:
                msg = (
                    f"the drafter proposed {len(row_proposals)} tokens, not the {drafted} its "
                    "block drafts"
                )
                raise ValueError(msg)
        block = torch.tensor(
            [[c[-1], *p] for c, p in zip(committed, proposals, strict=True)],
            dtype=torch.long,
            device=device,
        )
        anchors = torch.tensor([len(c) - 1 for c in committed], device=device).unsqueeze(1)
        valid = torch.cat([slot_valid, torch.ones_like(block, dtype=torch.bool)], dim=1)
        block_positions = anchors + offsets
        target_cache.before_pass()
        logits, tapped = _forward(
            target, cache_argument, cache, block, block_positions, valid, drafted + 1, taps
        )
        # logits[r, j] are the target's for position anchor + j + 1 (proposal j).
        verdicts = _verify(proposals, logits, recorder)
        accepted_rows: list[int] = []
        for row, prompt_index in enumerate(active):
            accepted, tokens = verdicts[row]
            state.taus[prompt_index].append(accepted + 1)
            state.commit(prompt_index, tokens)
            store.extend(row, tapped[row, : accepted + 1])
            accepted_rows.append(accepted)
        # Keep the anchor and the accepted proposals of the longest acceptance; a row that
        # accepted fewer keeps its rejected slots as holes, masked from now on.
        kept = max(accepted_rows) + 1
        accepted_t = torch.tensor(accepted_rows, device=device).unsqueeze(1)
        slot_valid = torch.cat([slot_valid, offsets[:, :kept] <= accepted_t], dim=1)
        target_cache.keep(kept, block, block_positions)
    return [
        SpecResult(tokens=state.generated[i], accepted_per_step=state.taus[i], block_size=size)
        for i in range(len(prompts))
    ]


def speculative_generate(
    target: PreTrainedModel,
    drafter: nn.Module | BlockDrafter,
    spec: ResolvedDraft,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    sampling: Sampling | None = None,
) -> SpecResult:
    """Generate up to ``max_new_tokens`` tokens (stopping after eos) by block drafting.

    ``target`` is a Hugging Face causal LM (called with a ``DynamicCache``, its taps recorded
    by hooks on the decoder layers); ``drafter`` a :class:`DFlashDraftModel` (wrapped with the
    target's embeddings and lm_head) or any :class:`BlockDrafter`. The tokens equal
    :func:`~dflash_recipes.executor.evaluation.speculative.greedy_generate`'s.
    """
    check_prompt(prompt_ids)
    return speculative_generate_batch(
        target,
        drafter,
        spec,
        [prompt_ids],
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        sampling=sampling,
    )[0]


__all__ = [
    "check_positions",
    "max_positions",
    "speculative_generate",
    "speculative_generate_batch",
]
