"""Capture and offline training on the shipped tiny target: offline equals online, resume."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from testkit.compiling import TINY_SCRATCH, tiny_scratch_plan
from testkit.tiny import tiny_plan, tiny_target

from dflash_recipes.cli import main
from dflash_recipes.errors import DataError
from dflash_recipes.executor.data import capture as capture_module
from dflash_recipes.executor.data.capture import capture_plan
from dflash_recipes.executor.training import step as step_module
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.files.capture_manifest import MANIFEST_FILE, read_manifest
from dflash_recipes.files.locking import LOCK_FILE
from dflash_recipes.plan.run_plan import RunPlan

#: Small shards: the 60 demo conversations fill several.
SHARD_BYTES = 2**19

pytestmark = pytest.mark.usefixtures("one_thread")


def _plan(tmp_path: Path, name: str, *extra: str) -> RunPlan:
    return tiny_scratch_plan(
        tmp_path / name,
        "training.max_steps=3",
        "training.save_steps=3",
        "training.eval_steps=null",
        *extra,
    )


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if row["kind"] == "train"]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "export" / "model.safetensors"))


@pytest.mark.parametrize("variant", ["plain", "self-distillation", "warm-start"])
def test_offline_training_equals_online(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    extra: tuple[str, ...] = ()
    if variant == "self-distillation":
        extra = ("dflash.dflash_self_logit_distillation=true", "dflash.dflash_loss_objective=dpace")
    if variant == "warm-start":
        run_plan(_plan(tmp_path, "source", "training.max_steps=2"), progress=False)
        extra = (f"dflash.dflash_init_checkpoint={tmp_path / 'source' / 'export'}",)
    online = _plan(tmp_path, "online", *extra)
    summary = capture_plan(
        online, tmp_path / "capture", max_shard_bytes=SHARD_BYTES, progress=False
    )
    assert summary.complete and summary.shards > 2
    manifest = read_manifest(tmp_path / "capture")
    assert manifest.last_hidden_state == (variant == "self-distillation")
    assert manifest.supervise == online.data.supervise  # compile compares it (issue 52)

    offline = _plan(tmp_path, "offline", *extra, f"data.hidden_states_path={tmp_path / 'capture'}")
    run_plan(online, progress=False)

    def no_decoder(*args: object, **kwargs: object) -> object:
        raise AssertionError("offline training ran the target's decoder")

    monkeypatch.setattr(step_module, "target_states", no_decoder)
    offline_summary = run_plan(offline, progress=False)
    assert offline_summary.data_summary.startswith(str(tmp_path / "capture"))

    on, off = _losses(tmp_path / "online"), _losses(tmp_path / "offline")
    assert len(on) == len(off) == 3
    assert on == pytest.approx(off, rel=1e-6, abs=1e-7)
    a, b = _weights(tmp_path / "online"), _weights(tmp_path / "offline")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-6), name
    if variant == "warm-start":
        source = _weights(tmp_path / "source")
        # The offline run started from the export, not from a fresh init: after 3 steps at
        # lr 3e-3 its weights are still near the source's.
        assert all(float((b[n] - source[n]).abs().max()) < 0.05 for n in source)


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_offline_loads_no_decoder_layers_and_recomputes_the_teacher(
    tmp_path: Path, model_type: str
) -> None:
    from dflash_recipes.executor.data.offline import load_target_without_decoder
    from dflash_recipes.executor.model.convert import lm_head, teacher_logits

    plan = tiny_plan(tmp_path, target_model_type=model_type)
    full = tiny_target(plan, save=True)
    model = load_target_without_decoder(plan)
    names = {name for name, _ in model.named_parameters()}
    assert names == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert model.config.num_hidden_layers == full.config.num_hidden_layers
    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        out = full(input_ids=ids, output_hidden_states=True)
        seen: list[torch.Tensor] = []
        hook = full.model.norm.register_forward_hook(lambda _m, a, _o: seen.append(a[0]))
        full(input_ids=ids)
        hook.remove()
        assert torch.equal(teacher_logits(model, lm_head(model), seen[0]), out.logits)


def test_killed_capture_resumes_and_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "run")
    whole = tmp_path / "whole"
    capture_plan(plan, whole, max_shard_bytes=SHARD_BYTES, progress=False)

    parts = tmp_path / "parts"
    first = capture_plan(
        plan, parts, max_shard_bytes=SHARD_BYTES, progress=False, stop_after_shards=3
    )
    assert not first.complete and first.shards_written == 3
    assert not read_manifest(parts).complete
    # What a kill in the middle of shard 4 leaves: a half-written hidden temporary file, and
    # (a damaged disk) a shard cut short under its final name.
    (parts / ".shard-00003.safetensors.tmp-999999").write_bytes(b"\x00" * 100)
    shard1 = parts / "shard-00001.safetensors"
    shard1.write_bytes(shard1.read_bytes()[:1000])

    second = capture_plan(plan, parts, max_shard_bytes=SHARD_BYTES, progress=False)
    assert second.complete
    assert second.shards_written == second.shards - 2  # shards 0 and 2 were kept
    names = sorted(p.name for p in whole.iterdir())
    assert sorted(p.name for p in parts.iterdir()) == names
    for name in names:
        if name != LOCK_FILE:
            assert (whole / name).read_bytes() == (parts / name).read_bytes(), name


def test_a_folder_of_parquet_or_jsonl_files_captures_like_the_same_jsonl(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    plan = _plan(tmp_path, "run")
    assert plan.data.data_path is not None
    lines = Path(plan.data.data_path).read_text(encoding="utf-8").splitlines()
    half = len(lines) // 2
    (tmp_path / "parquet").mkdir()
    (tmp_path / "jsonl").mkdir()
    for name, part in (("a", lines[:half]), ("b", lines[half:])):
        table = pa.Table.from_pylist([json.loads(line) for line in part])
        pq.write_table(table, tmp_path / "parquet" / f"{name}.parquet")
        (tmp_path / "jsonl" / f"{name}.jsonl").write_text("\n".join(part) + "\n")
    reference = tmp_path / "from-one-jsonl"
    capture_plan(plan, reference, max_shard_bytes=SHARD_BYTES, progress=False)
    expected = json.loads((reference / MANIFEST_FILE).read_text())
    names = sorted(p.name for p in reference.iterdir() if p.suffix == ".safetensors")
    assert len(names) > 1
    for folder in ("parquet", "jsonl"):
        other = _plan(tmp_path, f"run-{folder}", f"data.data_path={tmp_path / folder}")
        out = tmp_path / f"from-{folder}"
        capture_plan(other, out, max_shard_bytes=SHARD_BYTES, progress=False)
        for name in names:
            assert (out / name).read_bytes() == (reference / name).read_bytes(), (folder, name)
        manifest = json.loads((out / MANIFEST_FILE).read_text())
        assert manifest["data_path"] == str(tmp_path / folder)
        assert manifest["data_sha256"] not in (None, expected["data_sha256"])
        ignored = ("data_path", "data_sha256")
        assert {k: v for k, v in manifest.items() if k not in ignored} == {
            k: v for k, v in expected.items() if k not in ignored
        }, folder


def test_capture_writes_only_safetensors_and_json(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "run", "dflash.dflash_self_logit_distillation=true")
    out = tmp_path / "capture"
    capture_plan(plan, out, max_shard_bytes=SHARD_BYTES, progress=False)
    files = sorted(out.iterdir())
    assert {p.name for p in files} - {MANIFEST_FILE, LOCK_FILE} == {
        f"shard-{i:05d}.safetensors" for i in range(len(files) - 2)
    }
    for path in files:
        raw = path.read_bytes()
        assert not raw.startswith(b"\x80"), f"{path.name} starts like a pickle"
        assert not raw.startswith(b"PK"), f"{path.name} is a zip (torch.save) archive"
        if path.suffix == ".safetensors":
            (size,) = struct.unpack("<Q", raw[:8])
            header = json.loads(raw[8 : 8 + size])
            dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
            assert dtypes == {"I32", "U8", "F32"}
        else:
            json.loads(raw)  # manifest.json and the lock's holder record are JSON
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["format"] == "dflash-capture" and manifest["format_version"] == 2
    assert manifest["target_layer_ids"] == list(plan.resolved_draft().target_layer_ids)
    assert manifest["last_hidden_state"] is True


def test_capture_refuses_when_the_disk_is_too_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _plan(tmp_path, "run")
    out = tmp_path / "capture"
    monkeypatch.setattr(
        capture_module.shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(10**6, 10**6, 1000)
    )
    with pytest.raises(DataError, match=r"capture needs about 3\.\d MiB .* has 1000 B free"):
        capture_plan(plan, out, max_shard_bytes=SHARD_BYTES, progress=False)
    assert [p.name for p in out.iterdir()] == [LOCK_FILE]


def test_capture_refuses_a_directory_holding_another_capture(tmp_path: Path) -> None:
    out = tmp_path / "capture"
    capture_plan(_plan(tmp_path, "a"), out, max_shard_bytes=SHARD_BYTES, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name != LOCK_FILE}
    other = _plan(tmp_path, "b", "dflash.dflash_architecture_config.target_layer_ids=[0,4]")
    with pytest.raises(DataError, match=r"holds a capture of other data .*target_layer_ids"):
        capture_plan(other, out, max_shard_bytes=SHARD_BYTES, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != LOCK_FILE} == before


def test_cli_capture_then_compile_offline(tmp_path: Path) -> None:
    runner = CliRunner()
    common = ["training.training_seq_len=64", "dflash.dflash_block_size=4"]
    out = tmp_path / "capture"
    result = runner.invoke(
        main, ["capture", str(TINY_SCRATCH), *common, "--output", str(out), "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    assert "captured 60 samples" in result.output
    compiled = runner.invoke(
        main, ["compile", str(TINY_SCRATCH), *common, f"data.hidden_states_path={out}"]
    )
    assert compiled.exit_code == 0, compiled.output
    assert "0 errors, 0 warnings" in compiled.output
    # No --output and no data.hidden_states_path: a usage error, not a traceback.
    missing = runner.invoke(main, ["capture", str(TINY_SCRATCH), *common])
    assert missing.exit_code != 0
    assert "pass --output DIR, or set data.hidden_states_path" in missing.output


def test_offline_run_resumes_exactly(tmp_path: Path) -> None:
    capture = tmp_path / "capture"
    capture_plan(_plan(tmp_path, "c"), capture, max_shard_bytes=SHARD_BYTES, progress=False)
    offline = f"data.hidden_states_path={capture}"
    run_plan(
        _plan(tmp_path, "straight", offline, "training.max_steps=4", "training.save_steps=2"),
        progress=False,
    )
    half = _plan(tmp_path, "halves", offline, "training.max_steps=4", "training.save_steps=2")
    run_plan(half, progress=False, stop_after=2)
    resumed = _plan(tmp_path, "halves", offline, "training.max_steps=4", "training.save_steps=2")
    assert resumed.resume is not None and resumed.resume.step == 2
    assert run_plan(resumed, progress=False).resumed_from_step == 2
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "halves")
    assert all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.slow
def test_two_process_capture_is_byte_identical(tmp_path: Path) -> None:
    """`capture --nproc-per-node 2`: the ranks split the shards; the files equal one process's."""
    import os
    import subprocess
    import sys

    plan = _plan(tmp_path, "run")
    single = tmp_path / "single"
    capture_plan(plan, single, max_shard_bytes=2**20, progress=False)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json(), encoding="utf-8")
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    }
    env["OMP_NUM_THREADS"] = "1"
    two = tmp_path / "ddp"
    argv = [sys.executable, "-m", "dflash_recipes", "capture", str(plan_file)]
    argv += ["--output", str(two), "--shard-mib", "1", "--nproc-per-node", "2", "--no-progress"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name for p in single.iterdir() if p.name != LOCK_FILE)
    assert len(names) > 3
    assert sorted(p.name for p in two.iterdir() if p.name != LOCK_FILE) == names
    for name in names:
        assert (single / name).read_bytes() == (two / name).read_bytes(), name


def test_capture_into_a_file_is_a_clean_error(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    result = CliRunner().invoke(
        main, ["capture", str(TINY_SCRATCH), "--output", str(not_a_dir), "--no-progress"]
    )
    assert result.exit_code == 2  # a usage error, from the option's type
    assert "is a file" in result.output and "Traceback" not in result.output
    with pytest.raises(DataError, match=rf"capture into {not_a_dir} failed: .*rerun the same"):
        capture_plan(_plan(tmp_path, "run"), not_a_dir, progress=False)
    assert not_a_dir.read_text() == "x"


@pytest.mark.slow
def test_two_process_offline_run_matches_one_process(tmp_path: Path) -> None:
    """Offline under DDP: 2 ranks x 1 sequence read their own rows of the same global batch."""
    import os
    import subprocess
    import sys

    capture = tmp_path / "capture"
    capture_plan(_plan(tmp_path, "c"), capture, max_shard_bytes=SHARD_BYTES, progress=False)
    offline = f"data.hidden_states_path={capture}"
    run_plan(_plan(tmp_path, "single", offline), progress=False)
    ddp = _plan(tmp_path, "ddp", offline, "training.per_device_train_batch_size=1")
    plan_file = tmp_path / "ddp_plan.json"
    plan_file.write_text(ddp.to_json(), encoding="utf-8")
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    }
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "dflash_recipes", "run", str(plan_file)]
    argv += ["--nproc-per-node", "2", "--no-progress"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _weights(tmp_path / "single"), _weights(tmp_path / "ddp")
    assert a.keys() == b.keys()
    # As the online DDP test: reduction order differs; a wrong row would move weights by ~lr.
    for name in a:
        diff = (a[name] - b[name]).abs()
        assert float(diff.max()) < 1e-4, name
        assert float(diff.mean()) < 1e-7, name
