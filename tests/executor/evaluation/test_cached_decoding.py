"""The KV-cached verification loop (issue 26): lossless at length, the uncached loop's taus,
the cache cropped to exactly the accepted tokens, batches with per-row acceptance, refusals."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from testkit.greedy_oracle import hf_greedy, oracle_for
from testkit.reference_loop import uncached_speculative_generate
from testkit.tiny import (
    MAX_NEW,
    PROMPTS,
    TINY_HIDDEN,
    TINY_VOCAB,
    randomize,
    tiny_plan,
    tiny_target,
)
from torch import nn
from transformers import DynamicCache, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from dflash_recipes.errors import DataError
from dflash_recipes.executor.evaluation.cached_decoding import (
    speculative_generate,
    speculative_generate_batch,
)
from dflash_recipes.executor.evaluation.draft_context import FusedContext
from dflash_recipes.executor.evaluation.evaluate import evaluate_acceptance
from dflash_recipes.executor.evaluation.speculative import (
    DFlashBlockDrafter,
    DraftContext,
    is_greedy_decoding,
)
from dflash_recipes.executor.evaluation.target_cache import cache_argument, holds_holes
from dflash_recipes.executor.model.convert import embed_tokens, lm_head
from dflash_recipes.executor.model.draft import DFlashDraftModel, taps_from_hidden_states
from dflash_recipes.plan.draft_spec import ResolvedDraft

pytestmark = pytest.mark.usefixtures("one_thread")

LONG = 2048


@pytest.fixture(scope="module")
def long_target(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedModel:
    """A random tiny target with room for 2,048 new tokens (it never emits a stop: no eos)."""
    plan = tiny_plan(tmp_path_factory.mktemp("long"), target_max_position_embeddings=4096)
    model = tiny_target(plan)
    randomize(model, seed=1)
    return model


def spec_for(tmp_path: Path, **overrides: object) -> ResolvedDraft:
    return tiny_plan(tmp_path, target_max_position_embeddings=4096, **overrides).resolved_draft()


def random_drafter(spec: ResolvedDraft, seed: int = 2) -> DFlashDraftModel:
    drafter = DFlashDraftModel(spec)
    randomize(drafter, seed)
    return drafter.eval()


# ---------------------------------------------------------------------------------------------
# lossless at length
# ---------------------------------------------------------------------------------------------


def test_lossless_at_2048_new_tokens(long_target: PreTrainedModel, tmp_path: Path) -> None:
    spec = spec_for(tmp_path, block_size=4)
    prompt = list(PROMPTS[0])
    result = speculative_generate(
        long_target, random_drafter(spec), spec, prompt, max_new_tokens=LONG, eos_token_id=None
    )
    assert len(result.tokens) == LONG
    assert is_greedy_decoding(long_target, prompt, result.tokens, LONG, None)
    assert result.tokens == hf_greedy(long_target, prompt, LONG)


def test_batch_with_holes_is_lossless_at_2048_new_tokens(
    long_target: PreTrainedModel, tmp_path: Path
) -> None:
    """Rows of different lengths that accept different numbers of tokens every step."""
    spec = spec_for(tmp_path, block_size=6)
    prompts = [list(p) for p in PROMPTS]
    oracle = oracle_for(long_target, prompts, LONG, spec.block_size)
    results = speculative_generate_batch(
        long_target, oracle, spec, prompts, max_new_tokens=LONG, eos_token_id=None
    )
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == oracle.continuations[tuple(prompt)][:LONG]
        assert is_greedy_decoding(long_target, prompt, result.tokens, LONG, None)


# ---------------------------------------------------------------------------------------------
# the uncached loop is the reference
# ---------------------------------------------------------------------------------------------

VARIANTS: list[dict[str, object]] = [
    {"block_size": 2},
    {"block_size": 4},
    {"block_size": 7},
    {"block_size": 4, "projector_type": "domino", "emb_dim": 32, "gru_hidden_dim": 16},
    {"block_size": 5, "projector_type": "dspark", "markov_rank": 8, "use_confidence_head": True},
    {
        "block_size": 4,
        "projector_type": "domino",
        "emb_dim": 32,
        "gru_hidden_dim": 16,
        "shift_label": False,
        "pure_draft_prefix_len": 0,
    },
    {"block_size": 5, "projector_type": "dspark", "markov_rank": 8, "markov_head_type": "gated"},
    {"block_size": 5, "projector_type": "dspark", "markov_rank": 8, "markov_head_type": "rnn"},
    {"block_size": 4, "projector_type": "dspark", "markov_rank": 8, "shift_label": False},
    # DFlash 2: random convolutions and selector, a non-causal sliding layer, every optional
    # factor set (the kept context must give the full recompute with all of them)
    {
        "block_size": 4,
        "projector_type": "dflash2",
        "conv_kernel_size": 2,
        "conv_group_size": 8,
        "selector_rank": 8,
        "selector_top_k": 3,
        "output_multiplier": 0.5,
        "final_logit_softcapping": 5.0,
        "input_embedding_scale": 1.7,
        "layer_types": ("sliding_attention", "full_attention"),
        "sliding_window": 6,
    },
    {"block_size": 4, "layer_types": ("sliding_attention", "full_attention"), "sliding_window": 6},
    {"block_size": 6, "attention_sink": True},
]


@pytest.mark.parametrize(
    "overrides", VARIANTS, ids=lambda o: f"{o.get('projector_type', 'dflash')}-b{o['block_size']}"
)
@pytest.mark.parametrize("batch", [False, True], ids=["one-at-a-time", "batched"])
def test_real_drafters_give_the_uncached_loops_tokens_and_taus(
    long_target: PreTrainedModel, tmp_path: Path, overrides: dict[str, object], batch: bool
) -> None:
    spec = spec_for(tmp_path, **overrides)
    drafter = random_drafter(spec, seed=3)
    prompts = [list(p) for p in PROMPTS]
    n = 3 * MAX_NEW
    reference = [
        uncached_speculative_generate(
            long_target, drafter, spec, p, max_new_tokens=n, eos_token_id=None
        )
        for p in prompts
    ]
    if batch:
        results = speculative_generate_batch(
            long_target, drafter, spec, prompts, max_new_tokens=n, eos_token_id=None
        )
    else:
        results = [
            speculative_generate(long_target, drafter, spec, p, max_new_tokens=n, eos_token_id=None)
            for p in prompts
        ]
    for ours, old in zip(results, reference, strict=True):
        assert ours.tokens == old.tokens
        assert ours.accepted_per_step == old.accepted_per_step


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: str(o))
def test_kept_context_keys_and_values_give_the_full_recompute(
    long_target: PreTrainedModel, tmp_path: Path, overrides: dict[str, object]
) -> None:
    """The drafter's kept per-layer context equals a pass over the whole context."""
    spec = spec_for(tmp_path, **overrides)
    drafter = random_drafter(spec, seed=5)
    block = DFlashBlockDrafter(drafter, embed_tokens(long_target), lm_head(long_target), spec)
    rows = [list(PROMPTS[0]) + hf_greedy(long_target, PROMPTS[0], 30), list(PROMPTS[2]) * 3]
    store = FusedContext(block, len(rows))
    with torch.no_grad():
        taps = [
            taps_from_hidden_states(
                long_target(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states,
                spec.target_layer_ids,
            )
            for ids in rows
        ]
        # Grown in uneven pieces, as verification steps commit them.
        for row, ids in enumerate(rows):
            cuts = [0, 1, 4, 5, 9, len(ids) - 1]
            for start, end in itertools.pairwise(cuts):
                if start < min(end, len(ids) - 1):
                    store.extend(row, taps[row][0, start : min(end, len(ids) - 1)])
        kept = store.hidden([len(r) - 1 for r in rows], [r[-1] for r in rows])
        for row, ids in enumerate(rows):
            context = DraftContext(
                committed=tuple(ids), taps=taps[row][:, : len(ids) - 1], block_size=spec.block_size
            )
            torch.testing.assert_close(
                kept[row : row + 1], block.draft_hidden(context), atol=1e-5, rtol=1e-5
            )
            assert store.propose(rows)[row] == block.propose(context)


@pytest.mark.parametrize("block_size", [3, 5, 8])
def test_per_step_tau_equals_the_uncached_loops(
    long_target: PreTrainedModel, tmp_path: Path, block_size: int
) -> None:
    spec = spec_for(tmp_path, block_size=block_size)
    prompts = [list(p) for p in PROMPTS]
    n = 200
    old = [
        uncached_speculative_generate(
            long_target,
            oracle_for(long_target, [p], n, block_size),
            spec,
            p,
            max_new_tokens=n,
            eos_token_id=None,
        )
        for p in prompts
    ]
    alone = [
        speculative_generate(
            long_target,
            oracle_for(long_target, [p], n, block_size),
            spec,
            p,
            max_new_tokens=n,
            eos_token_id=None,
        )
        for p in prompts
    ]
    together = speculative_generate_batch(
        long_target,
        oracle_for(long_target, prompts, n, block_size),
        spec,
        prompts,
        max_new_tokens=n,
        eos_token_id=None,
    )
    for reference, one, row in zip(old, alone, together, strict=True):
        assert set(reference.accepted_per_step) == set(range(1, block_size + 1))
        assert one.accepted_per_step == reference.accepted_per_step
        assert row.accepted_per_step == reference.accepted_per_step
        assert one.tokens == row.tokens == reference.tokens


def test_rows_stop_at_their_own_eos(long_target: PreTrainedModel, tmp_path: Path) -> None:
    """A row that hits eos leaves the batch; the others go on as they would alone."""
    spec = spec_for(tmp_path, block_size=4)
    prompts = [list(p) for p in PROMPTS]
    full = hf_greedy(long_target, prompts[1], 60)
    eos = full[9]
    oracle = oracle_for(long_target, prompts, 60, 4)
    together = speculative_generate_batch(
        long_target, oracle, spec, prompts, max_new_tokens=60, eos_token_id=eos
    )
    for prompt, row in zip(prompts, together, strict=True):
        alone = uncached_speculative_generate(
            long_target,
            oracle_for(long_target, [prompt], 60, 4),
            spec,
            prompt,
            max_new_tokens=60,
            eos_token_id=eos,
        )
        assert row.tokens == alone.tokens
        assert row.accepted_per_step == alone.accepted_per_step
    assert together[1].tokens == full[: full.index(eos) + 1]


# ---------------------------------------------------------------------------------------------
# the cache after a rejection at every block position
# ---------------------------------------------------------------------------------------------


class CacheRecorder:
    """A forward pre-hook on the target: the cache it is called with, as it was at the call."""

    def __init__(self, target: PreTrainedModel) -> None:
        self.calls: list[dict[str, Any]] = []
        self.handle = target.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: object, args: tuple[object, ...], kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        assert isinstance(cache, DynamicCache)
        empty = cache.get_seq_length() == 0
        mask = kwargs.get("attention_mask")
        self.calls.append(
            {
                "length": cache.get_seq_length(),
                "keys": None if empty else [layer.keys.clone() for layer in cache.layers],
                "values": None if empty else [layer.values.clone() for layer in cache.layers],
                "positions": kwargs["position_ids"].clone(),
                "mask": None if mask is None else mask.clone(),
            }
        )


def fresh_cache(target: PreTrainedModel, tokens: Sequence[int]) -> DynamicCache:
    cache = DynamicCache(config=target.config)
    # the same forward argument as the product's (``cache`` where transformers has it)
    argument = cache_argument(target)
    target(input_ids=torch.tensor([list(tokens)]), use_cache=True, **{argument: cache})
    return cache


@pytest.mark.parametrize("batch", [False, True], ids=["one-prompt", "batch-with-holes"])
def test_cache_holds_exactly_the_accepted_tokens_after_a_rejection_at_every_position(
    long_target: PreTrainedModel, tmp_path: Path, batch: bool
) -> None:
    size = 5
    spec = spec_for(tmp_path, block_size=size)
    prompts = [list(p) for p in PROMPTS] if batch else [list(PROMPTS[0])]
    n = 40
    oracle = oracle_for(long_target, prompts, n, size)
    recorder = CacheRecorder(long_target)
    try:
        results = speculative_generate_batch(
            long_target, oracle, spec, prompts, max_new_tokens=n, eos_token_id=None
        )
    finally:
        recorder.handle.remove()
    # Every rejection position (tau 1 .. B) happened in every row.
    for result in results:
        assert set(result.accepted_per_step) == set(range(1, size + 1))
    assert len(recorder.calls) == 1 + max(r.steps for r in results)
    # Before each verification the cache holds, per row, the states of exactly the committed
    # tokens before the anchor: a fresh prefill of them gives the same keys and values.
    rows = list(range(len(prompts)))
    done = [0] * len(prompts)
    for steps_seen, call in enumerate(recorder.calls[1:], start=1):
        rows = [r for r in rows if results[r].steps >= steps_seen]
        assert call["positions"].shape[0] == len(rows)
        for i, r in enumerate(rows):
            anchor = int(call["positions"][i, 0])
            committed = [*prompts[r], *oracle.continuations[tuple(prompts[r])]]
            assert anchor == len(prompts[r]) + sum(results[r].accepted_per_step[: steps_seen - 1])
            valid = (
                torch.ones(call["length"], dtype=torch.bool)
                if call["mask"] is None
                else call["mask"][i, : call["length"]].bool()
            )
            if not batch:
                # One prompt: cropped to exactly the accepted length, no holes.
                assert call["length"] == anchor
                assert call["mask"] is None
            assert int(valid.sum()) == anchor
            reference = fresh_cache(long_target, committed[:anchor])
            for layer, fresh in enumerate(reference.layers):
                torch.testing.assert_close(
                    call["keys"][layer][i, :, valid], fresh.keys[0], atol=1e-5, rtol=1e-5
                )
                torch.testing.assert_close(
                    call["values"][layer][i, :, valid], fresh.values[0], atol=1e-5, rtol=1e-5
                )
            done[r] += 1
    assert done == [r.steps for r in results]


# ---------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------


def test_prompt_longer_than_the_targets_positions_is_refused(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path, block_size=4)  # max_position_embeddings 256
    spec = plan.resolved_draft()
    target = tiny_target(plan)
    drafter = random_drafter(spec)
    calls: list[int] = []
    handle = target.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(DataError, match=r"prompt 1 has 256 tokens.*at most 256 positions"):
            evaluate_acceptance(
                target,
                drafter,
                spec,
                [list(PROMPTS[0]), [3] * 256],
                max_new_tokens=8,
                eos_token_id=None,
            )
        with pytest.raises(
            DataError,
            match=r"prompt 0 has 200 tokens; with max_new_tokens 100 it needs 300 positions.*"
            r"lower max_new_tokens to 56",
        ):
            speculative_generate(
                target, drafter, spec, [3] * 200, max_new_tokens=100, eos_token_id=None
            )
    finally:
        handle.remove()
    assert calls == []  # refused before any target pass
    # At the limit it runs.
    result = speculative_generate(
        target, drafter, spec, [3] * 200, max_new_tokens=56, eos_token_id=None
    )
    assert len(result.tokens) == 56


def test_sliding_window_target_is_lossless_and_batches_one_at_a_time(tmp_path: Path) -> None:
    """A target whose windows count cache slots: crops past the window keep working (the
    cache records past states), and a batch runs its prompts one at a time."""
    target = sliding_target(8)
    assert not holds_holes(target)
    spec = spec_for(tmp_path, block_size=4)
    prompts = [list(p) for p in PROMPTS]
    n = 60  # well past the window of 8
    oracle = oracle_for(target, prompts, n, 4)
    results = speculative_generate_batch(
        target, oracle, spec, prompts, max_new_tokens=n, eos_token_id=None
    )
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == oracle.continuations[tuple(prompt)][:n]
        reference = uncached_speculative_generate(
            target,
            oracle_for(target, [prompt], n, 4),
            spec,
            prompt,
            max_new_tokens=n,
            eos_token_id=None,
        )
        assert result.accepted_per_step == reference.accepted_per_step


def sliding_target(window: int) -> PreTrainedModel:
    """A tiny Qwen3 whose last two of four layers attend over ``window`` positions."""
    config = Qwen3Config(
        vocab_size=TINY_VOCAB,
        hidden_size=TINY_HIDDEN,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=512,
        use_sliding_window=True,
        sliding_window=window,
        max_window_layers=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(config).eval()
    randomize(target, seed=1)
    return target


def test_sliding_window_layers_are_cut_to_the_window_after_every_pass(tmp_path: Path) -> None:
    """Every verification pass, fully accepted blocks included, is followed by a crop: a
    sliding-window layer recording its past keeps what a pass added until the next crop, and
    transformers 5.17 hands all of it to the next pass while the mask counts ``window - 1``
    states (the pass fails on a shape mismatch; later releases slice, the layer grows). The
    prefill records nothing, so a prompt longer than the window leaves only the window."""
    window = 8
    target = sliding_target(window)
    spec = spec_for(tmp_path, block_size=4)
    prompt = [(7 * k + 3) % TINY_VOCAB for k in range(3 * window)]
    n = 40
    oracle = oracle_for(target, [prompt], n, 4)  # full acceptances among the steps
    held: list[list[int]] = []  # states each sliding layer holds when a pass starts

    def record(_module: nn.Module, _args: Any, kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        held.append(
            [
                int(layer.keys.shape[-2])
                for layer in cache.layers
                if getattr(layer, "is_sliding", False) and layer.is_initialized
            ]
        )

    handle = target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        result = speculative_generate(
            target, oracle, spec, prompt, max_new_tokens=n, eos_token_id=None
        )
    finally:
        handle.remove()
    assert result.tokens == oracle.continuations[tuple(prompt)][:n]
    assert max(result.accepted_per_step) == 4  # a fully accepted block was among the steps
    assert held[0] == []  # the prefill starts from an empty cache
    assert all(len(sizes) == 2 for sizes in held[1:])
    assert max(max(sizes) for sizes in held[1:]) == window - 1
