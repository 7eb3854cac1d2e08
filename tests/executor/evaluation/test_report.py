"""The arithmetic of an acceptance report: tau per workload tag (issue 52)."""

from __future__ import annotations

from dflash_recipes.executor.evaluation.report import UNTAGGED, acceptance_per_tag
from dflash_recipes.executor.evaluation.speculative import SpecResult


def _result(*taus: int) -> SpecResult:
    return SpecResult(tokens=[1] * sum(taus), accepted_per_step=list(taus), block_size=4)


def test_prompts_without_tags_report_none() -> None:
    assert acceptance_per_tag([_result(2, 1)], [None]) == []


def test_each_tag_is_pooled_over_its_own_steps() -> None:
    results = [_result(2, 1), _result(4), _result(3, 3, 3)]
    found = acceptance_per_tag(results, ["code", None, "code"])
    assert [(t.tag, t.num_prompts, t.steps) for t in found] == [("code", 2, 5), (UNTAGGED, 1, 1)]
    code, untagged = found
    assert code.tau == (2 + 1 + 3 + 3 + 3) / 5
    assert code.tau_per_prompt_mean == (1.5 + 3) / 2
    assert untagged.tau == 4.0
