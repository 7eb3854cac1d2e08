"""The compile-time resource plan: exact parts from the headers, FSDP sharding, activations that
follow the shapes, and `compile --device-memory` refusing what does not fit (with what would)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from testkit.cli_runner import cli
from testkit.fixture_8b import make_fixture

from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights
from dflash_recipes.compiler.codes import RESOURCES_EXCEED_DEVICE
from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.plan.resources.estimate import (
    GIB,
    estimate_resources,
    is_decoder_layer_tensor,
    read_target_dims,
)
from dflash_recipes.plan.resources.fit import fit_advice
from dflash_recipes.plan.run_plan import RunPlan

ROOT = Path(__file__).resolve().parents[3]
SEED_8B = ROOT / "recipes" / "Qwen" / "Qwen3-8B" / "hf_online_dflash.yaml"
FINETUNE_8B = ROOT / "recipes" / "Qwen" / "Qwen3-8B" / "hf_online_dflash_finetune.yaml"


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3-8B-scale fixture with the target's sparse shards (real headers, no data)."""
    out = tmp_path_factory.mktemp("qwen3_8b_resources")
    make_fixture(out, target_weights=True)
    return out


def _args(fixture: Path, *extra: str) -> list[str]:
    return [
        f"model.model_name_or_path={fixture / 'base'}",
        f"data.data_path={fixture / 'data' / 'train.jsonl'}",
        f"training.output_dir={fixture / 'runs' / 'seed'}",
        *extra,
    ]


def _plan(fixture: Path, *extra: str, recipe: Path = SEED_8B) -> RunPlan:
    result = compile_file(recipe, overrides=_args(fixture, *extra))
    assert result.plan is not None, [str(d) for d in result.diagnostics]
    return result.plan


def test_exact_parts_are_the_sums_over_the_safetensors_headers(qwen3_8b: Path) -> None:
    plan = _plan(
        qwen3_8b, f"dflash.dflash_init_checkpoint={qwen3_8b / 'drafter'}", recipe=FINETUNE_8B
    )
    resources = estimate_resources(plan)
    memory = resources.memory
    target = read_checkpoint_weights(qwen3_8b / "base")
    assert len(target.tensors) == 399 and target.dtypes == ("BF16",)
    # bf16 on disk and in the plan: the target's bytes are its header's data size
    assert memory.target_weights == target.total_bytes == 16_381_470_720
    drafter = read_checkpoint_weights(qwen3_8b / "drafter")
    assert len(drafter.tensors) == 58
    numel = sum(math.prod(info.shape) for info in drafter.tensors.values())
    assert numel == 1_048_626_432
    assert memory.drafter_weights == 4 * numel  # float32 master weights
    assert resources.gradient_bytes == 4 * numel  # float32 gradients after the backward
    # one rank, one micro-step: the peak (the turn from forward to backward) holds none yet
    assert memory.gradients == 0
    assert memory.optimizer_states == 8 * numel + 4 * 58  # two moments, a step per tensor


def test_fsdp_over_8_ranks_shards_the_decoder_layers_and_keeps_the_rest_whole(
    qwen3_8b: Path,
) -> None:
    plan = _plan(qwen3_8b, "training.fsdp=true")
    sharded = estimate_resources(plan, world_size=8)
    whole = estimate_resources(plan, world_size=1)
    target = read_checkpoint_weights(qwen3_8b / "base")
    layers = sum(i.nbytes for n, i in target.tensors.items() if ".layers." in n)
    rest = target.total_bytes - layers
    assert rest == 2 * 151936 * 4096 * 2 + 4096 * 2  # embed_tokens, lm_head, final norm
    assert sharded.fsdp_sharded and not whole.fsdp_sharded
    assert whole.memory.target_weights == target.total_bytes
    # every layer tensor splits evenly over 8 ranks here (dims are multiples of 8)
    assert sharded.memory.target_weights == rest + layers // 8
    # without training.fsdp, 8 ranks each hold the whole target (DDP doubles the gradients)
    ddp = estimate_resources(_plan(qwen3_8b), world_size=8)
    assert ddp.memory.target_weights == target.total_bytes
    # DDP's gradient buckets are alive all step, the gradients themselves not yet at the peak
    assert ddp.memory.gradients == whole.gradient_bytes and whole.memory.gradients == 0
    # FSDP gathers layers during the target's forward
    assert sharded.activation_parts.target_forward_peak > whole.activation_parts.target_forward_peak


def test_fsdp_pads_a_dim_that_does_not_split_evenly(qwen3_8b: Path) -> None:
    plan = _plan(qwen3_8b, "training.fsdp=true")
    dims = read_target_dims(qwen3_8b / "base")
    shapes = dict(dims.shapes)
    shapes["model.layers.0.self_attn.q_norm.weight"] = (129,)  # 129 over 8 ranks: 17 each
    odd = attrs.evolve(dims, shapes=shapes)
    even = estimate_resources(plan, world_size=8, target=dims).memory.target_weights
    padded = estimate_resources(plan, world_size=8, target=odd).memory.target_weights
    assert padded - even == (17 - 128 // 8) * 2
    assert is_decoder_layer_tensor("model.layers.3.mlp.up_proj.weight")
    assert not is_decoder_layer_tensor("model.embed_tokens.weight")


def test_activations_grow_with_anchors_and_sequence_length(qwen3_8b: Path) -> None:
    def activations(*extra: str) -> int:
        return estimate_resources(_plan(qwen3_8b, *extra)).memory.activations

    anchors = [activations(f"dflash.dflash_num_anchors={n}") for n in (128, 256, 512, 1024)]
    assert anchors == sorted(anchors) and len(set(anchors)) == 4
    seqs = [activations(f"training.training_seq_len={s}") for s in (1024, 2048, 4096, 8192)]
    assert seqs == sorted(seqs) and len(set(seqs)) == 4
    batch = [activations(f"training.per_device_train_batch_size={b}") for b in (1, 2)]
    assert batch[1] > batch[0]


def test_step_figures_and_disk(qwen3_8b: Path) -> None:
    plan = _plan(qwen3_8b)
    found = estimate_resources(plan, world_size=8)
    assert found.step.tokens == 8 * 4096  # batch 1 x seq 4096 x 8 ranks
    assert found.step.supervised_positions == 8 * 512 * 15
    # a forward of an 8B target is about 2 x 7.6e9 FLOPs per token (lm_head not run)
    per_token = found.step.target_flops / found.step.tokens
    assert 1.4e10 < per_token < 1.8e10
    assert found.step.flops > found.step.target_flops
    disk = found.disk
    assert disk.checkpoints_kept == 3  # save_total_limit 2, plus the new one before pruning
    assert disk.export_bytes == pytest.approx(2 * 1_048_626_432, rel=0.001)
    assert disk.checkpoint_bytes == pytest.approx(12 * 1_048_626_432, rel=0.001)


def test_json_output_has_the_fixed_keys(qwen3_8b: Path) -> None:
    result = cli("compile", str(SEED_8B), *_args(qwen3_8b), "--format", "json")
    assert result.exit_code == 0, result.output
    resources = json.loads(result.stdout)["resources"]
    memory = resources["memory_per_rank"]
    parts = ("target_weights", "drafter_weights", "gradients", "optimizer_states", "activations")
    assert all(isinstance(memory[k], int) and memory[k] >= 0 for k in (*parts, "total"))
    assert memory["total"] > 0 and resources["gradient_bytes"] > 0
    assert memory["total"] == sum(memory[k] for k in parts) + memory["allowance"]
    assert resources["step"]["tokens"] == 4096 and resources["step"]["flops"] > 0
    assert resources["disk"]["checkpoint_bytes"] > resources["disk"]["export_bytes"] > 0


def test_text_output_shows_the_gib_table_and_mfu_timing(qwen3_8b: Path) -> None:
    result = cli("compile", str(SEED_8B), *_args(qwen3_8b), "--mfu", "0.4", "-o", "/dev/null")
    assert result.exit_code == 0, result.output
    err = result.stderr
    for row in ("target weights", "drafter weights", "optimizer states", "activations", "total"):
        assert row in err
    assert "15.26" in err  # Qwen3-8B in bf16, GiB
    assert "s per step" in err and "per epoch (1 steps of 1 sequences)" in err


def test_a_24_gib_device_refuses_the_seed_8b_recipe_with_what_would_fit(qwen3_8b: Path) -> None:
    result = cli("compile", str(SEED_8B), *_args(qwen3_8b), "--device-memory", "24")
    assert result.exit_code == 1
    err = result.stderr
    assert f"error[{RESOURCES_EXCEED_DEVICE}]" in err
    assert "more than --device-memory 24 (24.00 GiB)" in err
    # weights, gradients and AdamW states alone exceed 24 GiB: no single knob fits
    assert "no single change of dflash_num_anchors" in err
    assert "training.fsdp: true" in err
    assert "compile failed" in err


def test_what_would_fit_names_the_largest_anchors_batch_and_length(qwen3_8b: Path) -> None:
    plan = _plan(qwen3_8b, "dflash.dflash_num_anchors=2048", "training.training_seq_len=8192")
    total = estimate_resources(plan).memory.total
    device = total - GIB
    advice = fit_advice(plan, device, world_size=1)
    assert advice.num_anchors is not None and advice.num_anchors < 2048
    assert advice.training_seq_len is not None and advice.training_seq_len < 8192

    def fits(*extra: str) -> bool:
        changed = _plan(qwen3_8b, "dflash.dflash_num_anchors=2048", *extra)
        return estimate_resources(changed).memory.total <= device

    assert fits(f"dflash.dflash_num_anchors={advice.num_anchors}", "training.training_seq_len=8192")
    assert not fits(
        f"dflash.dflash_num_anchors={advice.num_anchors + 1}", "training.training_seq_len=8192"
    )
    result = cli(
        "compile",
        str(SEED_8B),
        *_args(qwen3_8b, "dflash.dflash_num_anchors=2048", "training.training_seq_len=8192"),
        "--device-memory",
        f"{device / GIB}",
    )
    assert result.exit_code == 1
    assert f"dflash.dflash_num_anchors: {advice.num_anchors}" in result.stderr
    assert f"training.training_seq_len: {advice.training_seq_len}" in result.stderr


def test_fsdp_advice_over_the_world_size(qwen3_8b: Path) -> None:
    plan = _plan(qwen3_8b)
    ddp = estimate_resources(plan, world_size=8).memory.total
    fsdp = estimate_resources(_plan(qwen3_8b, "training.fsdp=true"), world_size=8).memory.total
    assert fsdp < ddp
    between = (fsdp + ddp) // 2
    assert fit_advice(plan, between, world_size=8).fsdp_fits is True
    assert fit_advice(plan, fsdp - 1, world_size=8).fsdp_fits is False
    result = cli(
        "compile",
        str(SEED_8B),
        *_args(qwen3_8b),
        "--world-size",
        "8",
        "--device-memory",
        f"{between / GIB}",
    )
    assert result.exit_code == 1
    assert "training.fsdp: true (over 8 ranks" in result.stderr


def test_a_141_gib_device_accepts_the_seed_8b_recipe(qwen3_8b: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = cli(
        "compile", str(SEED_8B), *_args(qwen3_8b), "--device-memory", "141", "-o", str(out)
    )
    assert result.exit_code == 0, result.output
    assert out.is_file()
    assert RESOURCES_EXCEED_DEVICE not in result.stderr


def test_a_target_without_weights_is_sized_from_its_config(qwen3_8b: Path, tmp_path: Path) -> None:
    config_only = tmp_path / "base"
    config_only.mkdir()
    (config_only / "config.json").write_bytes((qwen3_8b / "base" / "config.json").read_bytes())
    plan = _plan(qwen3_8b, f"model.model_name_or_path={config_only}")
    from_config = estimate_resources(plan)
    from_headers = estimate_resources(_plan(qwen3_8b))
    assert from_config.target_source == "config.json"
    assert from_headers.target_source == "safetensors"
    assert from_config.memory == from_headers.memory


def test_compile_with_resources_imports_no_torch(qwen3_8b: Path) -> None:
    script = (
        "import sys\n"
        "from dflash_recipes.cli import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'safetensors', 'numpy')\n"
        "         if m in sys.modules]\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    args = ["compile", str(SEED_8B), *_args(qwen3_8b), "--mfu", "0.4", "--device-memory", "141"]
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "resources per rank" in done.stderr
    assert "HEAVY []" in done.stderr


def test_the_estimate_and_the_trainer_autocast_the_same_target_dtypes() -> None:
    torch = pytest.importorskip("torch")
    del torch
    from dflash_recipes.executor.training.setup import precision
    from dflash_recipes.plan.resources import estimate as resources

    assert resources.AUTOCAST_DTYPES is precision.AUTOCAST_DTYPES == ("bfloat16", "float16")
