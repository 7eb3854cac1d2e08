"""`eval` with prompts that carry a workload tag (issue 52): `--json` reports one tau per tag,
pooled over that tag's verification steps, and `--write-card` puts the table into the card."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit.cli_runner import cli

#: A short schema: the tiny target takes 256 positions.
TOOL = {"type": "function", "function": {"name": "f"}}
PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "a drafter proposes a block and the target verifies it",
]


def _rows() -> list[dict[str, object]]:
    chat = [{"tag": "chat", "messages": [{"role": "user", "content": p}]} for p in PROMPTS]
    tool = [
        {
            "tag": "tool",
            "tools": [TOOL],
            "messages": [
                {"role": "user", "content": p},
                {"role": "assistant", "content": "the answer, not part of the prompt"},
            ],
        }
        for p in reversed(PROMPTS)
    ]
    untagged = {"messages": [{"role": "user", "content": PROMPTS[0] + " again"}]}
    return [chat[0], tool[0], chat[1], tool[1], untagged]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(plan.json, export, tagged prompts) of a tiny random target and drafter."""
    from testkit.tiny import saved_eval_setup

    root = tmp_path_factory.mktemp("tags")
    plan, export = saved_eval_setup(root, PROMPTS)
    plan_file = root / "plan.json"
    plan_file.write_text(plan.to_json(), encoding="utf-8")
    prompts = root / "tagged.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in _rows()), encoding="utf-8")
    return plan_file, export, prompts


@pytest.mark.usefixtures("one_thread")
def test_eval_json_reports_one_tau_per_tag_and_the_card_shows_them(
    exported: tuple[Path, Path, Path],
) -> None:
    plan_file, export, prompts = exported
    result = cli(
        "eval", str(plan_file), "--prompts", str(prompts), "--max-new-tokens", "6",
        "--write-card", str(export), "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    per_tag = report["tau_per_tag"]
    assert sorted(per_tag) == ["chat", "tool", "untagged"]
    assert [per_tag[t]["num_prompts"] for t in ("chat", "tool", "untagged")] == [2, 2, 1]
    # each tag's tau is pooled over its own steps: together they make the overall tau
    steps = sum(per_tag[t]["steps"] for t in per_tag)
    assert steps == report["steps"]
    pooled = sum(per_tag[t]["tau"] * per_tag[t]["steps"] for t in per_tag) / steps
    assert pooled == pytest.approx(report["tau"])
    text = (export / "README.md").read_text(encoding="utf-8")
    assert "| workload | prompts | tau (pooled) |" in text
    for tag in ("chat", "tool", "untagged"):
        assert f"| {tag} | {per_tag[tag]['num_prompts']} | {per_tag[tag]['tau']:.3f} |" in text


@pytest.mark.usefixtures("one_thread")
def test_eval_prints_tau_per_tag(exported: tuple[Path, Path, Path]) -> None:
    plan_file, export, prompts = exported
    result = cli(
        "eval", str(plan_file), "--prompts", str(prompts), "--max-new-tokens", "6",
        "--checkpoint", str(export),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    line = next(x for x in result.stdout.splitlines() if "per workload tag" in x)
    assert "chat" in line and "(2 prompts)" in line and "untagged" in line and "(1 prompt)" in line
