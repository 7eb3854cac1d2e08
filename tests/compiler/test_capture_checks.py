"""Compile cross-checks a capture (manifest + shard headers) against the plan: one test per kind."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
from testkit.compiling import TINY_SCRATCH

from dflash_recipes.compiler import capture_checks
from dflash_recipes.compiler.capture_checks import (
    CaptureExpectation,
    check_capture,
    check_manifest,
    check_shards,
)
from dflash_recipes.compiler.compilation import CompileResult, compile_file
from dflash_recipes.diagnostics import Diagnostic, Severity
from dflash_recipes.files.capture_manifest import (
    MANIFEST_FILE,
    RECAPTURE,
    CaptureManifest,
    ShardEntry,
)

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
            "data.supervise=[answer]",
            "capture-loss-mask-mismatch",
            "set data.supervise: [answer, tool_calls, reasoning]",
        ),
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
    # the same template from another file is the same rendering: nothing to say
    same = tmp_path / "same.jinja"
    shutil.copyfile(TARGET / "chat_template.jinja", same)
    result = _compile(capture, f"data.chat_template={same}")
    assert result.plan is not None
    assert [d for d in result.diagnostics if d.path == "data.hidden_states_path"] == []


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


# ---------------------------------------------------------------------------------------------
# each cross-check alone, without a model: one case per code, word for word
# ---------------------------------------------------------------------------------------------

HEX_A, HEX_B = "a" * 64, "b" * 64


def _manifest(**changes: object) -> CaptureManifest:
    fields: dict[str, object] = {
        "base_model_path": "/models/base",
        "base_config_sha256": HEX_A,
        "tokenizer_sha256": HEX_A,
        "chat_template_sha256": HEX_A,
        "data_path": "/data/train.jsonl",
        "data_sha256": HEX_A,
        "answer_only_loss": True,
        "target_layer_ids": (1, 5),
        "hidden_size": 32,
        "dtype": "bfloat16",
        "training_seq_len": 64,
        "block_size": 4,
        "last_hidden_state": False,
        "num_samples": 0,
        "num_tokens": 0,
        "num_truncated": 0,
        "bytes_per_token": 133,
        "estimated_bytes": 0,
        "shards": (),
        "complete": True,
    }
    return CaptureManifest(**{**fields, **changes})  # type: ignore[arg-type]


_EXPECT = CaptureExpectation(
    target_layer_ids=(1, 5),
    hidden_size=32,
    dtype="bfloat16",
    training_seq_len=64,
    answer_only_loss=True,
    needs_last_hidden=False,
    base_config_sha256=HEX_A,
    tokenizer_sha256=HEX_A,
    chat_template_sha256=HEX_A,
    data_sha256=HEX_A,
    block_size=4,
)
_RE = RECAPTURE

#: code -> (manifest changes, expectation changes, message, hint)
MANIFEST_CASES: dict[str, tuple[dict[str, object], dict[str, object], str, str]] = {
    "capture-taps-mismatch": (
        {"target_layer_ids": (2, 6)},
        {},
        "the capture holds target layers [2, 6], but the plan's taps are [1, 5]: the drafter "
        "would read other layers than it is built for",
        f"{_RE} (it captures [1, 5]), or set dflash.dflash_architecture_config.target_layer_ids: "
        "[2, 6]",
    ),
    "capture-hidden-size-mismatch": (
        {"hidden_size": 64},
        {},
        "the capture's hidden size is 64, the target's is 32: it was captured from another model",
        _RE,
    ),
    "capture-dtype-mismatch": (
        {"dtype": "float32"},
        {},
        "the capture holds float32 states, the plan runs the target in bfloat16",
        f"set model.dtype: float32, or {_RE}",
    ),
    "capture-seq-len-mismatch": (
        {"training_seq_len": 128},
        {},
        "the capture truncated sequences at training_seq_len 128, the plan trains at 64",
        f"set training.training_seq_len: 128, or {_RE}",
    ),
    "capture-loss-mask-mismatch": (
        {"answer_only_loss": False},
        {},
        "the capture's loss masks were made with answer_only_loss false, the plan says true",
        f"set data.answer_only_loss: false, or {_RE}",
    ),
    "capture-no-teacher-states": (
        {},
        {"needs_last_hidden": True},
        "the objective needs the target's logits as a teacher (self-distillation or DSpark's TV "
        "term), but the capture holds no last hidden state to recompute them from",
        f"{_RE} (it then stores the last hidden state), or turn off "
        "dflash.dflash_self_logit_distillation",
    ),
    "capture-base-model-mismatch": (
        {"tokenizer_sha256": HEX_B, "base_config_sha256": HEX_B},
        {},
        "the capture was made from /models/base, whose config.json and tokenizer differ from "
        "the recipe's base model: its states belong to another model",
        f"{_RE}, or point model.model_name_or_path at /models/base",
    ),
    "capture-chat-template-changed": (
        {"chat_template_sha256": None},
        {},
        "the capture was rendered with another chat template than the one the recipe names "
        "now; training follows the capture's rendering",
        f"{_RE} to train on the new rendering, or restore data.chat_template",
    ),
    "capture-data-changed": (
        {"data_sha256": HEX_B},
        {},
        "data.data_path is not the file the capture was made from (/data/train.jsonl): "
        "training reads the capture, not this file",
        f"{_RE} to train on the current data, or leave data.data_path unset (it is not read "
        "offline)",
    ),
    "capture-block-size-differs": (
        {"block_size": 8},
        {},
        "the capture kept the conversations that open a block of 8 tokens, the plan trains "
        "blocks of 4: the set of conversations differs from what online training would use",
        f"{_RE}, or set dflash.dflash_block_size: 8",
    ),
}


def test_every_capture_code_has_a_case() -> None:
    codes = {getattr(capture_checks, name) for name in capture_checks.__all__ if name.isupper()}
    # the shard-level codes are cased below, on files
    shard_level = {"capture-unreadable", "capture-shard-bad", "capture-sample-count-mismatch"}
    assert set(MANIFEST_CASES) | shard_level == codes


def test_a_matching_manifest_has_no_finding() -> None:
    assert check_manifest(_manifest(), _EXPECT) == []
    with_teacher = attrs.evolve(_EXPECT, needs_last_hidden=True)
    assert check_manifest(_manifest(last_hidden_state=True), with_teacher) == []
    unnamed = attrs.evolve(_EXPECT, data_sha256=None, block_size=None)
    assert check_manifest(_manifest(data_sha256=HEX_B, block_size=8), unnamed) == []


@pytest.mark.parametrize("code", sorted(MANIFEST_CASES))
def test_each_manifest_check_gives_one_finding_word_for_word(code: str) -> None:
    changes, expect_changes, message, hint = MANIFEST_CASES[code]
    found = check_manifest(_manifest(**changes), attrs.evolve(_EXPECT, **expect_changes))
    assert [(f.code, f.message, f.hint) for f in found] == [(code, message, hint)]


def test_a_capture_supervising_other_parts_is_named_with_both_lists() -> None:
    """Issue 52's data.supervise: a capture whose masks keep other parts of a turn trains on
    them; one made before the setting (none recorded) kept every part."""
    found = check_manifest(_manifest(supervise=("answer",)), _EXPECT)
    assert [(f.code, f.message, f.hint) for f in found] == [
        (
            "capture-loss-mask-mismatch",
            "the capture's loss masks supervise [answer] of each assistant turn, the plan's "
            "data.supervise is [answer, tool_calls, reasoning]",
            f"set data.supervise: [answer], or {_RE}",
        )
    ]
    assert check_manifest(_manifest(supervise=None), _EXPECT) == []  # an older capture: all
    assert check_manifest(_manifest(supervise=("reasoning", "answer", "tool_calls")), _EXPECT) == []
    one = attrs.evolve(_EXPECT, supervise=("answer",))
    assert [f.code for f in check_manifest(_manifest(supervise=None), one)] == [
        "capture-loss-mask-mismatch"
    ]
    # every token supervised on both sides: which parts were named does not matter
    everything = attrs.evolve(_EXPECT, answer_only_loss=False, supervise=("answer",))
    assert check_manifest(_manifest(answer_only_loss=False), everything) == []


def test_one_differing_model_file_is_named_alone() -> None:
    found = check_manifest(_manifest(tokenizer_sha256=HEX_B), _EXPECT)
    assert [f.code for f in found] == ["capture-base-model-mismatch"]
    assert "whose tokenizer differ" in found[0].message


def test_shards_out_of_order_or_resized_are_named(tmp_path: Path) -> None:
    shards = (
        ShardEntry("shard-00000.safetensors", 0, 2, 5, bytes=10),
        ShardEntry("shard-00001.safetensors", 3, 1, 2, bytes=10),
    )
    (tmp_path / "shard-00000.safetensors").write_bytes(b"x" * 12)
    found = check_shards(tmp_path, _manifest(shards=shards, num_samples=3, num_tokens=7))
    assert [(f.code, f.message) for f in found] == [
        (
            "capture-shard-bad",
            f"capture shard {tmp_path / 'shard-00000.safetensors'} is 12 bytes, the manifest "
            "says 10 (truncated or replaced)",
        ),
        (
            "capture-shard-bad",
            f"capture shard {tmp_path / 'shard-00001.safetensors'} starts at sample 3, expected 2",
        ),
        ("capture-shard-bad", f"capture shard {tmp_path / 'shard-00001.safetensors'} is missing"),
    ]
    assert (
        found[0].hint
        == f"{RECAPTURE}: it rewrites missing or damaged shards and keeps the good ones"
    )
    counted = check_shards(tmp_path, _manifest(shards=shards, num_samples=4, num_tokens=7))
    assert (counted[-1].code, counted[-1].message, counted[-1].hint) == (
        "capture-sample-count-mismatch",
        "the manifest counts 4 samples and 7 tokens, its shards hold 3 samples and 7 tokens",
        RECAPTURE,
    )


def test_an_incomplete_or_unreadable_capture_is_one_finding(tmp_path: Path) -> None:
    shards = (
        ShardEntry("shard-00000.safetensors", 0, 2, 5, bytes=10),
        ShardEntry("shard-00001.safetensors", 2, 1, 2, bytes=10),
        ShardEntry("shard-00002.safetensors", 3, 1, 2),
    )
    (tmp_path / "manifest.json").write_text(_manifest(shards=shards, complete=False).to_json())
    found = check_capture(tmp_path, _EXPECT)
    assert [(f.code, f.message, f.hint) for f in found] == [
        (
            "capture-unreadable",
            f"the capture in {tmp_path} is incomplete (2 of 3 shards recorded): `dflash-recipe "
            "capture` was stopped before it finished",
            "rerun the same `dflash-recipe capture` command: it resumes shard by shard",
        )
    ]
    (tmp_path / "manifest.json").write_text("{")
    found = check_capture(tmp_path, _EXPECT)
    assert [f.code for f in found] == ["capture-unreadable"] and found[0].hint == RECAPTURE
    assert found[0].message.startswith(f"{tmp_path / 'manifest.json'}: not valid JSON")


def test_a_capture_trains_without_data_path_and_a_teacher_objective_needs_its_states(
    capture: Path,
) -> None:
    result = _compile(capture, "data.data_path=null")
    assert result.plan is not None, [str(d) for d in result.diagnostics]
    assert [d for d in result.diagnostics if d.path == "data.hidden_states_path"] == []
    dspark = (
        "dflash.dflash_architecture_config.projector_type=dspark",
        "dflash.dflash_architecture_config.markov_rank=4",
        "dflash.dflash_dspark_tv_weight=0.5",
    )
    found = _only(_compile(capture, *dspark), "capture-no-teacher-states")
    assert found.severity is Severity.ERROR
