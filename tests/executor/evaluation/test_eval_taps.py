"""Eval's drafter sees the taps training takes: each decoder layer's output, the last one
before the final norm, whatever the KV cache did in between (rejections, crops, windows)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
from testkit.families import FAMILIES, build_target, missing_reason
from testkit.tiny import tiny_plan

from dflash_recipes.executor.evaluation.cached_decoding import speculative_generate
from dflash_recipes.executor.evaluation.speculative import DraftContext
from dflash_recipes.executor.model.target_states import decoder_layers, target_states

_BY_NAME = {family.name: family for family in FAMILIES}


@attrs.define
class _Recording:
    """Proposes a fixed token (most blocks are rejected early) and keeps every context."""

    drafted: int
    contexts: list[DraftContext] = attrs.field(factory=list)

    def propose(self, context: DraftContext) -> list[int]:
        self.contexts.append(context)
        return [7] * self.drafted


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text", "gpt_oss"])
def test_eval_context_taps_equal_the_training_taps(tmp_path: Path, name: str) -> None:
    family = _BY_NAME[name]
    reason = missing_reason(family)
    if reason is not None:
        pytest.skip(reason)
    target = build_target(family)
    last = len(decoder_layers(target)) - 1
    spec = attrs.evolve(tiny_plan(tmp_path).resolved_draft(), target_layer_ids=(0, last))
    drafter = _Recording(spec.drafted_tokens)
    prompt = list(range(30, 42))
    # past the 8-token sliding windows of the family targets
    speculative_generate(target, drafter, spec, prompt, max_new_tokens=24, eos_token_id=None)
    context = drafter.contexts[-1]
    seen = torch.tensor([list(context.committed[:-1])])
    with torch.no_grad():
        training = target_states(
            target, seen, torch.ones_like(seen), spec.target_layer_ids, with_logits=False
        ).tapped
    assert context.taps.shape == training.shape
    torch.testing.assert_close(context.taps, training, rtol=1e-4, atol=1e-4)
