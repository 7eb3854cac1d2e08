"""The capture manifest is checked, not trusted: every field's rule, the shard identity checks.

`manifest.json` is a file a user can edit, truncate or copy between captures. Each rule here is
what training on a capture relies on; each test fails if its rule is removed or turned around.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dflash_recipes.errors import DataError
from dflash_recipes.files import capture_manifest as cm
from dflash_recipes.files.capture_manifest import (
    RECAPTURE,
    CaptureManifest,
    ShardEntry,
    parse_manifest,
    read_manifest,
    shard_content_problem,
    shard_problem,
)

HEX = "0123456789abcdef" * 4


def manifest(**changes: Any) -> CaptureManifest:
    """A complete two-sample, one-shard capture of a 2-tap, 4-wide target."""
    fields: dict[str, Any] = {
        "base_model_path": "/models/base",
        "base_config_sha256": HEX,
        "tokenizer_sha256": HEX,
        "chat_template_sha256": None,
        "data_path": "train.jsonl",
        "data_sha256": HEX,
        "answer_only_loss": True,
        "target_layer_ids": (1, 5),
        "hidden_size": 4,
        "dtype": "float32",
        "training_seq_len": 8,
        "block_size": 4,
        "last_hidden_state": False,
        "num_samples": 2,
        "num_tokens": 5,
        "num_truncated": 0,
        "bytes_per_token": 37,
        "estimated_bytes": 761,
        "shards": (ShardEntry("shard-00000.safetensors", 0, 2, 5, bytes=1, sha256=HEX),),
        "complete": True,
    }
    return CaptureManifest(**{**fields, **changes})


def raw(**changes: Any) -> dict[str, Any]:
    data = manifest().to_dict()
    data.update(changes)
    return data


def refusal(data: object) -> str:
    with pytest.raises(DataError) as caught:
        parse_manifest(json.dumps(data), "cap/manifest.json")
    return str(caught.value)


def test_a_written_manifest_reads_back_equal() -> None:
    written = manifest()
    again = parse_manifest(written.to_json(), "m")
    assert again.to_dict() == written.to_dict()
    parts = manifest(supervise=("answer", "tool_calls"))
    assert parse_manifest(parts.to_json(), "m").supervise == ("answer", "tool_calls")
    older = {k: v for k, v in raw().items() if k != "supervise"}  # before data.supervise
    assert parse_manifest(json.dumps(older), "m").supervise is None
    assert json.loads(written.to_json())["format_version"] == 2
    assert written.to_json().endswith("}\n")
    # progress fields are not identity: a half-written capture is the same capture
    half = manifest(complete=False, shards=(ShardEntry("shard-00000.safetensors", 0, 2, 5),))
    assert half.identity() == written.identity()
    assert half.identity() != manifest(num_tokens=6).identity()


@pytest.mark.parametrize("name", cm._INT_FIELDS)
@pytest.mark.parametrize("value", [-1, True, 1.5, None])
def test_each_count_must_be_a_non_negative_integer(name: str, value: object) -> None:
    assert refusal(raw(**{name: value})) == (
        f"cap/manifest.json: {name} must be a non-negative integer, got {value!r}; {RECAPTURE}"
    )


@pytest.mark.parametrize("name", cm._OPTIONAL_STR_FIELDS)
def test_each_hash_and_path_is_a_string_or_null(name: str) -> None:
    assert refusal(raw(**{name: 7})) == (
        f"cap/manifest.json: {name} must be a string or null; {RECAPTURE}"
    )
    assert getattr(parse_manifest(json.dumps(raw(**{name: None})), "m"), name) is None


@pytest.mark.parametrize("name", ["answer_only_loss", "last_hidden_state", "complete"])
def test_each_flag_is_true_or_false(name: str) -> None:
    assert refusal(raw(**{name: 1})) == (
        f"cap/manifest.json: {name} must be true or false; {RECAPTURE}"
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "other"}, 'not a capture manifest (no "format": "dflash-capture")'),
        ({"target_layer_ids": []}, "target_layer_ids must be a non-empty list of layer ids"),
        ({"target_layer_ids": [1, -5]}, "target_layer_ids must be a non-empty list of layer ids"),
        ({"target_layer_ids": "1,5"}, "target_layer_ids must be a non-empty list of layer ids"),
        (
            {"dtype": "int8"},
            "dtype must be one of float32, bfloat16, float16 and base_model_path a string",
        ),
        (
            {"base_model_path": None},
            "dtype must be one of float32, bfloat16, float16 and base_model_path a string",
        ),
        (
            {"supervise": "answer"},
            "supervise must be null or a list of the supervised parts' names",
        ),
        (
            {"supervise": ["answer", 3]},
            "supervise must be null or a list of the supervised parts' names",
        ),
        ({"shards": {}}, "shards must be a list"),
        ({"shards": ["shard-00000.safetensors"]}, "shards[0] must be an object with a file name"),
        ({"shards": [{"file": 3}]}, "shards[0] must be an object with a file name"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_each_structural_rule_names_its_field(changes: dict[str, Any], message: str) -> None:
    assert refusal(raw(**changes)) == f"cap/manifest.json: {message}; {RECAPTURE}"


def _shard(**changes: Any) -> dict[str, Any]:
    return {
        "file": "shard-00000.safetensors",
        "first_sample": 0,
        "num_samples": 2,
        "num_tokens": 5,
        "bytes": 10,
        "sha256": HEX,
        "samples_sha256": HEX,
        **changes,
    }


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        (_shard(file="../shard-00000.safetensors"), "must be a plain .safetensors file name"),
        (_shard(file="shard-00000.pt"), "must be a plain .safetensors file name"),
        (_shard(first_sample=-1), "needs non-negative integer counts and bytes"),
        (_shard(num_samples=None), "needs non-negative integer counts and bytes"),
        (_shard(num_tokens="5"), "needs non-negative integer counts and bytes"),
        (_shard(bytes=-1), "needs non-negative integer counts and bytes"),
        (_shard(sha256=HEX.upper()), "sha256 and samples_sha256 must be 64 hex digits"),
        (_shard(samples_sha256=HEX[:-1]), "sha256 and samples_sha256 must be 64 hex digits"),
    ],
)
def test_each_shard_rule_names_the_shard(shard: dict[str, Any], message: str) -> None:
    ok = _shard()
    text = refusal(raw(shards=[ok, shard]))
    assert text.startswith("cap/manifest.json: shards[1]") and message in text
    if "file name" in message:
        assert f"shards[1].file {shard['file']!r} must be" in text
    if "hex" in message:
        assert text.startswith("cap/manifest.json: shards[1]'s sha256")
    unsized = parse_manifest(json.dumps(raw(shards=[_shard(bytes=None, sha256=None)])), "m")
    assert unsized.shards[0].bytes is None and unsized.shards[0].sha256 is None


def test_other_format_versions_and_broken_json_are_refused() -> None:
    assert refusal(raw(format_version=3)) == (
        "cap/manifest.json: capture format version 3, this dflash-recipes reads versions 1 and "
        f"2; {RECAPTURE}"
    )
    assert parse_manifest(json.dumps(raw(format_version=1)), "m").complete
    with pytest.raises(DataError, match=r"^m: not valid JSON \(") as caught:
        parse_manifest("{", "m")
    assert str(caught.value).endswith(f"; {RECAPTURE}")
    assert refusal([1]).startswith("cap/manifest.json: not a capture manifest")


def test_reading_a_capture_directory_says_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(DataError) as caught:
        read_manifest(tmp_path / "absent")
    assert (
        str(caught.value) == f"capture directory {tmp_path / 'absent'} does not exist; {RECAPTURE}"
    )
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError) as caught:
        read_manifest(tmp_path / "file")
    assert str(caught.value) == (
        f"capture directory {tmp_path / 'file'} is a file, not a directory; {RECAPTURE}"
    )
    with pytest.raises(DataError) as caught:
        read_manifest(tmp_path)
    assert str(caught.value) == (
        f"{tmp_path} has no manifest.json: it is not a capture directory; {RECAPTURE}"
    )
    (tmp_path / "manifest.json").write_bytes(b"\xff\xfe")
    with pytest.raises(DataError, match=r"^cannot read .*manifest\.json: .*utf-8"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(manifest().to_json())
    assert read_manifest(tmp_path).num_tokens == 5


def test_a_manifest_over_the_bound_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "manifest.json").write_text(manifest().to_json())
    size = (tmp_path / "manifest.json").stat().st_size
    monkeypatch.setattr(cm, "MAX_MANIFEST_BYTES", size)
    assert read_manifest(tmp_path).complete  # exactly at the bound is read
    monkeypatch.setattr(cm, "MAX_MANIFEST_BYTES", size - 1)
    with pytest.raises(DataError) as caught:
        read_manifest(tmp_path)
    path = tmp_path / "manifest.json"
    assert str(caught.value) == (
        f"cannot read {path}: it is larger than the limit of {size - 1} bytes; rerun "
        "`dflash-recipe capture RECIPE --output DIR` with this recipe"
    )


# ---------------------------------------------------------------------------------------------
# a shard against its manifest entry
# ---------------------------------------------------------------------------------------------


def _write_shard(path: Path, lengths: dict[int, int], **override: np.ndarray | None) -> Path:
    """A shard of samples of these lengths; `override` replaces tensors (None: leaves it out)."""
    tensors: dict[str, np.ndarray] = {}
    for index, length in lengths.items():
        base = f"{index:09d}"
        tensors[f"{base}.input_ids"] = np.zeros(length, dtype=np.int32)
        tensors[f"{base}.loss_mask"] = np.ones(length, dtype=np.uint8)
        tensors[f"{base}.taps"] = np.zeros((length, 2, 4), dtype=np.float32)
    for name, value in override.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(path))
    return path


def test_a_shard_that_matches_its_entry_has_no_problem(tmp_path: Path) -> None:
    _write_shard(tmp_path / "shard-00000.safetensors", {0: 2, 1: 3})
    entry = manifest().shards[0]
    assert shard_problem(tmp_path, entry, manifest()) is None


@pytest.mark.parametrize(
    ("lengths", "override", "entry_changes", "problem"),
    [
        ({0: 2}, {}, {}, "has no tensors for sample 1"),
        ({0: 2, 1: 9}, {}, {"num_tokens": 11}, "holds sample 1 of 9 tokens, over training_seq_len"),
        (
            {0: 2, 1: 3},
            {"000000001.taps": np.zeros((3, 1, 4), dtype=np.float32)},
            {},
            "holds taps of sample 1 as F32 [3, 1, 4], expected F32 [3, 2, 4]",
        ),
        (
            {0: 2, 1: 3},
            {"000000001.taps": np.zeros((3, 2, 4), dtype=np.float16)},
            {},
            "holds taps of sample 1 as F16 [3, 2, 4], expected F32 [3, 2, 4]",
        ),
        (
            {0: 2, 1: 3, 2: 1},
            {},
            {},
            "holds tensors the manifest does not list (e.g. 000000002.input_ids)",
        ),
        ({0: 2, 1: 3}, {"000000001.taps": None}, {}, "has no tensors for sample 1"),
        ({0: 2, 1: 3}, {}, {"num_tokens": 6}, "holds 5 tokens, the manifest says 6"),
        (
            {0: 2, 1: 3},
            {"000000001.input_ids": np.zeros((3, 1), dtype=np.int32)},
            {},
            "has no tensors for sample 1",
        ),
    ],
    ids=[
        "missing-sample",
        "over-length",
        "tap-count",
        "tap-dtype",
        "extra",
        "no-taps",
        "tokens",
        "ids-2d",
    ],
)
def test_each_shard_header_rule_says_what_differs(
    tmp_path: Path,
    lengths: dict[int, int],
    override: dict[str, np.ndarray | None],
    entry_changes: dict[str, int],
    problem: str,
) -> None:
    _write_shard(tmp_path / "shard-00000.safetensors", lengths, **override)
    entry = ShardEntry("shard-00000.safetensors", 0, 2, entry_changes.get("num_tokens", 5))
    assert shard_problem(tmp_path, entry, manifest()) == problem


def test_a_shard_without_its_mask_or_file_or_header_is_named(tmp_path: Path) -> None:
    path = _write_shard(tmp_path / "shard-00000.safetensors", {0: 2, 1: 3})
    tensors = {k: v for k, v in _load(path).items() if k != "000000001.loss_mask"}
    save_file(tensors, str(path))
    entry = manifest().shards[0]
    assert shard_problem(tmp_path, entry, manifest()) == "lacks tensor 000000001.loss_mask"
    with_teacher = manifest(last_hidden_state=True)
    _write_shard(path, {0: 2, 1: 3})
    assert shard_problem(tmp_path, entry, with_teacher) == "lacks tensor 000000000.last_hidden"
    path.write_bytes(b"\x00" * 4)
    found = shard_problem(tmp_path, entry, manifest())
    assert found is not None and found.startswith(f"has a damaged header ({path}: ")
    path.unlink()
    assert shard_problem(tmp_path, entry, manifest()) == "is missing"


def _load(path: Path) -> dict[str, np.ndarray]:
    return load_file(str(path))


def test_a_shard_whose_bytes_changed_is_named_with_both_hashes(tmp_path: Path) -> None:
    path = _write_shard(tmp_path / "shard-00000.safetensors", {0: 2, 1: 3})
    actual = cm.file_sha256(path)
    entry = ShardEntry(path.name, 0, 2, 5, sha256=actual)
    assert shard_content_problem(tmp_path, entry) is None
    assert shard_content_problem(tmp_path, ShardEntry(path.name, 0, 2, 5)) is None  # version 1
    changed = ShardEntry(path.name, 0, 2, 5, sha256=HEX)
    assert shard_content_problem(tmp_path, changed) == (
        f"capture shard {path} is not the one the manifest recorded: its content sha256 is "
        f"{actual}, the manifest says {HEX} (the file changed, or was copied from another "
        "capture); re-capture this shard with `dflash-recipe capture` (it resumes)"
    )


# ---------------------------------------------------------------------------------------------
# the identity hashes a capture is checked against
# ---------------------------------------------------------------------------------------------


def test_the_samples_hash_sees_every_id_every_mask_byte_and_every_boundary() -> None:
    one = cm.samples_sha256([([1, 2], [0, 1]), ([3], [1])])
    assert one == cm.samples_sha256([([1, 2], [0, 1]), ([3], [1])])
    assert one != cm.samples_sha256([([1, 2], [0, 1]), ([4], [1])])
    assert one != cm.samples_sha256([([1, 2], [1, 1]), ([3], [1])])
    assert one != cm.samples_sha256([([1], [0]), ([2, 3], [1, 1])])
    assert cm.samples_sha256([]) == cm.hashlib.sha256().hexdigest()


def test_the_model_hashes_follow_the_files_that_shape_the_data(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    assert cm.base_config_sha256(base) is None
    assert cm.tokenizer_sha256(base) is None
    assert cm.chat_template_sha256(None, base) is None
    (base / "config.json").write_text("{}")
    assert cm.base_config_sha256(base) == cm.file_sha256(base / "config.json")
    (base / "tokenizer.json").write_text("a")
    first = cm.tokenizer_sha256(base)
    (base / "vocab.json").write_text("b")
    second = cm.tokenizer_sha256(base)
    assert first is not None and second is not None and first != second
    (base / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    from_config = cm.chat_template_sha256(None, base)
    assert from_config == cm.hashlib.sha256(b"{{ x }}").hexdigest()
    (base / "chat_template.jinja").write_text("{{ y }}")
    assert cm.chat_template_sha256(None, base) == cm.file_sha256(base / "chat_template.jinja")
    own = tmp_path / "mine.jinja"
    own.write_text("{{ z }}")
    assert cm.chat_template_sha256(str(own), base) == cm.file_sha256(own)
    assert cm.chat_template_sha256(str(tmp_path / "absent.jinja"), base) is None
    (base / "chat_template.jinja").unlink()
    (base / "tokenizer_config.json").write_text("[1]")
    assert cm.chat_template_sha256(None, base) is None


def test_a_file_hash_streams_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    data = bytes(range(256)) * (2**13 + 1)  # more than one 1 MiB chunk
    path.write_bytes(data)
    assert cm.file_sha256(path) == cm.hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------
# the sizes and names a capture is cut into (the same at capture, resume and read time)
# ---------------------------------------------------------------------------------------------


def test_shard_and_tensor_names_are_zero_padded_and_the_teacher_state_is_listed_last() -> None:
    assert cm.shard_file_name(3) == "shard-00003.safetensors"
    assert cm.sample_tensor_names(12, last_hidden=False) == (
        "000000012.input_ids",
        "000000012.loss_mask",
        "000000012.taps",
    )
    assert cm.sample_tensor_names(12, last_hidden=True)[3:] == ("000000012.last_hidden",)


def test_a_token_costs_its_states_one_int32_id_and_one_mask_byte() -> None:
    # 2 taps of 4 float32 values, + 4 bytes of id + 1 byte of mask
    assert cm.bytes_per_token(2, 4, "float32", last_hidden=False) == 2 * 4 * 4 + 5 == 37
    # the teacher's last hidden state is one more state; bfloat16 halves the states
    assert cm.bytes_per_token(2, 4, "bfloat16", last_hidden=True) == 3 * 4 * 2 + 5
    # the disk estimate: tokens at that cost plus a header allowance per tensor
    per_tensor = cm.HEADER_BYTES_PER_TENSOR
    assert cm.estimate_bytes([2, 3], 2, 4, "float32", last_hidden=False) == 37 * 5 + per_tensor * 6
    assert cm.estimate_bytes([2, 3], 2, 4, "float32", last_hidden=True) == (
        cm.bytes_per_token(2, 4, "float32", last_hidden=True) * 5 + per_tensor * 8
    )


@pytest.mark.parametrize(
    ("counts", "bound", "shards"),
    [
        ([2, 3, 1], 60, [(0, 3)]),  # exactly at the bound: one shard
        ([2, 3, 1], 59, [(0, 2), (2, 1)]),  # one byte less: the last sample opens a shard
        ([1, 20, 1], 50, [(0, 1), (1, 1), (2, 1)]),  # an oversized sample stands alone
        ([5, 1, 4], 50, [(0, 1), (1, 2)]),  # a new shard starts empty: 10 + 40 fits exactly
        ([20], 50, [(0, 1)]),
        ([], 50, []),
    ],
)
def test_samples_are_cut_into_shards_in_order_at_the_byte_bound(
    counts: list[int], bound: int, shards: list[tuple[int, int]]
) -> None:
    assert cm.plan_shards(counts, bytes_per_token=10, max_shard_bytes=bound) == shards


# ---------------------------------------------------------------------------------------------
# formats that outlive a version: hashes recorded in manifests, the manifest's own fields
# ---------------------------------------------------------------------------------------------


def test_the_samples_hash_is_the_documented_byte_format() -> None:
    """Length (u64 LE), ids (i32 LE), mask bytes, per sample: a manifest written by an earlier
    version must still match."""
    samples = [([1, 70000], [0, 1]), ([3], [1])]
    expected = cm.hashlib.sha256()
    for ids, mask in samples:
        expected.update(struct.pack("<Q", len(ids)) + struct.pack(f"<{len(ids)}i", *ids))
        expected.update(bytes(mask))
    assert cm.samples_sha256(samples) == expected.hexdigest()


def test_the_tokenizer_hash_covers_each_tokenizer_file_by_name_and_content(
    tmp_path: Path,
) -> None:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    seen = {cm.tokenizer_sha256(tmp_path)}
    for name in names:
        (tmp_path / name).write_text(name)
        seen.add(cm.tokenizer_sha256(tmp_path))
    assert len(seen) == 5 and None in seen  # none, then each file added changes it
    expected = cm.hashlib.sha256()
    for name in names:
        digest = cm.file_sha256(tmp_path / name)
        expected.update(name.encode() + b"\0" + digest.encode() + b"\0")
    assert cm.tokenizer_sha256(tmp_path) == expected.hexdigest()


def test_a_shard_hash_with_other_characters_than_lower_hex_is_refused() -> None:
    for value in ("X" * 64, "A" * 64, "0" * 63):
        shard = {**attrs.asdict(manifest().shards[0]), "sha256": value}
        assert "shards[0]'s sha256 and samples_sha256 must be 64 hex digits" in refusal(
            raw(shards=[shard])
        )


def test_a_shards_samples_hash_survives_the_round_trip() -> None:
    entry = ShardEntry("shard-00000.safetensors", 0, 2, 5, bytes=1, sha256=HEX, samples_sha256=HEX)
    written = manifest(shards=(entry,))
    read = parse_manifest(written.to_json(), "cap/manifest.json")
    assert read.shards[0].samples_sha256 == HEX
    assert read.to_json() == written.to_json()


def test_the_identity_ignores_progress_but_not_what_a_shard_holds() -> None:
    entry = manifest().shards[0]
    unsized = ShardEntry(entry.file, 0, 2, 5)
    assert manifest(shards=(unsized,), complete=False).identity() == manifest().identity()
    other = ShardEntry(entry.file, 0, 1, 5, bytes=1, sha256=HEX)
    assert manifest(shards=(other,)).identity() != manifest().identity()


def test_the_manifest_is_indented_key_sorted_json_of_exactly_its_fields() -> None:
    text = manifest().to_json()
    assert text.startswith('{\n  "answer_only_loss": true,\n  "base_config_sha256": "')
    assert text.endswith("}\n")
    data = json.loads(text)
    assert list(data) == sorted(data)
    fields = {f.name for f in attrs.fields(CaptureManifest)}
    assert set(data) == fields | {"format", "format_version"}
    assert data["target_layer_ids"] == [1, 5]
