"""The local transformers backend of regenerate."""

from __future__ import annotations

from pathlib import Path

from testkit.regenerating import _conversations, _plan, _read, _recipe, _write_jsonl

from dflash_recipes.executor.regenerate.job import RegenerateSummary, run_regenerate
from dflash_recipes.plan.run_plan import RunPlan


def _run(plan: RunPlan, out: Path, backoff_base_s: float = 0.5) -> RegenerateSummary:
    return run_regenerate(
        plan, output_path=out, progress=False, echo=lambda _: None, backoff_base_s=backoff_base_s
    )


def test_local_backend_fails_only_the_conversation_too_long_for_the_target(
    tmp_path: Path,
) -> None:
    rows = _conversations(2)
    rows.insert(1, {"messages": [{"role": "user", "content": "give me " * 400}]})
    data = _write_jsonl(tmp_path / "in.jsonl", rows)
    summary = _run(_plan(_recipe(tmp_path, data)), tmp_path / "out.jsonl")
    assert (summary.answered, summary.failed) == (2, 1)
    assert summary.failures[0]["line"] == 2
    assert "prompt too long" in str(summary.failures[0]["reason"])
    assert "max_position_embeddings=512" in str(summary.failures[0]["reason"])
    assert summary.failure_reasons == {"prompt too long": 1}
    assert len(_read(tmp_path / "out.jsonl")) == 2
