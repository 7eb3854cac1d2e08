"""What engines read in an export (issue 11): the sink key, Domino's shift_label and
pure_draft_prefix_len, and the warnings for heads no engine serves."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from testkit.tiny import tiny_plan

from dflash_recipes.checkpoint.config_fields import unknown_fields
from dflash_recipes.checkpoint.hfconfig import read_checkpoint_config
from dflash_recipes.compiler.field_checks import check_checkpoint_fields
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.export import export_drafter
from dflash_recipes.executor.model.heads import DominoHead

pytestmark = pytest.mark.usefixtures("one_thread")


def _export(tmp_path: Path, **overrides: object) -> dict[str, object]:
    plan = tiny_plan(tmp_path, **overrides)
    out = export_drafter(DFlashDraftModel(plan.resolved_draft()), plan, tmp_path / "export")
    config: dict[str, object] = json.loads((out / "config.json").read_text(encoding="utf-8"))
    return config


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


def test_domino_export_states_the_alignment_its_head_computes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        config = _export(tmp_path, projector_type="domino", emb_dim=16, gru_hidden_dim=8)
    dflash = config["dflash_config"]
    assert isinstance(dflash, dict)
    assert dflash["shift_label"] is False  # SGLang refuses anything but a bool
    assert dflash["pure_draft_prefix_len"] == 0
    assert config["emb_dim"] == 16 == dflash["emb_dim"]
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 1
    assert "not served as trained by any engine" in messages[0]
    assert "pure_draft_prefix_len 1" in messages[0] and "vLLM has no Domino head" in messages[0]
    # The export warm-starts the same head kind without a finding about alignment.
    findings = check_checkpoint_fields(
        config, None, where="c", training_seq_len=32, projector_type="domino"
    )
    assert findings == [] and unknown_fields(config) == []


def test_domino_corrects_the_first_proposal_so_pure_draft_prefix_len_is_0() -> None:
    """The value written is what the head computes: block position 1 (the first proposal)
    already gets a GRU correction, from the state after the anchor token."""
    torch.manual_seed(0)
    head = DominoHead(hidden_size=8, gru_hidden_dim=4, emb_dim=6, vocab_size=11)
    head.reset_parameters()
    with torch.no_grad():
        head.embed_proj[2].weight.normal_()
    hidden = torch.randn(1, 4, 8)
    prefix = torch.randn(1, 4, 8)
    base = torch.zeros(1, 4, 11)
    corrected = head(hidden, prefix, base)
    assert not torch.allclose(corrected[0, 1], base[0, 1])
    # position 1's correction depends on the anchor's embedding (index 1 of the prefix) only
    other = prefix.clone()
    other[0, 2:] = torch.randn(2, 8)
    assert torch.allclose(head(hidden, other, base)[0, 1], corrected[0, 1])


def test_dspark_export_warns_that_no_engine_serves_its_head(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        config = _export(tmp_path, projector_type="dspark", markov_rank=4)
    dflash = config["dflash_config"]
    assert isinstance(dflash, dict)
    assert (dflash["markov_head_type"], dflash["shift_label"]) == ("vanilla", False)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 1 and "no serving engine has a DSpark head" in messages[0]
    assert unknown_fields(config) == []
