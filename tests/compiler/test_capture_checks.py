"""Compile cross-checks a capture (manifest + shard headers) against the plan: one test per kind."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from testkit.compiling import TINY_SCRATCH

from dflash_recipes.compiler.compilation import CompileResult, compile_file
from dflash_recipes.diagnostics import Diagnostic, Severity
from dflash_recipes.files.capture_manifest import MANIFEST_FILE

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "dflash_recipes" / "demo_data" / "target"
COMMON = (
    "training.training_seq_len=64",
    "training.per_device_train_batch_size=2",
    "training.eval_steps=null",
    "dflash.dflash_block_size=4",
)


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One capture of the demo data (taps [1, 3], float32, seq len 64), made once."""
    import torch

    from dflash_recipes.executor.data.capture import capture_plan

    root = tmp_path_factory.mktemp("capture")
    result = compile_file(TINY_SCRATCH, overrides=(*COMMON, f"training.output_dir={root / 'run'}"))
    assert result.plan is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        capture_plan(result.plan, root / "capture", max_shard_bytes=2**19, progress=False)
    finally:
        torch.set_num_threads(threads)
    return root / "capture"


@pytest.fixture
def capture(captured: Path, tmp_path: Path) -> Path:
    """A private copy of the capture that a test may damage."""
    copy = tmp_path / "capture"
    shutil.copytree(captured, copy)
    return copy


def _compile(capture: Path, *extra: str) -> CompileResult:
    overrides = (*COMMON, f"data.hidden_states_path={capture}", *extra)
    return compile_file(TINY_SCRATCH, overrides=overrides)


def _only(result: CompileResult, code: str) -> Diagnostic:
    found = [d for d in result.diagnostics if d.code == code]
    assert len(found) == 1, [str(d) for d in result.diagnostics]
    assert found[0].path == "data.hidden_states_path"
    assert found[0].hint, "every capture finding says how to fix it"
    return found[0]


def _edit_manifest(capture: Path, change: Callable[[dict[str, object]], None]) -> None:
    path = capture / MANIFEST_FILE
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_a_matching_capture_compiles_clean(capture: Path) -> None:
    result = _compile(capture)
    assert result.plan is not None
    assert result.plan.data.hidden_states_path == str(capture)
    assert [d for d in result.diagnostics if d.severity != Severity.INFO] == []


def test_other_taps_are_an_error_naming_both_lists(capture: Path) -> None:
    result = _compile(capture, "dflash.dflash_architecture_config.target_layer_ids=[0,4]")
    assert result.plan is None
    found = _only(result, "capture-taps-mismatch")
    assert "target layers [1, 3]" in found.message and "taps are [0, 4]" in found.message
    assert "target_layer_ids: [1, 3]" in (found.hint or "")


@pytest.mark.parametrize(
    ("override", "code", "fix"),
    [
        ("model.dtype=bfloat16", "capture-dtype-mismatch", "set model.dtype: float32"),
        (
            "training.training_seq_len=128",
            "capture-seq-len-mismatch",
            "set training.training_seq_len: 64",
        ),
        ("data.answer_only_loss=false", "capture-loss-mask-mismatch", "answer_only_loss: true"),
        (
            "dflash.dflash_self_logit_distillation=true",
            "capture-no-teacher-states",
            "rerun `dflash-recipe capture",
        ),
    ],
)
def test_plan_mismatches_are_errors_with_a_fix(
    capture: Path, override: str, code: str, fix: str
) -> None:
    result = _compile(capture, override)
    assert result.plan is None
    found = _only(result, code)
    assert fix in (found.hint or ""), found.hint


def test_hidden_size_mismatch(capture: Path) -> None:
    _edit_manifest(capture, lambda m: m.update(hidden_size=64))
    result = _compile(capture)
    assert result.plan is None
    assert (
        "hidden size is 64, the target's is 128"
        in _only(result, "capture-hidden-size-mismatch").message
    )


def test_another_base_model_is_an_error_another_template_a_warning(
    capture: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other-target"
    shutil.copytree(TARGET, other)
    config = json.loads((other / "config.json").read_text())
    config["initializer_range"] = 0.03  # same shapes, another model
    (other / "config.json").write_text(json.dumps(config))
    result = _compile(capture, f"model.model_name_or_path={other}")
    assert result.plan is None
    found = _only(result, "capture-base-model-mismatch")
    assert "config.json" in found.message and str(TARGET.resolve()) in found.message

    template = tmp_path / "template.jinja"
    template.write_text((TARGET / "chat_template.jinja").read_text() + "\n")
    result = _compile(capture, f"data.chat_template={template}")
    assert result.plan is not None
    warning = _only(result, "capture-chat-template-changed")
    assert warning.severity == Severity.WARNING


def test_missing_truncated_and_corrupted_shards_are_named(capture: Path) -> None:
    (capture / "shard-00001.safetensors").unlink()
    shard2 = capture / "shard-00002.safetensors"
    shard2.write_bytes(shard2.read_bytes()[:-100])
    shard3 = capture / "shard-00003.safetensors"
    raw = bytearray(shard3.read_bytes())
    raw[9:20] = b"#" * 11  # same size, damaged header
    shard3.write_bytes(bytes(raw))
    result = _compile(capture)
    assert result.plan is None
    messages = sorted(d.message for d in result.diagnostics if d.code == "capture-shard-bad")
    assert len(messages) == 3, messages
    assert "shard-00001.safetensors is missing" in messages[0]
    assert "shard-00002.safetensors is" in messages[1] and "truncated" in messages[1]
    assert "shard-00003.safetensors has a damaged header" in messages[2]


def test_sample_count_and_incomplete_capture(capture: Path) -> None:
    _edit_manifest(capture, lambda m: m.update(num_samples=61))
    found = _only(_compile(capture), "capture-sample-count-mismatch")
    assert "counts 61 samples" in found.message and "hold 60 samples" in found.message

    _edit_manifest(capture, lambda m: m.update(num_samples=60, complete=False))
    found = _only(_compile(capture), "capture-unreadable")
    assert "incomplete" in found.message and "resumes" in (found.hint or "")


def test_not_a_capture_directory(tmp_path: Path) -> None:
    found = _only(_compile(tmp_path / "nowhere"), "capture-unreadable")
    assert "does not exist" in found.message
    (tmp_path / "empty").mkdir()
    found = _only(_compile(tmp_path / "empty"), "capture-unreadable")
    assert "has no manifest.json" in found.message


def test_changed_data_file_and_block_size_are_warnings(capture: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    source = REPO / "dflash_recipes" / "demo_data" / "data" / "domain.jsonl"
    data.write_text(source.read_text() + "\n")
    result = _compile(capture, f"data.data_path={data}", "dflash.dflash_block_size=8")
    assert result.plan is not None
    changed = _only(result, "capture-data-changed")
    assert changed.severity == Severity.WARNING and str(source.resolve()) in changed.message
    block = _only(result, "capture-block-size-differs")
    assert block.severity == Severity.WARNING
    assert "dflash.dflash_block_size: 4" in (block.hint or "")
