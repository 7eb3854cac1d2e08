"""The uncached verification loop the product had before issue 26: the reference in the tests.

The target re-runs over the whole sequence at every step (quadratic in the generated tokens),
which keeps it obviously lossless. Tests compare the KV-cached loop with it (tokens and tau per
step); benchmarks/bench_eval.py times it beside the cached loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from dflash_recipes.executor.evaluation.speculative import (
    BlockDrafter,
    DraftContext,
    SpecResult,
    as_block_drafter,
    check_prompt,
)
from dflash_recipes.executor.model.draft import taps_from_hidden_states
from dflash_recipes.plan.draft_spec import ResolvedDraft


def _target_pass(
    target: PreTrainedModel, ids: Sequence[int], spec: ResolvedDraft
) -> tuple[Tensor, Tensor]:
    """Greedy tokens [T] after every position and tapped states [1, T, n_taps * H]."""
    device = next(target.parameters()).device
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
    out = target(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    greedy: Tensor = out.logits[0].argmax(dim=-1)
    taps = taps_from_hidden_states(out.hidden_states, spec.target_layer_ids)
    return greedy, taps


@torch.no_grad()
def uncached_speculative_generate(
    target: PreTrainedModel,
    drafter: nn.Module | BlockDrafter,
    spec: ResolvedDraft,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
) -> SpecResult:
    """The old loop: no KV cache, one full target pass per verification step."""
    check_prompt(prompt_ids)
    size = spec.block_size
    block_drafter = as_block_drafter(drafter, target, spec)
    committed = list(prompt_ids)
    generated: list[int] = []
    taus: list[int] = []

    def commit(tokens: Sequence[int]) -> bool:
        for token in tokens:
            committed.append(token)
            generated.append(token)
            if len(generated) >= max_new_tokens or token == eos_token_id:
                return True
        return False

    if max_new_tokens <= 0:
        return SpecResult(tokens=[], accepted_per_step=[], block_size=size)
    greedy, taps = _target_pass(target, committed, spec)
    done = commit([int(greedy[-1].item())])
    while not done:
        anchor = len(committed) - 1
        context = DraftContext(committed=tuple(committed), taps=taps[:, :anchor], block_size=size)
        proposals = block_drafter.propose(context)
        greedy, taps = _target_pass(target, committed + proposals, spec)
        drafted = spec.drafted_tokens
        verified = [int(t) for t in greedy[anchor : anchor + drafted + 1].tolist()]
        accepted = 0
        while accepted < drafted and proposals[accepted] == verified[accepted]:
            accepted += 1
        taus.append(accepted + 1)
        done = commit(verified[: accepted + 1])
    return SpecResult(tokens=generated, accepted_per_step=taus, block_size=size)
