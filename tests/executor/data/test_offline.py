"""A capture directory is not trusted blindly: shard hashes are recorded and checked.

A shard whose bytes changed (a flipped byte inside its tensor data, header intact) is refused
on the first read of its states, and a shard copied in from a capture of other data is refused
at setup by its samples (token ids and loss masks), both naming the shard, the two hashes and
the fix; rerunning `capture` writes that shard again and training then runs. A version-1
manifest (no hashes) is still read.
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.errors import DataError
from dflash_recipes.executor.data import offline
from dflash_recipes.executor.data.capture import capture_plan
from dflash_recipes.executor.data.offline import CaptureReader
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.files.capture_manifest import (
    MANIFEST_FILE,
    RECAPTURE_SHARD,
    file_sha256,
    read_manifest,
)
from dflash_recipes.plan.run_plan import RunPlan

DOMAIN = Path(__file__).resolve().parents[3] / "dflash_recipes" / "demo_data" / "data"
SHARD_BYTES = 2**19

pytestmark = pytest.mark.usefixtures("one_thread")


def _plan(tmp_path: Path, name: str, *extra: str) -> RunPlan:
    return tiny_scratch_plan(
        tmp_path / name,
        "training.max_steps=2",
        "training.save_steps=2",
        "training.eval_steps=null",
        *extra,
    )


def _captured(tmp_path: Path, name: str, *extra: str) -> Path:
    out = tmp_path / name
    summary = capture_plan(
        _plan(tmp_path, f"{name}-run", *extra), out, max_shard_bytes=SHARD_BYTES, progress=False
    )
    assert summary.complete and summary.shards >= 2
    return out


def _offline(tmp_path: Path, capture: Path, name: str = "offline") -> RunPlan:
    return _plan(tmp_path, name, f"data.hidden_states_path={capture}")


def _train_rows(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    return sum(json.loads(x)["kind"] == "train" for x in metrics.read_text().splitlines())


def test_the_manifest_records_each_shards_content_and_token_ids(tmp_path: Path) -> None:
    capture = _captured(tmp_path, "capture")
    manifest = read_manifest(capture)
    assert json.loads((capture / MANIFEST_FILE).read_text())["format_version"] == 2
    for entry in manifest.shards:
        assert entry.sha256 == file_sha256(capture / entry.file)
        assert entry.samples_sha256 is not None and len(entry.samples_sha256) == 64
    assert len({e.samples_sha256 for e in manifest.shards}) == len(manifest.shards)


def test_a_flipped_byte_is_refused_before_its_states_are_used_then_recapture_trains(
    tmp_path: Path,
) -> None:
    capture = _captured(tmp_path, "capture")
    manifest = read_manifest(capture)
    bad = manifest.shards[1]
    path = capture / bad.file
    raw = bytearray(path.read_bytes())
    raw[-64:-32] = bytes(b ^ 0xFF for b in raw[-64:-32])  # inside the last tensor's data
    path.write_bytes(bytes(raw))
    found = file_sha256(path)

    reader = CaptureReader(capture, manifest)
    try:
        good = manifest.shards[0].first_sample
        reader.states([good], 64)  # another shard reads as before
        with pytest.raises(DataError) as info:
            reader.states([bad.first_sample], 64)
    finally:
        reader.close()
    assert str(info.value) == (
        f"capture shard {path} is not the one the manifest recorded: its content sha256 is "
        f"{found}, the manifest says {bad.sha256} (the file changed, or was copied from "
        f"another capture); {RECAPTURE_SHARD}"
    )
    with pytest.raises(DataError, match=f"capture shard {path} is not the one"):
        run_plan(_offline(tmp_path, capture), progress=False)

    rerun = capture_plan(
        _plan(tmp_path, "capture-run"), capture, max_shard_bytes=SHARD_BYTES, progress=False
    )
    assert rerun.complete and rerun.shards_written == 1
    assert read_manifest(capture).shards[1].sha256 == bad.sha256  # the same bytes again
    summary = run_plan(_offline(tmp_path, capture, "retrained"), progress=False)
    assert summary.steps == 2


def test_a_shard_from_a_capture_of_other_data_is_refused_before_any_step(
    tmp_path: Path,
) -> None:
    capture = _captured(tmp_path, "capture")
    rows = (DOMAIN / "domain.jsonl").read_text().splitlines()
    rows[0], rows[1] = rows[1], rows[0]  # other data, the same sizes: no size check can see it
    other_data = tmp_path / "other.jsonl"
    other_data.write_text("\n".join(rows) + "\n")
    other = _captured(tmp_path, "other", f"data.data_path={other_data}")
    entry = read_manifest(capture).shards[0]
    assert (other / entry.file).stat().st_size == (capture / entry.file).stat().st_size
    shutil.copyfile(other / entry.file, capture / entry.file)

    with pytest.raises(DataError) as info:
        run_plan(_offline(tmp_path, capture), progress=False)
    message = str(info.value)
    assert message.startswith(
        f"capture shard {capture / entry.file} is not the one the manifest recorded: its "
        "samples (token ids and loss masks) sha256 is "
    )
    assert f"the manifest says {entry.samples_sha256}" in message
    assert message.endswith(RECAPTURE_SHARD)
    assert _train_rows(tmp_path / "offline") == 0  # refused at setup: no step ran

    rerun = capture_plan(
        _plan(tmp_path, "capture-run"), capture, max_shard_bytes=SHARD_BYTES, progress=False
    )
    assert rerun.shards_written == 1
    assert run_plan(_offline(tmp_path, capture, "retrained"), progress=False).steps == 2


def test_a_version_1_manifest_without_hashes_is_still_read(tmp_path: Path) -> None:
    capture = _captured(tmp_path, "capture")
    raw = json.loads((capture / MANIFEST_FILE).read_text())
    raw["format_version"] = 1
    for shard in raw["shards"]:
        del shard["sha256"], shard["samples_sha256"]
    (capture / MANIFEST_FILE).write_text(json.dumps(raw))
    manifest = read_manifest(capture)
    assert all(e.sha256 is None and e.samples_sha256 is None for e in manifest.shards)
    assert run_plan(_offline(tmp_path, capture), progress=False).steps == 2


def test_verify_capture_hashes_every_shard_before_the_first_step(tmp_path: Path) -> None:
    capture = _captured(tmp_path, "capture")
    last = read_manifest(capture).shards[-1]
    path = capture / last.file
    raw = bytearray(path.read_bytes())
    raw[-40] ^= 0x01  # one bit of the last tensor's data
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=f"capture shard {path} is not the one"):
        run_plan(_offline(tmp_path, capture), progress=False, verify_capture=True)
    assert _train_rows(tmp_path / "offline") == 0


def test_a_flipped_loss_mask_byte_is_refused_at_setup(tmp_path: Path) -> None:
    capture = _captured(tmp_path, "capture")
    entry = read_manifest(capture).shards[0]
    path = capture / entry.file
    raw = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    start, _ = header[f"{entry.first_sample:09d}.loss_mask"]["data_offsets"]
    raw[8 + size + start] ^= 0x01  # a token's supervision flips: the data summary would lie
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"its samples \(token ids and loss masks\) sha256 is"):
        run_plan(_offline(tmp_path, capture), progress=False)
    assert _train_rows(tmp_path / "offline") == 0


def _mapped(capture: Path) -> list[str]:
    """The capture's shard files this process has memory-mapped now (/proc/self/maps)."""
    text = Path("/proc/self/maps").read_text(encoding="utf-8", errors="replace")
    return sorted({line.rsplit(" ", 1)[-1] for line in text.splitlines() if str(capture) in line})


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_shard_handles_are_bounded_and_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # issue 36: the offline reader kept every shard it had read mapped, never closing one
    capture = _captured(tmp_path, "capture")
    manifest = read_manifest(capture)
    monkeypatch.setattr(offline, "MAX_OPEN_SHARDS", 1)
    first, second = manifest.shards[0], manifest.shards[1]
    with CaptureReader(capture, manifest) as reader:
        reader.states([first.first_sample], 64)
        assert _mapped(capture) == [str(capture / first.file)]
        taps = reader.states([second.first_sample], 64).tapped
        assert reader.open_shards == (second.file,)
        assert _mapped(capture) == [str(capture / second.file)]  # the first one was closed
    assert _mapped(capture) == []
    assert torch.isfinite(taps).all()  # what was read stays valid after the close


def test_states_come_in_the_stored_dtype_and_in_host_memory(tmp_path: Path) -> None:
    """No float32 upcast on the host: the loop moves the stored (target) dtype to the device."""
    capture = _captured(tmp_path, "capture", "model.dtype=bfloat16")
    manifest = read_manifest(capture)
    assert manifest.dtype == "bfloat16"
    with CaptureReader(capture, manifest) as reader:
        lengths = [len(reader.example(i).input_ids) for i in (0, 1)]
        states = reader.states([0, 1], max(lengths) + 3)
    assert states.tapped.dtype == torch.bfloat16 and states.tapped.device.type == "cpu"
    for row, n in enumerate(lengths):
        assert torch.count_nonzero(states.tapped[row, n:]) == 0  # zeros past the row
        assert torch.count_nonzero(states.tapped[row, :n]) > 0


def test_every_shard_is_hashed_once_whichever_thread_asks_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    capture = _captured(tmp_path, "capture")
    manifest = read_manifest(capture)
    hashed: list[str] = []
    check = offline.shard_content_problem

    def counted(directory: Path, entry: object) -> str | None:
        hashed.append(entry.file)  # type: ignore[attr-defined]
        time.sleep(0.1)  # a slow disk: the reads below arrive while a shard is being hashed
        return check(directory, entry)  # type: ignore[arg-type]

    monkeypatch.setattr(offline, "shard_content_problem", counted)
    with CaptureReader(capture, manifest) as reader:
        thread = reader.verify_in_background()
        for entry in manifest.shards:  # reads racing the background hashing
            reader.states([entry.first_sample], 64)
        thread.join(timeout=60)
        assert not thread.is_alive()
    assert sorted(hashed) == sorted(e.file for e in manifest.shards)  # each exactly once


def test_the_background_hashing_leaves_a_bad_shard_to_the_read_that_needs_it(
    tmp_path: Path,
) -> None:
    capture = _captured(tmp_path, "capture")
    manifest = read_manifest(capture)
    bad = manifest.shards[0]
    path = capture / bad.file
    raw = bytearray(path.read_bytes())
    raw[-40:-8] = bytes(b ^ 0xFF for b in raw[-40:-8])
    path.write_bytes(bytes(raw))
    with CaptureReader(capture, manifest) as reader:
        reader.verify_in_background().join(timeout=60)
        later = manifest.shards[-1]
        reader.states([later.first_sample], 64)  # the good shards were hashed and pass
        with pytest.raises(DataError, match=f"capture shard {path} is not the one"):
            reader.states([bad.first_sample], 64)
