"""tau with the head switched off (issue 37): DFlash 2's eval drafts with the selector's greedy
path, stays lossless, and also reports the unary argmax path's tau so users see what the
selector buys; kinds that do not ask for it measure once."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
from testkit.dflash2_fixtures import TINY_DFLASH2
from testkit.tiny import MAX_NEW, PROMPTS, randomize, tiny_plan, tiny_target
from transformers import PreTrainedModel

from dflash_recipes.executor.evaluation import evaluate as evaluate_module
from dflash_recipes.executor.evaluation.cached_decoding import speculative_generate_batch
from dflash_recipes.executor.evaluation.evaluate import AcceptanceReport, evaluate_acceptance
from dflash_recipes.executor.evaluation.speculative import (
    BlockDrafter,
    DFlashBlockDrafter,
    DraftContext,
    SpecResult,
    as_block_drafter,
    greedy_generate,
)
from dflash_recipes.executor.model.convert import lm_head
from dflash_recipes.executor.model.draft import DFlashDraftModel, taps_from_hidden_states
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.plan.run_plan import RunPlan

pytestmark = pytest.mark.usefixtures("one_thread")

#: The tiny DFlash 2 drafter's own fields (hidden 64: 8 coefficient groups of 8 channels).
DFLASH2: dict[str, object] = {"projector_type": "dflash2", **TINY_DFLASH2}


def dflash2_plan(tmp_path: Path, **overrides: object) -> RunPlan:
    """A tiny DFlash 2 plan (block size 4): ``tiny_plan`` with the kind's fields set."""
    return tiny_plan(tmp_path, block_size=4, **DFLASH2, **overrides)


def dflash2_drafter(spec: ResolvedDraft, codebook_std: float, seed: int = 5) -> DFlashDraftModel:
    """A random DFlash 2 drafter whose successor codebook is normal(0, `codebook_std`) (0: the
    fresh drafter's zero codebook, under which the selector adds nothing to the unary scores)."""
    drafter = DFlashDraftModel(spec)
    randomize(drafter, seed)
    successor = drafter.candidate_selector.successor_codebook
    with torch.no_grad():
        successor.zero_()
        if codebook_std:
            successor.normal_(std=codebook_std, generator=torch.Generator().manual_seed(seed))
    return drafter.eval()


@pytest.fixture
def setup(tmp_path: Path) -> tuple[ResolvedDraft, PreTrainedModel]:
    plan = dflash2_plan(tmp_path)
    target = tiny_target(plan)
    randomize(target, seed=1)
    return plan.resolved_draft(), target


def _prompts() -> list[list[int]]:
    return [list(p) for p in PROMPTS]


def _evaluate(
    target: PreTrainedModel,
    drafter: DFlashDraftModel | BlockDrafter,
    spec: ResolvedDraft,
    batch_size: int = 1,
) -> AcceptanceReport:
    return evaluate_acceptance(
        target,
        drafter,
        spec,
        _prompts(),
        max_new_tokens=MAX_NEW,
        eos_token_id=None,
        batch_size=batch_size,
    )


def _pooled(results: list[SpecResult]) -> float:
    steps = [tau for result in results for tau in result.accepted_per_step]
    return sum(steps) / len(steps)


def _blocks(
    spec: ResolvedDraft, target: PreTrainedModel, drafter: DFlashDraftModel
) -> tuple[DFlashBlockDrafter, DFlashBlockDrafter, list[DraftContext]]:
    """The drafter with its head on and off, and the blocks anchored at every position of
    each prompt's greedy continuation."""
    on = as_block_drafter(drafter, target, spec)
    off = as_block_drafter(drafter, target, spec, use_head=False)
    assert isinstance(on, DFlashBlockDrafter) and isinstance(off, DFlashBlockDrafter)
    contexts = []
    for prompt in _prompts():
        full = [*prompt, *greedy_generate(target, prompt, MAX_NEW, None)]
        with torch.no_grad():
            out = target(torch.tensor([full]), output_hidden_states=True)
        taps = taps_from_hidden_states(out.hidden_states, spec.target_layer_ids)
        for end in range(len(prompt), len(full) + 1):
            contexts.append(
                DraftContext(committed=tuple(full[:end]), taps=taps[:, : end - 1], block_size=4)
            )
    return on, off, contexts


@pytest.mark.parametrize("batch_size", [1, 2])
def test_dflash2_eval_with_the_selector_is_lossless_and_reports_both_taus(
    setup: tuple[ResolvedDraft, PreTrainedModel], batch_size: int
) -> None:
    spec, target = setup
    drafter = dflash2_drafter(spec, codebook_std=1.0)
    report = _evaluate(target, drafter, spec, batch_size)
    assert report.lossless and report.mismatched_prompts == []
    assert report.mismatched_prompts_without_head == []
    assert report.head == spec.head_description
    # the head-off figures are the backbone argmax path's own measurement
    off = as_block_drafter(drafter, target, spec, use_head=False)
    results = speculative_generate_batch(
        target, off, spec, _prompts(), max_new_tokens=MAX_NEW, eos_token_id=None
    )
    assert report.tau_without_head == pytest.approx(_pooled(results))
    own = [sum(r.accepted_per_step) / len(r.accepted_per_step) for r in results]
    assert report.tau_without_head_per_prompt_mean == pytest.approx(sum(own) / len(own))
    assert 1.0 <= report.tau_without_head <= spec.drafted_tokens + 1
    row = report.to_dict()
    assert row["tau_without_head"] == report.tau_without_head
    assert row["tau_without_head_per_prompt_mean"] == report.tau_without_head_per_prompt_mean
    assert row["mismatched_prompts_without_head"] == []
    assert drafter.training is False and target.training is False


def test_the_selector_changes_proposals_and_a_zero_codebook_changes_nothing(
    setup: tuple[ResolvedDraft, PreTrainedModel],
) -> None:
    spec, target = setup
    on, off, contexts = _blocks(spec, target, dflash2_drafter(spec, codebook_std=1.0))
    with torch.no_grad():
        head = [on.propose(c) for c in contexts]
        argmax = [off.propose(c) for c in contexts]
        backbone = [
            [int(t) for t in lm_head(target)(on.draft_hidden(c))[0, 1:].argmax(-1)]
            for c in contexts
        ]
    assert argmax == backbone  # head off: the unary argmax at block positions 1 .. B-1
    assert sum(h != a for h, a in zip(head, argmax, strict=True)) > 0  # the selector decides

    drafter = dflash2_drafter(spec, codebook_std=0.0)
    on, off, contexts = _blocks(spec, target, drafter)
    with torch.no_grad():
        assert [on.propose(c) for c in contexts] == [off.propose(c) for c in contexts]
    report = _evaluate(target, drafter, spec)
    assert report.lossless
    assert report.tau_without_head == report.tau
    assert report.tau_without_head_per_prompt_mean == report.tau_per_prompt_mean


def test_tau_without_the_head_is_measured_with_the_head_off(
    setup: tuple[ResolvedDraft, PreTrainedModel],
) -> None:
    # A target with a zero lm_head: every logit ties, so greedy decoding (and the backbone's
    # argmax, through the same lm_head) is always token 0. The unary path proposes exactly the
    # target's tokens; the selector, choosing among tied candidates by its pair scores, misses.
    spec, target = setup
    with torch.no_grad():
        lm_head(target).weight.zero_()
    report = _evaluate(target, dflash2_drafter(spec, codebook_std=1.0), spec)
    assert report.lossless
    assert report.tau_without_head == report.tau_without_head_per_prompt_mean == 4.0
    assert report.tau < 4.0


def test_a_head_off_output_that_is_not_greedy_makes_the_report_not_lossless(
    setup: tuple[ResolvedDraft, PreTrainedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, target = setup

    def broken_head_off(*args: object, **kwargs: object) -> list[SpecResult]:
        results: list[SpecResult] = speculative_generate_batch(*args, **kwargs)  # type: ignore[arg-type]
        drafter = args[1]
        if isinstance(drafter, DFlashBlockDrafter) and not drafter.use_head:
            wrong = results[1]
            tokens = [*wrong.tokens[:-1], (wrong.tokens[-1] + 1) % 100]
            results[1] = attrs.evolve(wrong, tokens=tokens)
        return results

    monkeypatch.setattr(evaluate_module, "speculative_generate_batch", broken_head_off)
    report = _evaluate(target, dflash2_drafter(spec, codebook_std=1.0), spec, len(PROMPTS))
    assert not report.lossless
    assert report.mismatched_prompts == []
    assert report.mismatched_prompts_without_head == [1]
    assert report.to_dict()["mismatched_prompts_without_head"] == [1]


class ArgmaxOracle:
    """A BlockDrafter with no head to switch off: proposes the target's greedy tokens."""

    def __init__(self, target: PreTrainedModel) -> None:
        self.target = target

    def propose(self, context: DraftContext) -> list[int]:
        return greedy_generate(self.target, context.committed, context.block_size - 1, None)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"projector_type": "domino", "emb_dim": 16, "gru_hidden_dim": 8},
        {"projector_type": "dspark", "markov_rank": 4},
    ],
    ids=["dflash", "domino", "dspark"],
)
def test_other_kinds_measure_once_and_leave_the_fields_unset(
    tmp_path: Path, overrides: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = tiny_plan(tmp_path, block_size=4, **overrides)
    spec = plan.resolved_draft()
    target = tiny_target(plan)
    randomize(target, seed=1)
    drafter = DFlashDraftModel(spec)
    randomize(drafter, seed=5)
    calls: list[object] = []

    def counted(*args: object, **kwargs: object) -> list[SpecResult]:
        calls.append(args[1])
        return speculative_generate_batch(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(evaluate_module, "speculative_generate_batch", counted)
    report = _evaluate(target, drafter.eval(), spec, batch_size=len(PROMPTS))
    assert report.lossless and calls == [drafter]
    assert report.tau_without_head is None and report.tau_without_head_per_prompt_mean is None
    row = report.to_dict()
    assert row["tau_without_head"] is None and row["tau_without_head_per_prompt_mean"] is None


def test_a_bare_block_drafter_is_measured_once_even_for_dflash2(
    setup: tuple[ResolvedDraft, PreTrainedModel],
) -> None:
    spec, target = setup
    oracle = ArgmaxOracle(target)
    report = _evaluate(target, oracle, spec)
    assert report.lossless and report.tau == 4.0  # every proposal right
    assert report.tau_without_head is None
    with pytest.raises(ValueError, match="use_head=False needs a drafter module"):
        as_block_drafter(oracle, target, spec, use_head=False)


def test_a_wrapped_drafter_switches_its_head_off_and_back(
    setup: tuple[ResolvedDraft, PreTrainedModel],
) -> None:
    spec, target = setup
    on = as_block_drafter(dflash2_drafter(spec, codebook_std=1.0), target, spec)
    assert isinstance(on, DFlashBlockDrafter) and on.use_head
    off = as_block_drafter(on, target, spec, use_head=False)
    assert isinstance(off, DFlashBlockDrafter) and not off.use_head and off.model is on.model
    assert as_block_drafter(on, target, spec) is on
    assert on.use_head  # switching a copy off leaves the original drafting with its head
    # the verification loop wraps what it is given as is: the head stays off
    assert as_block_drafter(off, target, spec) is off
    assert as_block_drafter(off, target, spec, use_head=True) is not off
