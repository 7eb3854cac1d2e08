"""A run plan is checked, not trusted: fingerprint required and verified, values re-validated.

`run`, `export` and `eval` read plan.json files; each refusal here is what a user who edited,
truncated or forged a plan sees (one `error:` line, exit 1, no traceback, no model loaded).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import attrs
import pytest
from testkit.cli_runner import cli

from dflash_recipes.errors import PlanError
from dflash_recipes.plan import value_checks
from dflash_recipes.plan.run_plan import (
    PLAN_FORMAT_VERSION,
    RunPlan,
    _canonical,
    _sha256_constructor,
)


def refingerprint(data: dict[str, Any]) -> dict[str, Any]:
    """What a forger does: recompute the fingerprint after editing the content."""
    payload = {k: v for k, v in data.items() if k != "fingerprint"}
    return {**payload, "fingerprint": hashlib.sha256(_canonical(payload)).hexdigest()}


def write_plan(path: Path, data: dict[str, Any] | str) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


def test_a_plan_without_a_fingerprint_is_refused(plan_dict: dict[str, Any]) -> None:
    del plan_dict["fingerprint"]
    with pytest.raises(PlanError, match="has no fingerprint") as info:
        RunPlan.from_dict(plan_dict)
    assert "dflash-recipe compile RECIPE" in str(info.value)


def test_an_edited_plan_is_refused_with_the_hint_to_recompile(plan_dict: dict[str, Any]) -> None:
    plan_dict["training"]["learning_rate"] = 0.5
    with pytest.raises(PlanError, match="does not match its content") as info:
        RunPlan.from_dict(plan_dict)
    assert "dflash-recipe compile RECIPE" in str(info.value)


def test_block_size_one_with_a_forged_fingerprint_fails_validation(
    plan_dict: dict[str, Any],
) -> None:
    plan_dict["draft"]["block_size"] = 1
    with pytest.raises(PlanError) as info:
        RunPlan.from_dict(refingerprint(plan_dict))
    assert "draft.block_size: block_size must be an integer in [2, 128], got 1" in str(info.value)


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("training", "max_steps", int("9" * 4000), "training.max_steps: max_steps must be"),
        ("training", "seed", -1, "training.seed: seed must be an integer >= 0"),
        ("draft.architecture", "head_dim", 7, "draft.architecture.head_dim: head_dim must be even"),
        ("draft.objective", "dpace_alpha", 3.0, "draft.objective.dpace_alpha:"),
        ("base_model.facts", "vocab_size", 0, "base_model.facts.vocab_size:"),
    ],
)
def test_every_value_goes_through_the_recipe_validators(
    plan_dict: dict[str, Any], section: str, key: str, value: object, expected: str
) -> None:
    node = plan_dict
    for part in section.split("."):
        node = node[part]
    node[key] = value
    with pytest.raises(PlanError) as info:
        RunPlan.from_dict(refingerprint(plan_dict))
    message = str(info.value)
    assert expected in message
    assert len(message) < 2000  # a 4000-digit value is not echoed whole


def test_trust_remote_code_with_a_matching_fingerprint_is_valid_and_run_warns(
    plan_dict: dict[str, Any], tmp_path: Path
) -> None:
    plan_dict["base_model"]["trust_remote_code"] = True
    with pytest.raises(PlanError, match="does not match its content"):
        RunPlan.from_dict(plan_dict)  # edited, fingerprint left alone: refused
    forged = refingerprint(plan_dict)
    assert RunPlan.from_dict(forged).base_model.trust_remote_code  # integrity, not authorship
    # `run` says so before anything loads (the plan's data path is gone, so it stops there).
    Path(plan_dict["data"]["data_path"]).unlink()
    result = cli("run", str(write_plan(tmp_path / "p.json", forged)), "--no-progress")
    assert "warning:" in result.stderr
    assert "base_model.trust_remote_code on" in result.stderr


@pytest.mark.parametrize("command", ["run", "export", "eval"])
def test_run_export_eval_refuse_a_plan_without_fingerprint(
    plan_dict: dict[str, Any], tmp_path: Path, command: str
) -> None:
    del plan_dict["fingerprint"]
    plan = str(write_plan(tmp_path / "p.json", plan_dict))
    args = {
        "run": ["run", plan],
        "export": ["export", str(tmp_path / "drafter"), str(tmp_path / "out"), "--plan", plan],
        "eval": ["eval", plan, "--checkpoint", str(tmp_path / "drafter")],
    }[command]
    result = cli(*args)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: {plan}: run plan has no fingerprint")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"format_version": 1, "x": NaN}', "NaN is not valid JSON"),
        ('{"format_version": ' + "1" * 5000 + "}", "an integer of 5000 digits"),
        ('{"format_version": 1e999}', "too large for a float"),
    ],
    ids=["deep", "nan", "huge-int", "overflow"],
)
def test_a_plan_that_is_not_plain_json_is_a_clean_error(
    tmp_path: Path, text: str, reason: str
) -> None:
    plan = str(write_plan(tmp_path / "p.json", text))
    result = cli("export", str(tmp_path), str(tmp_path / "out"), "--plan", plan)
    assert result.exit_code == 1
    assert reason in result.stderr
    assert "dflash-recipe compile RECIPE" in result.stderr


def test_an_edited_regenerate_section_is_revalidated(plan_dict: dict[str, Any]) -> None:
    """The regenerate settings are checked like every other section of a plan."""
    regenerate = {
        "base_url": "http://127.0.0.1:9/v1",
        "model": "tiny",
        "api_key_env": None,
        "max_concurrency": 0,
        "temperature": 0.0,
        "top_p": 1.0,
        "max_new_tokens": 16,
        "request_timeout_s": 60.0,
        "max_retries": 5,
        "reasoning": "keep",
        "first_turn_only": False,
        "output_path": None,
        "thinking": "template",
    }
    with pytest.raises(PlanError, match=r"regenerate\.max_concurrency"):
        RunPlan.from_dict(refingerprint({**plan_dict, "regenerate": regenerate}))
    regenerate["max_concurrency"] = 8
    assert RunPlan.from_dict(refingerprint({**plan_dict, "regenerate": regenerate})).regenerate


def test_an_edited_card_section_is_revalidated(plan_dict: dict[str, Any]) -> None:
    """The card's values are checked like a recipe's: no local path smuggled in as a Hub id."""
    card = {
        "description": "ours",
        "license": "mit",
        "base_model": "/srv/models/x",
        "datasets": None,
    }
    with pytest.raises(PlanError, match=r"card\.base_model: base_model must name Hugging Face"):
        RunPlan.from_dict(refingerprint({**plan_dict, "card": card}))
    card["base_model"] = "Qwen/Qwen3-8B"
    assert RunPlan.from_dict(refingerprint({**plan_dict, "card": card})).card is not None


def test_a_plan_of_the_previous_format_is_told_to_recompile(plan_dict: dict[str, Any]) -> None:
    """A plan written before the schema grew is refused as old, not as edited by hand."""
    old = refingerprint({**plan_dict, "format_version": PLAN_FORMAT_VERSION - 1})
    expected = (
        f"format_version is {PLAN_FORMAT_VERSION - 1}, this dflash-recipes reads "
        f"{PLAN_FORMAT_VERSION}"
    )
    with pytest.raises(PlanError, match=expected) as exc:
        RunPlan.from_dict(old)
    assert "edited" not in str(exc.value) and "dflash-recipe compile" in str(exc.value)


@pytest.mark.parametrize("builtin_sha256", [True, False], ids=["builtin", "hashlib"])
def test_the_fingerprint_is_the_sha256_of_the_canonical_json(
    plan_dict: dict[str, Any],
    builtin_sha256: bool,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    # The plan hashes with CPython's built-in SHA-256 module when there is one (no OpenSSL
    # load at start-up) and with hashlib otherwise; both must give sha256 of the canonical JSON.
    _sha256_constructor.cache_clear()  # the choice is made once per process: make it again
    request.addfinalizer(_sha256_constructor.cache_clear)
    if not builtin_sha256:
        import importlib

        real = importlib.import_module

        def no_builtin(name: str, package: str | None = None) -> Any:
            if name in ("_sha2", "_sha256"):
                raise ImportError(name)
            return real(name, package)

        monkeypatch.setattr(importlib, "import_module", no_builtin)
    payload = {k: v for k, v in plan_dict.items() if k != "fingerprint"}
    expected = hashlib.sha256(_canonical(payload)).hexdigest()
    plan = RunPlan.from_dict(plan_dict)
    assert plan.fingerprint == expected == plan_dict["fingerprint"]
    assert plan.to_dict()["fingerprint"] == expected
    chosen = _sha256_constructor().__module__
    assert chosen in (("_sha2", "_sha256") if builtin_sha256 else ("_hashlib", "hashlib"))


def test_a_hand_added_unknown_key_is_refused_not_dropped(plan_dict: dict[str, Any]) -> None:
    # a typo such as learning_rat would otherwise be dropped silently and the plan accepted
    plan_dict["training"]["learning_rat"] = 0.5
    with pytest.raises(PlanError) as info:
        RunPlan.from_dict(refingerprint(plan_dict))
    assert "learning_rat" in str(info.value)


# ---------------------------------------------------------------------------------------------
# every re-validation rule refuses a value: found by running the checks, so a new rule is covered
# ---------------------------------------------------------------------------------------------

#: Values a forger might write; each rule must refuse at least one of them.
_BAD_VALUES: tuple[object, ...] = (
    -1,
    0,
    1,
    10**13,
    2**31,
    -0.5,
    0.0,
    1e30,
    float("nan"),
    "",
    "bad",
    "../x",
    "a\x00b",
    True,
    [],
    [-1],
    [1, 1],
    [10**6],
    7,
    3,
)


def _full_plan(plan_dict: dict[str, Any]) -> dict[str, Any]:
    """The tiny plan with every optional section present (regenerate, resume)."""
    regenerate = {
        "base_url": "http://127.0.0.1:9/v1",
        "model": "tiny",
        "api_key_env": None,
        "max_concurrency": 8,
        "temperature": 0.0,
        "top_p": 1.0,
        "max_new_tokens": 16,
        "request_timeout_s": 60.0,
        "max_retries": 5,
        "reasoning": "keep",
        "first_turn_only": False,
        "output_path": None,
        "thinking": "template",
    }
    resume = {"checkpoint_dir": "out/checkpoint-000010", "step": 10}
    return {**plan_dict, "regenerate": regenerate, "resume": resume}


def _problems(plan: RunPlan) -> list[str]:
    """plan_value_problems over the parts of `plan`, as RunPlan.from_dict passes them."""
    return value_checks.plan_value_problems(
        plan.base_model,
        plan.data,
        plan.training,
        plan.draft,
        init_checkpoint=plan.init_checkpoint,
        regenerate=plan.regenerate,
        resume=plan.resume,
        card=plan.card,
    )


def _rule_paths(plan: RunPlan, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every dotted path plan_value_problems runs a rule on (recorded, not listed by hand)."""
    original = value_checks._run
    paths: list[str] = []

    def recording(path: str, *args: Any, **kwargs: Any) -> Any:
        paths.append(path)
        return original(path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(value_checks, "_run", recording)
        assert _problems(plan) == []
    return paths


def _evolve(obj: Any, path: list[str], value: object) -> Any:
    """`obj` with the attribute at `path` replaced (the plan's records are frozen attrs)."""
    head, *rest = path
    return attrs.evolve(obj, **{head: _evolve(getattr(obj, head), rest, value) if rest else value})


def test_every_revalidation_rule_refuses_a_forged_value(
    plan_dict: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each path the checks visit refuses some forged value, naming that path.

    The paths are recorded from the checks themselves, so a new rule is covered without a
    new case, and a rule deleted or turned around leaves its path unguarded here. The values
    go straight into the plan object: the schema refuses some of them (an unknown choice)
    before the value checks would, and this test is about the value checks.
    """
    plan = RunPlan.from_dict(refingerprint(_full_plan(plan_dict)))
    paths = _rule_paths(plan, monkeypatch)
    assert len(paths) > 40 and "draft.block_size" in paths and "resume.step" in paths
    sections = {path.rpartition(".")[0] for path in paths}
    assert sections == {
        "base_model",
        "base_model.facts",
        "base_model.facts.rope",
        "data",
        "training",
        "draft",
        "draft.architecture",
        "draft.objective",
        "init_checkpoint",
        "regenerate",
        "resume",
    }
    unguarded = []
    for path in paths:
        parts = path.split(".")
        # refused at this path alone, and the message names the field as the recipe does
        named = f"{path}: {parts[-1]} "
        for bad in _BAD_VALUES:
            problems = _problems(_evolve(plan, parts, bad))
            if problems and all(p.startswith(named) for p in problems):
                break
        else:
            unguarded.append(path)
    assert unguarded == [], f"plan values no forged value is refused for by name: {unguarded}"


def test_a_required_value_may_not_be_null_an_optional_one_may(plan_dict: dict[str, Any]) -> None:
    plan = RunPlan.from_dict(refingerprint(plan_dict))
    assert _problems(_evolve(plan, ["draft", "block_size"], None)) == [
        "draft.block_size: block_size must be an integer in [2, 128], got None"
    ]
    optional = (
        ["base_model", "facts", "rms_norm_eps"],
        ["init_checkpoint", "mask_token_id"],
        ["init_checkpoint", "trained_block_size"],  # a config.json that states no block size
    )
    for path in optional:
        assert _problems(_evolve(plan, path, None)) == []


def test_a_forged_master_dtype_is_refused_by_its_dotted_path(plan_dict: dict[str, Any]) -> None:
    plan_dict["training"]["drafter_master_dtype"] = "float16"
    with pytest.raises(PlanError) as info:
        RunPlan.from_dict(refingerprint(plan_dict))
    message = str(info.value)
    # the schema's Literal refuses it before the value checks, naming the field and the choices
    assert "attribute drafter_master_dtype" in message and "'float32', 'bfloat16'" in message
    assert "dflash-recipe compile RECIPE" in message
