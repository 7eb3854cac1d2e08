"""The resume policy (issue 49): every plan field has a verdict, and the diff names each change."""

from __future__ import annotations

from pathlib import Path

from testkit.compiling import tiny_scratch_plan

from dflash_recipes.plan.resume_changes import (
    ARCHITECTURE,
    DATA,
    SCHEDULE,
    TAPS,
    UNCLASSIFIED,
    _leaves,
    plan_changes,
    rule_for,
)


def test_every_field_of_a_plan_has_a_rule(tmp_path: Path) -> None:
    """A new plan field must be classified in RULES (it is warned about until it is)."""
    plan = tiny_scratch_plan(tmp_path / "run")
    unclassified = [path for path in _leaves(plan.to_dict()) if rule_for(path) is UNCLASSIFIED]
    assert unclassified == []
    assert rule_for("no_such_section.field") is UNCLASSIFIED
    assert UNCLASSIFIED.verdict == "warn"


def test_the_policy_refuses_the_drafter_and_warns_for_the_run(tmp_path: Path) -> None:
    verdicts = {
        path: rule_for(path).verdict
        for path in (
            "draft.architecture.num_hidden_layers",
            "draft.target_layer_ids",
            "draft.mask_token_id",
            "base_model.facts.hidden_size",
            "training.max_steps",
            "training.learning_rate",
            "training.logging_steps",
            "data.data_path",
            "draft.objective.loss_objective",
            "data.cache_dir",
            "resume.step",
            "overrides",
        )
    }
    assert verdicts == {
        "draft.architecture.num_hidden_layers": "refuse",
        "draft.target_layer_ids": "refuse",
        "draft.mask_token_id": "refuse",
        "base_model.facts.hidden_size": "refuse",
        "training.max_steps": "warn",
        "training.learning_rate": "warn",
        "training.logging_steps": "warn",
        "data.data_path": "warn",
        "draft.objective.loss_objective": "warn",
        "data.cache_dir": "ignore",
        "resume.step": "ignore",
        "overrides": "ignore",
    }


def test_the_diff_names_each_changed_field_and_nothing_a_resume_changes_by_itself(
    tmp_path: Path,
) -> None:
    saved = tiny_scratch_plan(tmp_path / "run", "training.max_steps=4")
    new = tiny_scratch_plan(
        tmp_path / "run", "training.max_steps=6", "training.seed=3", "data.num_proc=2"
    )
    assert saved.fingerprint != new.fingerprint
    changes = plan_changes(saved, new)
    assert [(c.describe(), c.rule.effect) for c in changes] == [
        ("training.max_steps 4 -> 6", SCHEDULE),
        ("training.seed 0 -> 3", DATA),
    ]
    assert plan_changes(saved, saved) == ()
    smaller = tiny_scratch_plan(
        tmp_path / "run",
        "training.max_steps=4",
        "dflash.dflash_architecture_config.num_hidden_layers=1",
    )
    assert [(c.describe(), c.rule.effect) for c in plan_changes(saved, smaller)] == [
        ("draft.architecture.num_hidden_layers 2 -> 1", ARCHITECTURE),
        ("draft.target_layer_ids [1,3] -> [3]", TAPS),  # the default taps of a 1-layer drafter
    ]
