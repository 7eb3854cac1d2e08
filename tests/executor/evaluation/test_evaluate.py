"""Pooled tau versus the mean of per-prompt taus (issue 11): both reported, each named."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from testkit.tiny import MAX_NEW, PROMPTS, randomize, tiny_plan, tiny_target
from transformers import PreTrainedModel

from dflash_recipes.executor.evaluation.evaluate import evaluate_acceptance
from dflash_recipes.executor.evaluation.speculative import DraftContext, greedy_generate

pytestmark = pytest.mark.usefixtures("one_thread")


class PerPromptOracle:
    """Proposes the target's greedy tokens for a given number of block positions per prompt."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], correct: list[int]):
        self.continuations = continuations
        self.correct = dict(zip(continuations, correct, strict=True))

    def propose(self, context: DraftContext) -> list[int]:
        committed = list(context.committed)
        prompt = next(p for p in self.continuations if committed[: len(p)] == list(p))
        full = [*prompt, *self.continuations[prompt]]
        right = full[len(committed) : len(committed) + context.block_size - 1]
        good = self.correct[prompt]
        return [t if k < good else (t + 1) % 100 for k, t in enumerate(right)]


def test_pooled_and_per_prompt_mean_tau_differ_and_are_both_reported(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path, block_size=4)
    spec = plan.resolved_draft()
    target: PreTrainedModel = tiny_target(plan)
    randomize(target, seed=1)
    prompts = [list(p) for p in PROMPTS]
    continuations = {
        tuple(p): greedy_generate(target, p, MAX_NEW + spec.block_size, None) for p in prompts
    }
    # prompt 0: every proposal right (tau 4 per step); prompts 1 and 2: none (tau 1 per step)
    oracle = PerPromptOracle(continuations, [3, 0, 0])
    report = evaluate_acceptance(
        target, oracle, spec, prompts, max_new_tokens=MAX_NEW, eos_token_id=None
    )
    fast_steps = math.ceil((MAX_NEW - 1) / 4)
    slow_steps = MAX_NEW - 1
    pooled = (4 * fast_steps + 2 * slow_steps) / (fast_steps + 2 * slow_steps)
    assert report.lossless
    assert report.tau_per_prompt == [4.0, 1.0, 1.0]
    assert report.tau_per_prompt_mean == pytest.approx(2.0)
    assert report.tau == report.tau_pooled == pytest.approx(pooled)
    assert report.tau_pooled < 1.5 < report.tau_per_prompt_mean  # long, slow prompts weigh more

    row = report.to_dict()
    assert row["tau"] == row["tau_pooled"] == pytest.approx(pooled)
    assert row["tau_per_prompt_mean"] == pytest.approx(2.0)
    assert row["tau_per_prompt"] == [4.0, 1.0, 1.0]
