"""Verification on caches that are not plain KV caches (issue 48).

Linear-attention layers (Qwen3-Next: convolution and recurrent states) and sliding windows
(Gemma 3, gpt-oss with its attention sinks, Mistral) narrower than a prompt plus its answer:
the loop is lossless against greedy decoding, measures the uncached loop's taus, leaves no trace
of a rejected token in any layer's state, and verifies a batch one prompt at a time.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from testkit.greedy_oracle import CyclingOracle, hf_greedy, oracle_for
from testkit.hybrid_targets import FAMILIES, TINY_WINDOW, hybrid_target
from testkit.reference_loop import uncached_speculative_generate
from testkit.tiny import PROMPTS, TINY_VOCAB, randomize, tiny_plan
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin

from dflash_recipes.executor.evaluation.cached_decoding import speculative_generate_batch
from dflash_recipes.executor.evaluation.speculative import DraftContext
from dflash_recipes.executor.evaluation.target_cache import cache_argument, holds_holes
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.plan.draft_spec import ResolvedDraft

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
NEW = 20
#: Three windows long: the prompt alone fills a sliding layer's window.
LONG_PROMPT = tuple((7 * k + 3) % TINY_VOCAB for k in range(3 * TINY_WINDOW))
#: A one-token prompt (shorter than a convolution kernel), a short one and a long one.
HYBRID_PROMPTS = [list(PROMPTS[2]), list(PROMPTS[0]), list(LONG_PROMPT)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def target(request: pytest.FixtureRequest) -> PreTrainedModel:
    return hybrid_target(request.param)


def spec_for(tmp_path: Path) -> ResolvedDraft:
    plan = tiny_plan(tmp_path, block_size=BLOCK, target_max_position_embeddings=512)
    return plan.resolved_draft()


@pytest.mark.parametrize("batch", [False, True], ids=["one-at-a-time", "batched"])
def test_every_family_is_lossless_with_a_rejection_at_every_position(
    target: PreTrainedModel, tmp_path: Path, batch: bool
) -> None:
    """Tokens equal transformers' greedy ones and the taus the uncached loop's, every
    rejection position (tau 1 .. B) taken, in a batch too (its prompts one at a time)."""
    spec = spec_for(tmp_path)
    assert not holds_holes(target)
    if batch:
        oracle = oracle_for(target, HYBRID_PROMPTS, NEW, BLOCK)
        results = speculative_generate_batch(
            target, oracle, spec, HYBRID_PROMPTS, max_new_tokens=NEW, eos_token_id=None
        )
    else:
        results = [
            speculative_generate_batch(
                target,
                oracle_for(target, [prompt], NEW, BLOCK),
                spec,
                [prompt],
                max_new_tokens=NEW,
                eos_token_id=None,
            )[0]
            for prompt in HYBRID_PROMPTS
        ]
    for prompt, result in zip(HYBRID_PROMPTS, results, strict=True):
        assert result.tokens == hf_greedy(target, prompt, NEW)
        assert set(result.accepted_per_step) == set(range(1, BLOCK + 1))
        reference = uncached_speculative_generate(
            target,
            oracle_for(target, [prompt], NEW, BLOCK),
            spec,
            prompt,
            max_new_tokens=NEW,
            eos_token_id=None,
        )
        assert result.accepted_per_step == reference.accepted_per_step


def test_a_real_drafter_gives_the_uncached_loops_tokens_and_taus(
    target: PreTrainedModel, tmp_path: Path
) -> None:
    spec = spec_for(tmp_path)
    drafter = DFlashDraftModel(spec)
    randomize(drafter, seed=3)
    drafter.eval()
    results = speculative_generate_batch(
        target, drafter, spec, HYBRID_PROMPTS, max_new_tokens=NEW, eos_token_id=None
    )
    for prompt, result in zip(HYBRID_PROMPTS, results, strict=True):
        reference = uncached_speculative_generate(
            target, drafter, spec, prompt, max_new_tokens=NEW, eos_token_id=None
        )
        assert result.tokens == reference.tokens == hf_greedy(target, prompt, NEW)
        assert result.accepted_per_step == reference.accepted_per_step
        assert all(1 <= tau <= BLOCK for tau in result.accepted_per_step)


# ---------------------------------------------------------------------------------------------
# no trace of a rejected token
# ---------------------------------------------------------------------------------------------


def layer_states(cache: Cache) -> list[list[Tensor]]:
    """Every state each layer holds: keys and values (a window of them), convolution and
    recurrent states, cloned."""
    states: list[list[Tensor]] = []
    for layer in cache.layers:
        held: list[Tensor] = []
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for i in range(layer.number_of_states):
                if layer.is_conv_states_initialized[i]:
                    held.append(layer.conv_states[i])
                if layer.is_recurrent_states_initialized[i]:
                    held.append(layer.recurrent_states[i])
        if isinstance(layer, CacheLayerMixin) and layer.is_initialized:
            held += [layer.keys, layer.values]
        states.append([t.clone() for t in held])
    return states


def fresh_states(target: PreTrainedModel, tokens: Sequence[int]) -> list[list[Tensor]]:
    """The states of a plain prefill of ``tokens``: what an exact rollback leaves."""
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(
            input_ids=torch.tensor([list(tokens)]),
            use_cache=True,
            **{cache_argument(target): cache},
        )
    return layer_states(cache)


class CacheAtVerification:
    """The oracle's proposals, and the target's cache as each verification pass found it (the
    first target pass after a proposal; a pass run again after a rollback is only counted)."""

    def __init__(self, target: PreTrainedModel, oracle: CyclingOracle) -> None:
        self.oracle = oracle
        self.passes = 0
        self.found: list[tuple[int, list[list[Tensor]]]] = []  # (anchor, states)
        self._proposed = False
        self.handle = target.register_forward_pre_hook(self.pre_hook, with_kwargs=True)

    def propose(self, context: DraftContext) -> list[int]:
        self._proposed = True
        return self.oracle.propose(context)

    def pre_hook(self, _module: object, _args: object, kwargs: dict[str, Any]) -> None:
        self.passes += 1
        if self._proposed:
            self._proposed = False
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            assert isinstance(cache, Cache)
            self.found.append((int(kwargs["position_ids"][0, 0]), layer_states(cache)))


def run_and_compare(target: PreTrainedModel, tmp_path: Path) -> tuple[list[int], int]:
    """Generate after the long prompt, compare the cache at every verification with a fresh
    prefill of the tokens before the anchor; the taus and the number of target passes."""
    prompt = list(LONG_PROMPT)
    oracle = oracle_for(target, [prompt], NEW, BLOCK)
    watch = CacheAtVerification(target, oracle)
    try:
        (result,) = speculative_generate_batch(
            target, watch, spec_for(tmp_path), [prompt], max_new_tokens=NEW, eos_token_id=None
        )
    finally:
        watch.handle.remove()
    committed = [*prompt, *oracle.continuations[tuple(prompt)]]
    assert result.tokens == committed[len(prompt) : len(prompt) + NEW]
    assert set(result.accepted_per_step) == set(range(1, BLOCK + 1))
    assert len(watch.found) == result.steps
    for anchor, states in watch.found:
        expected = fresh_states(target, committed[:anchor])
        assert [len(layer) for layer in states] == [len(layer) for layer in expected]
        for ours, fresh in zip(states, expected, strict=True):
            for held, wanted in zip(ours, fresh, strict=True):
                assert held.shape == wanted.shape
                torch.testing.assert_close(held, wanted, atol=1e-4, rtol=1e-4)
    return result.accepted_per_step, watch.passes


def records_recurrent_states() -> bool:
    """Whether this transformers' linear-attention layers record a pass's recurrent states
    (``recurrent_states_to_keep``; 5.17's do not)."""
    activate = LinearAttentionCacheLayerMixin.activate_past_recording
    return "recurrent_states_to_keep" in inspect.signature(activate).parameters


def test_rejected_tokens_leave_no_trace_in_any_layer(
    target: PreTrainedModel, tmp_path: Path
) -> None:
    """Before every verification each layer holds what a prefill of the committed tokens gives:
    keys and values, the window's, the convolution and recurrent states; one target pass a
    step where the cache records what it needs (everywhere but 5.17's linear attention)."""
    taus, passes = run_and_compare(target, tmp_path)
    linear = any(
        isinstance(layer, LinearAttentionCacheLayerMixin)
        for layer in DynamicCache(config=target.config).layers
    )
    if records_recurrent_states() or not linear:
        assert passes == 1 + len(taus)


def test_a_model_that_records_only_its_last_recurrent_state_is_taken_back_and_run_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model that ignores ``recurrent_states_to_keep`` (as every model on transformers 5.17
    does) leaves a record no crop can use: each step that rejected something is taken back and
    its accepted inputs run again, as exact as the recorded rollback."""
    target = hybrid_target("qwen3_next")
    # What Qwen3-Next asks the cache for; 0 makes it record only the state after the last input.
    monkeypatch.setattr(Cache, "get_recurrent_states_to_keep", lambda *_, **__: 0, raising=False)
    taus, passes = run_and_compare(target, tmp_path)
    assert passes == 1 + len(taus) + sum(tau < BLOCK for tau in taus)
