"""What engines read in an export (issues 11 and 25): the sink key, the Domino and DSpark head
fields exactly as ModelOpt writes them, SGLang's Domino config rules, and the warnings for heads
no engine serves."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import pytest
from testkit.tiny import tiny_plan

from dflash_recipes.checkpoint.config_fields import unknown_fields
from dflash_recipes.checkpoint.hfconfig import read_checkpoint_config
from dflash_recipes.compiler.field_checks import check_checkpoint_fields
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.export import export_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


def _export(tmp_path: Path, **overrides: object) -> dict[str, object]:
    plan = tiny_plan(tmp_path, **overrides)
    out = export_drafter(DFlashDraftModel(plan.resolved_draft()), plan, tmp_path / "export")
    config: dict[str, object] = json.loads((out / "config.json").read_text(encoding="utf-8"))
    return config


def sglang_domino_config_problems(config: Mapping[str, object]) -> list[str]:
    """SGLang's rules for a Domino drafter's config.json (integration facts): a boolean
    shift_label, pure_draft_prefix_len 1, gru_hidden_dim and emb_dim set, emb_dim agreeing at
    the top level and in dflash_config, block_size > 1 (dflash_config first, then top level)."""
    problems = []
    nested = config.get("dflash_config")
    if not isinstance(nested, Mapping):
        return ["no dflash_config"]
    if type(nested.get("shift_label")) is not bool:
        problems.append("shift_label is not a boolean")
    if nested.get("pure_draft_prefix_len") != 1:
        problems.append("pure_draft_prefix_len is not 1")
    for key in ("gru_hidden_dim", "emb_dim"):
        value = nested.get(key)
        if type(value) is not int or value <= 0:
            problems.append(f"{key} is not a positive int")
    if config.get("emb_dim") != nested.get("emb_dim"):
        problems.append("top-level emb_dim differs from dflash_config.emb_dim")
    block = nested.get("block_size", config.get("block_size"))
    if type(block) is not int or block <= 1:
        problems.append("block_size is not > 1")
    return problems


@pytest.mark.parametrize("sink", [True, False])
def test_the_sink_flag_is_written_as_attention_sink_bias(tmp_path: Path, sink: bool) -> None:
    config = _export(tmp_path, attention_sink=sink)
    dflash = config["dflash_config"]
    assert isinstance(dflash, dict)
    assert dflash["attention_sink_bias"] is sink
    assert "attention_sink" not in dflash
    assert read_checkpoint_config(tmp_path / "export").attention_sink is sink


def test_a_plain_export_logs_no_serving_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        _export(tmp_path)
    assert not caplog.records


def test_a_domino_export_is_modelopts_and_sglang_accepts_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        config = _export(tmp_path, projector_type="domino", emb_dim=16, gru_hidden_dim=8)
    dflash = config["dflash_config"]
    assert isinstance(dflash, dict)
    # ModelOpt 0.47's DominoExporter: these five nested fields and the top-level emb_dim.
    assert {k: dflash[k] for k in ("projector_type", "shift_label", "pure_draft_prefix_len")} == {
        "projector_type": "domino",
        "shift_label": True,
        "pure_draft_prefix_len": 1,
    }
    assert (dflash["gru_hidden_dim"], dflash["emb_dim"], config["emb_dim"]) == (8, 16, 16)
    assert sglang_domino_config_problems(config) == []
    # Served as trained: no "not served as trained" warning any more.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # The export warm-starts the same head kind without a finding about alignment.
    findings = check_checkpoint_fields(
        config, None, where="c", training_seq_len=32, projector_type="domino"
    )
    assert findings == [] and unknown_fields(config) == []


def test_a_domino_export_with_another_prefix_is_refused_by_sglangs_rules_and_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        config = _export(
            tmp_path,
            projector_type="domino",
            emb_dim=16,
            gru_hidden_dim=8,
            pure_draft_prefix_len=0,
        )
    assert sglang_domino_config_problems(config) == ["pure_draft_prefix_len is not 1"]
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 1
    assert "not served as trained by any engine" in messages[0]
    assert "pure_draft_prefix_len 0" in messages[0]


def test_sglangs_rules_catch_each_broken_field() -> None:
    """The rule check itself can fail: every rule on a broken copy of a good config."""
    good: dict[str, object] = {
        "emb_dim": 16,
        "block_size": 8,
        "dflash_config": {
            "shift_label": True,
            "pure_draft_prefix_len": 1,
            "gru_hidden_dim": 8,
            "emb_dim": 16,
            "block_size": 8,
        },
    }
    assert sglang_domino_config_problems(good) == []
    broken = [
        ({"shift_label": 1}, "shift_label is not a boolean"),
        ({"pure_draft_prefix_len": 0}, "pure_draft_prefix_len is not 1"),
        ({"gru_hidden_dim": None}, "gru_hidden_dim is not a positive int"),
        ({"emb_dim": 12}, "top-level emb_dim differs from dflash_config.emb_dim"),
        ({"block_size": 1}, "block_size is not > 1"),
    ]
    for change, problem in broken:
        nested = dict(good["dflash_config"])  # type: ignore[call-overload]
        nested.update(change)
        assert problem in sglang_domino_config_problems({**good, "dflash_config": nested})


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_dspark_export_is_modelopts_and_warns_that_no_engine_serves_its_head(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    with caplog.at_level(logging.WARNING):
        config = _export(
            tmp_path,
            projector_type="dspark",
            markov_rank=4,
            markov_head_type=kind,
            use_confidence_head=True,
        )
    dflash = config["dflash_config"]
    assert isinstance(dflash, dict)
    assert {
        k: dflash[k]
        for k in (
            "projector_type",
            "shift_label",
            "markov_rank",
            "markov_head_type",
            "use_confidence_head",
        )
    } == {
        "projector_type": "dspark",
        "shift_label": True,
        "markov_rank": 4,
        "markov_head_type": kind,
        "use_confidence_head": True,
    }
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 1 and "no serving engine has a DSpark head" in messages[0]
    assert unknown_fields(config) == []
    findings = check_checkpoint_fields(
        config, None, where="c", training_seq_len=32, projector_type="dspark"
    )
    assert [f.code for f in findings if f.path.endswith("markov_head_type")] == (
        [] if kind == "vanilla" else ["checkpoint-field-differs"]
    )
