"""Every recipe under `recipes/` lints, validates against the JSON Schema and documents its
command; the model recipes compile fully against configs and sparse checkpoints of their size."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner
from testkit.fixture_8b import make_fixture
from testkit.released_layouts import write_dflash2_checkpoint, write_target
from testkit.st_fixtures import (
    QWEN3_MASK_TOKEN_ID,
    base_model_config,
    drafter_config,
    write_drafter_checkpoint,
    write_json,
)

from dflash_recipes.cli import main
from dflash_recipes.compiler.compilation import CompileResult, compile_file, compile_recipe
from dflash_recipes.diagnostics import Severity
from dflash_recipes.recipe.json_schema import recipe_json_schema
from dflash_recipes.recipe.loader import load_recipe_with_diagnostics
from dflash_recipes.recipe.yamlio import load_yaml

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
RECIPE_FILES = sorted(p for p in RECIPES.rglob("*") if p.suffix in (".yaml", ".yml"))
RECIPE_IDS = [p.relative_to(ROOT).as_posix() for p in RECIPE_FILES]

QWEN3_8B = "recipes/Qwen/Qwen3-8B"
FINETUNE_8B = ROOT / QWEN3_8B / "hf_online_dflash_finetune.yaml"
QWEN3_8B_TAPS = (1, 9, 17, 25, 33)


def test_the_documented_example_recipes_exist() -> None:
    for name in (
        f"{QWEN3_8B}/hf_online_dflash_finetune.yaml",
        f"{QWEN3_8B}/hf_online_dflash.yaml",
        f"{QWEN3_8B}/hf_online_domino_warmstart.yaml",
        f"{QWEN3_8B}/hf_online_dspark_warmstart.yaml",
        "recipes/Qwen/Qwen3-4B/hf_online_dflash_finetune.yaml",
        "recipes/meta-llama/Llama-3.1-8B-Instruct/hf_online_dflash_b10.yaml",
        "recipes/meta-models/Muse-Glimmer-30B/hf_online_dflash2_finetune.yaml",
    ):
        assert name in RECIPE_IDS


@pytest.mark.parametrize("path", RECIPE_FILES, ids=RECIPE_IDS)
def test_recipe_lints_clean_at_schema_level(path: Path) -> None:
    loaded = load_recipe_with_diagnostics(path)
    assert loaded.recipe is not None, [d.message for d in loaded.diagnostics]
    result = compile_recipe(
        loaded.recipe, source=loaded.source, recipe_file=loaded.file, resolve=False
    )
    errors = [d for d in (*loaded.diagnostics, *result.diagnostics) if d.severity is Severity.ERROR]
    assert errors == []
    assert result.plan is not None


@pytest.mark.parametrize("path", RECIPE_FILES, ids=RECIPE_IDS)
def test_recipe_validates_against_the_json_schema(path: Path) -> None:
    data, _ = load_yaml(path.read_text(encoding="utf-8"), filename=str(path))
    validator = jsonschema.Draft202012Validator(recipe_json_schema())
    assert [error.message for error in validator.iter_errors(data)] == []


def _header(path: Path) -> list[str]:
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


@pytest.mark.parametrize("path", RECIPE_FILES, ids=RECIPE_IDS)
def test_recipe_header_shows_a_command_naming_the_file(path: Path) -> None:
    own = re.escape(path.relative_to(ROOT).as_posix())
    command = re.compile(rf"^#\s+dflash-recipe (compile|lint|run) {own}(\s|$)")
    assert any(command.match(line) for line in _header(path)), _header(path)


def test_lint_of_the_recipes_folder_passes_as_ci_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    result = CliRunner().invoke(main, ["lint", "recipes/"])
    assert result.exit_code == 0, result.output
    assert f"linted {len(RECIPE_FILES)} recipe file(s): 0 errors," in result.output


# ---------------------------------------------------------------------------------------------
# full compiles against configs and sparse checkpoints of the recipes' real sizes
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """testkit.fixture_8b's output: Qwen3-8B config, sparse 2.1 GB drafter, data."""
    out = tmp_path_factory.mktemp("qwen3_8b")
    make_fixture(out)
    return out


def _compile_with(recipe: Path, fixture: Path, **paths: Path) -> CompileResult:
    overrides = {
        "model.model_name_or_path": fixture / "base",
        "data.data_path": fixture / "data" / "train.jsonl",
        "training.output_dir": fixture / "runs" / recipe.stem,
    }
    overrides.update({key.replace("__", "."): value for key, value in paths.items()})
    return compile_file(recipe, overrides=[f'{k}="{v}"' for k, v in overrides.items()])


def _codes(result: CompileResult, severity: Severity) -> list[str]:
    return [d.code for d in result.diagnostics if d.severity is severity]


def test_8b_finetune_recipe_compiles_against_the_8b_scale_fixture(qwen3_8b: Path) -> None:
    drafter = qwen3_8b / "drafter"
    result = _compile_with(FINETUNE_8B, qwen3_8b, dflash__dflash_init_checkpoint=drafter)
    assert result.errors == ()
    assert _codes(result, Severity.WARNING) == []  # a clean warm start: nothing degraded
    plan = result.plan
    assert plan is not None and plan.resolved
    assert plan.init_checkpoint is not None
    assert plan.init_checkpoint.path == str(drafter)
    assert plan.init_checkpoint.tensor_count == 58
    assert plan.init_checkpoint.dtypes == ("BF16",)
    assert plan.init_checkpoint.heads_from_scratch == ()
    assert plan.draft.target_layer_ids == QWEN3_8B_TAPS
    assert plan.draft.mask_token_id == QWEN3_MASK_TOKEN_ID == 151669
    assert plan.draft.block_size == 16
    assert plan.training.learning_rate == 1e-4
    assert plan.base_model.facts is not None
    assert plan.base_model.facts.rope.rope_theta == 1_000_000.0


@pytest.mark.parametrize(
    ("name", "heads"),
    [
        ("hf_online_domino_warmstart.yaml", ("prefix_gru", "embed_proj")),
        ("hf_online_dspark_warmstart.yaml", ("markov_w1", "markov_w2", "confidence_proj")),
    ],
)
def test_head_variant_recipes_warm_start_the_backbone_and_train_heads_from_scratch(
    qwen3_8b: Path, name: str, heads: Sequence[str]
) -> None:
    result = _compile_with(
        ROOT / QWEN3_8B / name, qwen3_8b, dflash__dflash_init_checkpoint=qwen3_8b / "drafter"
    )
    assert result.errors == ()
    assert _codes(result, Severity.WARNING) == ["heads-from-scratch"]
    (warning,) = [d for d in result.diagnostics if d.severity is Severity.WARNING]
    assert all(head in warning.message for head in heads)
    plan = result.plan
    assert plan is not None and plan.init_checkpoint is not None
    assert set(plan.init_checkpoint.heads_from_scratch) == set(heads)
    assert plan.draft.target_layer_ids == QWEN3_8B_TAPS


def test_8b_from_scratch_recipe_compiles_against_the_qwen3_8b_config(qwen3_8b: Path) -> None:
    result = _compile_with(ROOT / QWEN3_8B / "hf_online_dflash.yaml", qwen3_8b)
    assert result.errors == ()
    assert _codes(result, Severity.WARNING) == []
    plan = result.plan
    assert plan is not None
    assert plan.init_checkpoint is None
    assert plan.draft.target_layer_ids == QWEN3_8B_TAPS
    assert plan.draft.mask_token_id == 151669
    assert plan.training.learning_rate == 6e-4
    assert plan.training.num_train_epochs == 6


def test_qwen3_4b_finetune_recipe_compiles_against_a_4b_scale_drafter(tmp_path: Path) -> None:
    write_json(
        tmp_path / "base" / "config.json",
        base_model_config(
            hidden=2560, layers=36, vocab=151936, heads=32, kv_heads=8, head_dim=128,
            intermediate=9728, max_position_embeddings=40960,
        ),
    )  # fmt: skip
    dims = {"hidden": 2560, "layers": 5, "heads": 32, "kv_heads": 8, "head_dim": 128}
    write_drafter_checkpoint(
        tmp_path / "drafter",
        **dims, intermediate=9728, n_taps=5, vocab=151936, num_target_layers=36, fill="sparse",
        config=drafter_config(
            **dims, intermediate=9728, vocab=151936, num_target_layers=36,
            mask_token_id=QWEN3_MASK_TOKEN_ID,
        ),
    )  # fmt: skip
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n", encoding="utf-8")
    result = _compile_with(
        RECIPES / "Qwen" / "Qwen3-4B" / "hf_online_dflash_finetune.yaml",
        tmp_path,
        dflash__dflash_init_checkpoint=tmp_path / "drafter",
    )
    assert result.errors == ()
    assert _codes(result, Severity.WARNING) == []
    assert _codes(result, Severity.INFO) == ["rms-norm-eps-from-checkpoint", "taps-from-checkpoint"]
    plan = result.plan
    assert plan is not None and plan.init_checkpoint is not None
    assert plan.init_checkpoint.tensor_count == 58
    assert plan.draft.target_layer_ids == QWEN3_8B_TAPS  # taps: null -> the checkpoint's


LLAMA_31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_llama_block_10_recipe_compiles_against_the_llama_31_config(tmp_path: Path) -> None:
    write_json(tmp_path / "base" / "config.json", LLAMA_31_8B_CONFIG)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n", encoding="utf-8")
    recipe = RECIPES / "meta-llama" / "Llama-3.1-8B-Instruct" / "hf_online_dflash_b10.yaml"
    result = _compile_with(recipe, tmp_path)
    assert result.errors == ()
    assert _codes(result, Severity.WARNING) == []
    plan = result.plan
    assert plan is not None and plan.base_model.facts is not None
    assert plan.draft.block_size == 10
    assert plan.draft.mask_token_id == 128002
    assert plan.draft.target_layer_ids == (1, 8, 15, 22, 29)
    rope = plan.base_model.facts.rope
    assert (rope.rope_type, rope.rope_theta) == ("llama3", 500000.0)
    assert rope.rope_scaling is not None and rope.rope_scaling["factor"] == 8.0


# -- the demo's tiny recipes compile fully (config.json + header), not only at schema level --

TINY = ROOT / "recipes" / "tiny"


@pytest.mark.parametrize("name", ["tiny_released.yaml", "tiny_scratch.yaml"])
def test_tiny_recipes_compile_fully(name: str, tmp_path: Path) -> None:
    result = compile_file(TINY / name, overrides=(f"training.output_dir={tmp_path / 'run'}",))
    assert result.plan is not None, [d.message for d in result.diagnostics]
    assert result.plan.resolved
    assert not [d for d in result.diagnostics if d.severity is not Severity.INFO]
    assert result.plan.draft.target_layer_ids == (1, 3)
    assert result.plan.draft.mask_token_id == 384


def test_tiny_finetune_compiles_against_a_stage_one_export(tmp_path: Path) -> None:
    export = write_drafter_checkpoint(
        tmp_path / "released",
        hidden=128,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=32,
        intermediate=256,
        n_taps=2,
        vocab=392,
        num_target_layers=6,
        dtype="F32",
        config={
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 256,
            "rms_norm_eps": 1e-6,
            "vocab_size": 392,
            "num_target_layers": 6,
            "rope_theta": 1000000.0,
            "block_size": 8,
            "dflash_config": {"block_size": 8, "mask_token_id": 384, "target_layer_ids": [1, 3]},
        },
    )
    result = compile_file(
        TINY / "tiny_finetune.yaml",
        overrides=(
            f"training.output_dir={tmp_path / 'run'}",
            f"dflash.dflash_init_checkpoint={export}",
        ),
    )
    assert result.plan is not None, [d.message for d in result.diagnostics]
    codes = {d.code for d in result.diagnostics}
    assert {
        "taps-from-checkpoint",
        "mask-from-checkpoint",
        "checkpoint-block-size-differs",
    } <= codes
    assert not [d for d in result.diagnostics if d.severity is not Severity.INFO]
    assert result.plan.init_checkpoint is not None
    assert result.plan.init_checkpoint.tensor_count == 25
    assert result.plan.draft.block_size == 16


def test_muse_glimmer_dflash2_recipe_warm_starts_the_whole_released_drafter(
    tmp_path: Path,
) -> None:
    """z-lab's verbatim DFlash 2 config and 81-tensor header behind a matching target."""
    target = write_target(tmp_path / "base")
    released = write_dflash2_checkpoint(tmp_path / "released")
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n', encoding="utf-8")
    result = _compile_with(
        ROOT / "recipes/meta-models/Muse-Glimmer-30B/hf_online_dflash2_finetune.yaml",
        tmp_path,
        model__model_name_or_path=target,
        dflash__dflash_init_checkpoint=released,
    )
    assert result.errors == ()
    assert _codes(result, Severity.WARNING) == []
    plan = result.plan
    assert plan is not None and plan.init_checkpoint is not None
    assert plan.init_checkpoint.tensor_count == 81
    assert plan.init_checkpoint.heads_from_scratch == ()
    arch = plan.draft.architecture
    assert (arch.projector_type, arch.conv_kernel_size, arch.selector_top_k) == ("dflash2", 2, 16)
    assert arch.layer_types == ("sliding_attention",) * 5 and arch.sliding_window == 2048
    assert plan.draft.mask_token_id == 201818
    assert plan.draft.target_layer_ids == (1, 13, 25, 37, 49)
