"""The target built on meta and read shard by shard (issue 51): what a plain load gives, bit for
bit, without a full copy of the target in any process; and the drafter's warm start into a
sharded drafter, bit for bit.

The multi-rank tests start this file as a script on each rank (gloo, as torchrun would); the
workers write what they found and the test compares.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from dflash_recipes.executor.model.meta_load import build_target_on_meta, layout_problems

TESTS = Path(__file__).resolve().parents[2]


def test_the_meta_build_holds_no_tensor_data_but_computes_its_buffers(tmp_path: Path) -> None:
    from testkit.tiny import tiny_plan, tiny_target

    from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights
    from dflash_recipes.executor.model.convert import load_base_model

    plan = tiny_plan(tmp_path)
    tiny_target(plan, save=True)
    meta = build_target_on_meta(plan.base_model)
    plain = load_base_model(plan)
    assert all(p.is_meta for p in meta.parameters())
    assert dict(meta.named_parameters()).keys() == dict(plain.named_parameters()).keys()
    # RoPE's inv_freq (not persistent, never in the files) is what a plain load computes
    buffers = dict(meta.named_buffers())
    assert buffers.keys() == dict(plain.named_buffers()).keys() and buffers
    for name, buffer in plain.named_buffers():
        assert torch.equal(buffers[name], buffer), name
    weights = read_checkpoint_weights(Path(plan.base_model.path))
    assert layout_problems(meta, weights) == []
    assert nn_register_is_restored()


def nn_register_is_restored() -> bool:
    """A module built after the meta build gets real parameters again."""
    return not torch.nn.Linear(2, 2).weight.is_meta


def test_files_that_are_not_the_modules_tensors_are_named(tmp_path: Path) -> None:
    from safetensors.torch import save_file
    from testkit.tiny import tiny_plan, tiny_target

    from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights

    plan = tiny_plan(tmp_path)
    tiny_target(plan, save=True)
    folder = Path(plan.base_model.path)
    tensors = {
        name.replace("mlp.up_proj", "mlp.w3"): t.contiguous()
        for name, t in tiny_target(plan).state_dict().items()
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    problems = layout_problems(
        build_target_on_meta(plan.base_model), read_checkpoint_weights(folder)
    )
    assert "model.layers.0.mlp.up_proj.weight: not in the files" in problems


def test_without_transformers_conversion_table_stacked_experts_are_named_not_misread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transformers whose loading internals moved (no ``rename_source_key``): names map one
    to one, so the stacked experts are problems (the target then loads whole) and a dense
    target still reads by name."""
    import attrs
    import transformers.core_model_loading as loading
    from testkit.families import FAMILIES, write_target
    from testkit.tiny import tiny_plan, tiny_target

    from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights

    family = next(f for f in FAMILIES if f.name == "qwen3_moe")
    folder = write_target(family, tmp_path / family.name)
    plan = tiny_plan(tmp_path)
    plan = attrs.evolve(plan, base_model=attrs.evolve(plan.base_model, path=str(folder)))
    dense = tiny_plan(tmp_path / "dense")
    tiny_target(dense, save=True)
    moe_meta, dense_meta = (build_target_on_meta(p.base_model) for p in (plan, dense))
    # only now: transformers' own save and load (which the targets above went through) use it
    monkeypatch.delattr(loading, "rename_source_key")
    problems = layout_problems(moe_meta, read_checkpoint_weights(folder))
    assert "model.layers.0.mlp.experts.gate_up_proj: not in the files" in problems
    assert all("experts" in problem for problem in problems), problems
    weights = read_checkpoint_weights(Path(dense.base_model.path))
    assert layout_problems(dense_meta, weights) == []


def test_a_target_not_readable_tensor_by_tensor_loads_whole_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A conversion stored_layout does not read expert by expert (here the stacked down_proj's
    rows interleaved, which transformers applies on load) is named, and the target is loaded
    whole: nothing left on meta, every value a plain load's."""
    import attrs
    from testkit.families import FAMILIES, write_target
    from testkit.tiny import tiny_plan
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )
    from transformers.core_model_loading import Interleave, MergeModulelist, WeightConverter

    from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights
    from dflash_recipes.executor.model.convert import load_base_model
    from dflash_recipes.executor.model.meta_load import load_target_on_meta

    family = next(f for f in FAMILIES if f.name == "qwen3_moe")
    folder = write_target(family, tmp_path / family.name)
    plan = tiny_plan(tmp_path)
    plan = attrs.evolve(plan, base_model=attrs.evolve(plan.base_model, path=str(folder)))
    # the same converters, with down_proj's rows interleaved after the stack
    operations = [MergeModulelist(dim=0), Interleave(dim=1)]
    interleaved = WeightConverter(
        "mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", operations=operations
    )
    kept = get_checkpoint_conversion_mapping("qwen3_moe")
    assert kept is not None
    gate_up = [c for c in kept if "gate_up_proj" in str(c.target_patterns)]
    register_checkpoint_conversion_mapping("qwen3_moe", [*gate_up, interleaved], overwrite=True)
    try:
        meta = build_target_on_meta(plan.base_model)
        problems = layout_problems(meta, read_checkpoint_weights(folder))
        assert any(
            p.startswith("model.layers.0.mlp.experts.down_proj: made on load by")
            and "not read expert by expert" in p
            for p in problems
        ), problems
        caplog.clear()
        model = load_target_on_meta(plan)
        assert "each process loads the whole target into host memory" in caplog.text
        assert "model.layers.0.mlp.experts.down_proj: made on load by" in caplog.text
        assert not any(p.is_meta for p in model.parameters())
        plain = dict(load_base_model(plan).named_parameters())
        for name, param in model.named_parameters():
            assert torch.equal(param, plain[name]), name
    finally:
        register_checkpoint_conversion_mapping("qwen3_moe", kept, overwrite=True)


#: The families whose checkpoints store each expert apart while transformers' modules stack
#: them (``mlp.experts.gate_up_proj``): read expert by expert through transformers' conversion
#: table (Mixtral's ``block_sparse_moe`` is also renamed ``mlp``).
STACKED_EXPERTS = {"qwen3_moe", "mixtral", "deepseek_v3", "qwen3_next", "glm4_moe"}


@pytest.mark.slow
def test_every_family_loads_from_meta_bit_for_bit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One process, no sharding: what load_target_on_meta reads whole and materialize_target
    fills is every parameter and buffer of a plain load, and its logits."""
    import attrs
    from testkit.families import FAMILIES, missing_reason, write_target
    from testkit.tiny import tiny_plan

    from dflash_recipes.executor.model.convert import load_base_model
    from dflash_recipes.executor.model.meta_load import load_target_on_meta, materialize_target

    ids = torch.tensor([[5, 7, 9, 11, 13, 15, 17, 19, 21, 23]])
    read_by_name = set()
    for family in FAMILIES:
        if missing_reason(family) is not None:
            continue
        folder = write_target(family, tmp_path / family.name)
        plan = tiny_plan(tmp_path)
        plan = attrs.evolve(plan, base_model=attrs.evolve(plan.base_model, path=str(folder)))
        caplog.clear()
        model = load_target_on_meta(plan)
        assert "loads the whole target" not in caplog.text, family.name
        assert any(p.is_meta for p in model.parameters()), family.name
        read_by_name.add(family.name)
        materialize_target(model, plan, torch.device("cpu"))
        plain = load_base_model(plan)
        expected = dict(plain.named_parameters())
        for name, param in model.named_parameters():
            assert param.dtype == expected[name].dtype, f"{family.name}: {name}"
            assert torch.equal(param, expected[name]), f"{family.name}: {name}"
        buffers = dict(plain.named_buffers())
        for name, buffer in model.named_buffers():
            assert torch.equal(buffer, buffers[name]), f"{family.name}: {name}"
        # A plain load's tensors can be views of the memory-mapped files at any byte offset,
        # and a CPU GEMV's rounding depends on its operand's alignment (Qwen3-Next's 1-row
        # shared_expert_gate differs in the last bit): compare logits on fresh copies, as any
        # move to a device makes them.
        for param in plain.parameters():
            param.data = param.data.clone()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, plain(ids).logits), family.name
    assert {"llama", "qwen3", "gemma3_text", "gpt_oss", "llama4_text"} <= read_by_name
    assert read_by_name >= STACKED_EXPERTS


# ---------------------------------------------------------------------------------------------
# several ranks, gloo
# ---------------------------------------------------------------------------------------------


def _ranks(argv: list[str], world_size: int, what: str) -> None:
    from testkit.ranks import run_ranks

    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    results = run_ranks(argv, world_size=world_size, env=env, what=what)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout}{result.stderr}"


@pytest.mark.slow
def test_three_ranks_read_the_plain_loads_weights_bit_for_bit(tmp_path: Path) -> None:
    """Three ranks: the target's dims (64, 128) split unevenly (22, 22, 20 rows of 64), as FSDP2
    pads; gathered, every parameter and buffer equals a plain load's, and the sharded target's
    forward gives its logits. The warm start of a sharded drafter gathers to the plain one."""
    from testkit.tiny import tiny_plan, tiny_target

    plan = tiny_plan(tmp_path, target_model_type="llama")
    tiny_target(plan, save=True)
    _ranks([sys.executable, __file__, "equal", str(tmp_path)], 3, "the 3-rank meta load (a hang?)")
    for rank in range(3):
        found = json.loads((tmp_path / f"equal{rank}.json").read_text())
        assert found["mismatched"] == [], f"rank {rank}"
        assert found["buffers_mismatched"] == [], f"rank {rank}"
        assert found["logits_equal"], f"rank {rank}"
        # the decoder layers were sharded, each rank holding its rows only
        assert found["sharded"] == 9 * found["layers"]  # 7 matrices and 2 norms a layer
        assert found["local_rows"] == [22, 22, 20][rank]  # q_proj's 64 rows
        assert found["whole_read_on_host"] == [
            "lm_head.weight",
            "model.embed_tokens.weight",
            "model.norm.weight",
        ]
        assert found["drafter_mismatched"] == [] and found["drafter_sharded"] > 0, f"rank {rank}"


@pytest.mark.slow
def test_two_ranks_read_only_the_experts_they_keep(tmp_path: Path) -> None:
    """The MoE families whose files store each expert apart (STACKED_EXPERTS), on 2 ranks: each
    rank reads the file tensors of the experts its shard of ``mlp.experts.*`` holds and no
    other; gathered, every parameter equals a plain load's and the sharded forward gives its
    logits."""
    from testkit.families import FAMILIES, missing_reason, write_target

    names = sorted(f.name for f in FAMILIES if f.name in STACKED_EXPERTS)
    for family in FAMILIES:
        if family.name in names:
            assert missing_reason(family) is None, family.name
            write_target(family, tmp_path / family.name)
    _ranks(
        [sys.executable, __file__, "experts", str(tmp_path), ",".join(names)],
        2,
        "the 2-rank MoE meta load (a hang?)",
    )
    assert set(names) == STACKED_EXPERTS
    for rank in range(2):
        found = json.loads((tmp_path / f"experts{rank}.json").read_text())
        for name in names:
            family = found[name]
            assert family["mismatched"] == [], f"rank {rank}, {name}"
            assert family["logits_equal"], f"rank {rank}, {name}"
            assert family["stacked"] > 0, f"rank {rank}, {name}"
            # the experts whose file tensors this rank read are those its shards hold
            assert family["experts_read"] == family["experts_kept"], f"rank {rank}, {name}"
            assert family["experts_kept"], f"rank {rank}, {name}"
        # 4 experts a layer: rank 0 keeps experts 0 and 1, rank 1 experts 2 and 3
        assert {e for k in found["qwen3_moe"]["experts_kept"] for e in k[1]} == (
            {0, 1} if rank == 0 else {2, 3}
        )


#: A bound on the host memory one of two ranks adds while it loads the target: its half of the
#: decoder layers (on the CPU its device holds them in host memory too), the tensors kept whole
#: (small here) and one tensor's rows in flight. A plain load holds the whole target (1.0).
RSS_BOUND = 0.65


@pytest.mark.slow
@pytest.mark.parametrize(
    ("hidden", "layers", "experts"),
    [(1024, 16, 0), (768, 9, 8)],
    ids=["dense", "moe-8-experts"],
)
def test_two_ranks_each_hold_well_below_a_full_copy_of_a_1_gb_target(
    tmp_path: Path, hidden: int, layers: int, experts: int
) -> None:
    """A Qwen3 target, and a Qwen3-MoE one whose files store each expert apart (read expert
    by expert), of about 1 GB each."""
    sys.path.insert(0, str(TESTS.parent / "benchmarks"))
    from _measure import write_wide_target  # benchmarks/ is no package

    folder = write_wide_target(tmp_path / "target", hidden, layers, experts=experts)
    target_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert target_bytes > 0.9 * 2**30
    _ranks([sys.executable, __file__, "rss", str(tmp_path)], 2, "the 2-rank 1 GB meta load")
    for rank in range(2):
        found = json.loads((tmp_path / f"rss{rank}.json").read_text())
        grown = found["peak_rss"] - found["start_rss"]
        print(f"rank {rank}: grew by {grown / target_bytes:.2f} of the target")  # -s shows it
        assert found["materialized"] > 0
        assert grown < RSS_BOUND * target_bytes, (
            f"rank {rank} grew by {grown / 2**20:.0f} MiB while loading a "
            f"{target_bytes / 2**20:.0f} MiB target (bound {RSS_BOUND})"
        )
    if experts:  # (a plain load of this MoE target grows by 1.98 of it: experts and stack)
        return
    # the same measurement sees a plain load's full copy (one process, no sharding)
    _ranks([sys.executable, __file__, "plain", str(tmp_path)], 1, "the plain 1 GB load")
    plain = json.loads((tmp_path / "plain0.json").read_text())
    plain_grown = plain["peak_rss"] - plain["start_rss"]
    print(f"a plain load: grew by {plain_grown / target_bytes:.2f} of the target")
    assert plain_grown > 0.95 * target_bytes


# ---------------------------------------------------------------------------------------------
# the workers
# ---------------------------------------------------------------------------------------------


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    msg = f"/proc/self/status has no {field}"
    raise RuntimeError(msg)


def _equal_worker(folder: Path) -> None:
    import attrs
    from testkit.tiny import tiny_plan, with_init_checkpoint
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from dflash_recipes.executor.dist_env import (
        detect_dist_env,
        init_distributed,
        shutdown_distributed,
    )
    from dflash_recipes.executor.model.convert import load_base_model
    from dflash_recipes.executor.model.draft import DFlashDraftModel
    from dflash_recipes.executor.model.export import export_drafter
    from dflash_recipes.executor.model.meta_load import load_target_on_meta, materialize_target
    from dflash_recipes.executor.model.warmstart import warm_start
    from dflash_recipes.executor.parallel_wrappers import shard_target_fsdp2

    env = detect_dist_env("cpu")
    init_distributed(env)
    found: dict[str, object] = {}
    try:
        plan = tiny_plan(folder, target_model_type="llama")
        plain = load_base_model(plan)
        model = load_target_on_meta(plan)
        loaded = sorted(n for n, p in model.named_parameters() if not p.is_meta)
        shard_target_fsdp2(model, env)
        materialize_target(model, plan, env.device)
        expected = dict(plain.named_parameters())
        mismatched, sharded, rows = [], 0, None
        for name, param in model.named_parameters():
            if isinstance(param, DTensor):
                sharded += 1
                if name == "model.layers.0.self_attn.q_proj.weight":
                    rows = param.to_local().shape[0]
                full = param.full_tensor()
            else:
                full = param
            if full.dtype != expected[name].dtype or not torch.equal(full, expected[name]):
                mismatched.append(name)
        own = dict(model.named_buffers())
        found["buffers_mismatched"] = [
            n for n, b in plain.named_buffers() if not torch.equal(own[n], b)
        ]
        ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
        with torch.no_grad():
            found["logits_equal"] = torch.equal(model(ids).logits, plain(ids).logits)
        found.update(
            mismatched=mismatched,
            sharded=sharded,
            layers=len(model.model.layers),
            local_rows=rows,
            whole_read_on_host=loaded,
        )

        # the drafter's warm start into a drafter sharded first (each rank its own rows)
        source = DFlashDraftModel(plan.resolved_draft(), generator=torch.Generator().manual_seed(7))
        init = folder / f"init{env.rank}"
        export_drafter(source, plan, init, dtype="bfloat16")
        warm = with_init_checkpoint(attrs.evolve(plan), init)
        reference = DFlashDraftModel(warm.resolved_draft(), generator=torch.Generator())
        warm_start(reference, warm)
        drafter = DFlashDraftModel(warm.resolved_draft(), generator=torch.Generator())
        for layer in drafter.layers:
            fully_shard(layer)
        fully_shard(drafter)
        warm_start(drafter, warm)
        wanted = dict(reference.named_parameters())
        drafter_mismatched, drafter_sharded = [], 0
        for name, param in drafter.named_parameters():
            if isinstance(param, DTensor):
                drafter_sharded += 1
                param = param.full_tensor()
            if not torch.equal(param, wanted[name]):
                drafter_mismatched.append(name)
        found.update(drafter_mismatched=drafter_mismatched, drafter_sharded=drafter_sharded)
    finally:
        shutdown_distributed()
    (folder / f"equal{env.rank}.json").write_text(json.dumps(found), encoding="utf-8")


def _rss_worker(folder: Path, *, plain: bool = False) -> None:
    import attrs
    from testkit.tiny import tiny_plan

    from dflash_recipes.executor.dist_env import (
        detect_dist_env,
        init_distributed,
        shutdown_distributed,
    )
    from dflash_recipes.executor.model.convert import load_base_model
    from dflash_recipes.executor.model.meta_load import load_target_on_meta, materialize_target
    from dflash_recipes.executor.model.shard_reads import local_part
    from dflash_recipes.executor.parallel_wrappers import shard_target_fsdp2

    env = detect_dist_env("cpu")
    init_distributed(env)
    try:
        plan = tiny_plan(folder)
        plan = attrs.evolve(
            plan, base_model=attrs.evolve(plan.base_model, path=str(folder / "target"))
        )
        # VmHWM, not ru_maxrss: a process started by fork and exec keeps its parent's
        # high-water mark in ru_maxrss; writing 5 to clear_refs resets VmHWM to the current RSS.
        Path("/proc/self/clear_refs").write_text("5")
        start = _rss_kib("VmRSS")
        if plain:
            model = load_base_model(plan)
            count = len(model.state_dict())
        else:
            model = load_target_on_meta(plan)
            shard_target_fsdp2(model, env)
            count = materialize_target(model, plan, env.device)
        # Read every value this process holds: a plain load's parameters may be views of the
        # memory-mapped file, whose pages count only once touched (as training touches them).
        with torch.no_grad():
            for param in model.parameters():
                local_part(param).sum()
        peak = _rss_kib("VmHWM")
    finally:
        shutdown_distributed()
    found = {"start_rss": start * 1024, "peak_rss": peak * 1024, "materialized": count}
    name = "plain" if plain else "rss"
    (folder / f"{name}{env.rank}.json").write_text(json.dumps(found), encoding="utf-8")


def _experts_worker(folder: Path, names: list[str]) -> None:
    import re

    import attrs
    from testkit.tiny import tiny_plan
    from torch.distributed.tensor import DTensor

    import dflash_recipes.executor.model.shard_reads as shard_reads
    from dflash_recipes.executor.dist_env import (
        detect_dist_env,
        init_distributed,
        shutdown_distributed,
    )
    from dflash_recipes.executor.model.convert import load_base_model
    from dflash_recipes.executor.model.meta_load import load_target_on_meta, materialize_target
    from dflash_recipes.executor.model.shard_reads import local_rows
    from dflash_recipes.executor.parallel_wrappers import shard_target_fsdp2

    read: list[str] = []
    opener = shard_reads.safe_open

    class Recording:  # safe_open, noting every tensor read through it
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.handle = opener(*args, **kwargs)

        def __enter__(self) -> Recording:
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.__exit__(*exc)

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self.inner.get_tensor(name)

        def get_slice(self, name: str) -> object:
            read.append(name)
            return self.inner.get_slice(name)

    shard_reads.safe_open = Recording  # type: ignore[assignment, misc]
    env = detect_dist_env("cpu")
    init_distributed(env)
    found: dict[str, object] = {}
    expert = re.compile(r"layers\.(\d+)\..*experts\.(\d+)\.")
    try:
        for name in names:
            plan = tiny_plan(folder)
            base = attrs.evolve(plan.base_model, path=str(folder / name))
            plan = attrs.evolve(plan, base_model=base)
            plain = load_base_model(plan)
            for param in plain.parameters():  # aligned copies (see the one-process test)
                param.data = param.data.clone()
            read.clear()
            model = load_target_on_meta(plan)
            shard_target_fsdp2(model, env)
            materialize_target(model, plan, env.device)
            experts_read: dict[str, set[int]] = {}
            for key in read:
                match = expert.search(key)
                if match:
                    experts_read.setdefault(match.group(1), set()).add(int(match.group(2)))
            expected = dict(plain.named_parameters())
            mismatched, stacked = [], 0
            experts_kept: dict[str, set[int]] = {}
            for pname, param in model.named_parameters():
                if pname.endswith("experts.gate_up_proj") or pname.endswith("experts.down_proj"):
                    stacked += 1
                    rows = local_rows(param)
                    assert rows is not None
                    layer = pname.split(".")[2]
                    kept = range(param.shape[0])[rows[0]]
                    experts_kept.setdefault(layer, set()).update(kept)
                full = param.full_tensor() if isinstance(param, DTensor) else param
                if not torch.equal(full, expected[pname]):
                    mismatched.append(pname)
            ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
            with torch.no_grad():
                equal = torch.equal(model(ids).logits, plain(ids).logits)
            found[name] = {
                "mismatched": mismatched,
                "stacked": stacked,
                "logits_equal": equal,
                "experts_read": sorted((k, sorted(v)) for k, v in experts_read.items()),
                "experts_kept": sorted((k, sorted(v)) for k, v in experts_kept.items()),
            }
    finally:
        shutdown_distributed()
    (folder / f"experts{env.rank}.json").write_text(json.dumps(found), encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1] == "equal":
        _equal_worker(Path(sys.argv[2]))
    elif sys.argv[1] == "experts":
        _experts_worker(Path(sys.argv[2]), sys.argv[3].split(","))
    else:
        _rss_worker(Path(sys.argv[2]), plain=sys.argv[1] == "plain")
