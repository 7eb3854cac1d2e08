"""`render_init_recipe`: a commented recipe that compiles cleanly, read from the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from testkit.released_layouts import (
    write_assistant_checkpoint,
    write_dflash2_checkpoint,
    write_target,
)
from testkit.st_fixtures import (
    drafter_config,
    drafter_tensors,
    write_base_model,
    write_drafter_checkpoint,
    write_json,
    write_safetensors,
)

from dflash_recipes.compiler.compilation import CompileResult, compile_file
from dflash_recipes.diagnostics import Severity
from dflash_recipes.errors import CheckpointError, DFlashRecipeError
from dflash_recipes.recipe.starter import render_init_recipe


def write_and_compile(tmp_path: Path, text: str) -> CompileResult:
    path = tmp_path / "recipes" / "finetune.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return compile_file(path)


def assert_clean(result: CompileResult) -> None:
    assert result.ok, result.diagnostics
    problems = [d for d in result.diagnostics if d.severity is not Severity.INFO]
    assert [d.code for d in problems] == ["data-path-unset"]  # data is the user's to add


def tokenizer_like_qwen3(directory: Path) -> None:
    """Token ids 0..151668 (151643 regular + 26 added), like Qwen3's tokenizer, no mask."""
    write_json(
        directory / "tokenizer.json",
        {"model": {"type": "BPE", "vocab": {"!": 0, "zz": 151642}}, "added_tokens": []},
    )
    decoder = {
        str(i): {"content": f"<|special_{i}|>", "special": True} for i in range(151643, 151669)
    }
    write_json(directory / "tokenizer_config.json", {"added_tokens_decoder": decoder})


def test_from_a_checkpoint_everything_is_the_checkpoints(tmp_path: Path, base_model: Path) -> None:
    ckpt = write_drafter_checkpoint(
        tmp_path / "drafter",
        layers=3,
        intermediate=48,
        n_taps=3,
        config=drafter_config(
            layers=3, intermediate=48, target_layer_ids=[0, 3, 6], mask_token_id=201, block_size=10
        ),
    )
    text = render_init_recipe(base_model, ckpt)
    result = write_and_compile(tmp_path, text)
    assert_clean(result)
    plan = result.plan
    assert plan is not None
    assert plan.draft.architecture.num_hidden_layers == 3
    assert plan.draft.architecture.intermediate_size == 48
    assert plan.draft.target_layer_ids == (0, 3, 6)
    assert plan.draft.mask_token_id == 201
    assert plan.draft.block_size == 10
    assert plan.draft.objective.loss_decay_factor == 5.0
    assert plan.training.learning_rate == 1.0e-4
    assert plan.init_checkpoint is not None and plan.init_checkpoint.path == str(ckpt)
    assert plan.data.packing is True  # new recipes pack; a recipe without the line does not


def test_header_shows_the_commands_and_comments_explain_the_choices(
    tmp_path: Path, base_model: Path, drafter: Path
) -> None:
    text = render_init_recipe(base_model, drafter, recipe_path="finetune.yaml")
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert "#   dflash-recipe compile finetune.yaml -o plan.json" in header
    assert "#   dflash-recipe run finetune.yaml" in header
    assert "never fills them from the base model" in text
    assert "intermediate_size: 64  # the checkpoint's config.json says" in text
    assert "dflash_mask_token_id: 250  # the checkpoint's mask id" in text
    # the YAML is plain data with the values the comments talk about
    data = yaml.safe_load(text)
    assert data["dflash"]["dflash_init_checkpoint"] == str(drafter)
    assert data["dflash"]["dflash_architecture_config"]["target_layer_ids"] == [1, 5]


def test_dims_are_read_from_the_header_when_config_lacks_them(
    tmp_path: Path, base_model: Path
) -> None:
    config = drafter_config()
    for key in ("intermediate_size", "head_dim", "num_key_value_heads"):
        del config[key]
    ckpt = write_drafter_checkpoint(tmp_path / "drafter", config=config)
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text("{}\n", encoding="utf-8")
    text = render_init_recipe(base_model, ckpt, data_path=str(data))
    assert "intermediate_size: 64  # the checkpoint's tensor shapes show" in text
    result = write_and_compile(tmp_path, text)
    assert result.ok and not [d for d in result.diagnostics if d.severity is not Severity.INFO]


def test_domino_checkpoint_gives_a_domino_recipe(tmp_path: Path, base_model: Path) -> None:
    ckpt = write_drafter_checkpoint(
        tmp_path / "drafter", projector_type="domino", emb_dim=16, gru_hidden_dim=8
    )
    result = write_and_compile(tmp_path, render_init_recipe(base_model, ckpt))
    assert_clean(result)
    assert result.plan is not None
    arch = result.plan.draft.architecture
    assert (arch.projector_type, arch.emb_dim, arch.gru_hidden_dim) == ("domino", 16, 8)
    assert result.plan.init_checkpoint is not None
    assert result.plan.init_checkpoint.heads_from_scratch == ()


def test_the_released_dflash2_drafter_gives_a_dflash2_recipe_that_compiles(
    tmp_path: Path,
) -> None:
    # its DFlash 2 fields are left to compile, which takes them from the checkpoint
    target = write_target(tmp_path / "target")
    ckpt = write_dflash2_checkpoint(tmp_path / "dflash2")
    text = render_init_recipe(target, ckpt)
    assert 'projector_type: "dflash2"' in text and "selector_top_k" not in text
    result = write_and_compile(tmp_path, text)
    assert [d.code for d in result.errors] == []
    said = [d.code for d in result.diagnostics if d.severity is Severity.WARNING]
    assert said == ["data-path-unset"]
    assert sum(d.code == "kind-field-from-checkpoint" for d in result.diagnostics) == 6


def test_the_museglimmer_assistant_layout_gives_a_recipe_that_compiles(tmp_path: Path) -> None:
    # z-lab/dflash's verbatim assistant fixture rebuilt sparse: its fusion tensors under
    # `encoder.` are read under the z-lab names, as compile and the warm start read them
    target = write_target(tmp_path / "target")
    ckpt = write_assistant_checkpoint(tmp_path / "assistant")
    text = render_init_recipe(target, ckpt)
    assert "num_hidden_layers: 5" in text and "intermediate_size: 19968" in text
    result = write_and_compile(tmp_path, text)
    assert_clean(result)
    assert result.plan is not None
    assert result.plan.draft.target_layer_ids == (1, 13, 25, 37, 49)
    assert result.plan.draft.architecture.rms_norm_eps == 1e-05


def test_a_dspark_head_under_markov_head_gives_a_dspark_recipe(
    tmp_path: Path, base_model: Path
) -> None:
    tensors = drafter_tensors(projector_type="dspark", markov_rank=4, use_confidence_head=True)
    head = ("markov_w1.", "markov_w2.", "confidence_proj.")
    stored = {f"markov_head.{n}" if n.startswith(head) else n: v for n, v in tensors.items()}
    write_safetensors(tmp_path / "drafter" / "model.safetensors", stored)
    write_json(tmp_path / "drafter" / "config.json", drafter_config())  # states no head
    result = write_and_compile(tmp_path, render_init_recipe(base_model, tmp_path / "drafter"))
    assert_clean(result)
    assert result.plan is not None
    arch = result.plan.draft.architecture
    assert (arch.projector_type, arch.markov_rank, arch.use_confidence_head) == ("dspark", 4, True)
    assert result.plan.init_checkpoint is not None
    assert result.plan.init_checkpoint.heads_from_scratch == ()


def test_checkpoint_without_taps_is_refused_not_guessed(tmp_path: Path, base_model: Path) -> None:
    ckpt = write_drafter_checkpoint(tmp_path / "drafter", n_taps=3, write_config=False)
    with pytest.raises(CheckpointError, match="target_layer_ids") as caught:
        render_init_recipe(base_model, ckpt)
    assert "fc.weight takes 3 taps" in str(caught.value)


def test_checkpoint_for_another_width_is_refused(tmp_path: Path, base_model: Path) -> None:
    ckpt = write_drafter_checkpoint(tmp_path / "drafter", hidden=48)
    with pytest.raises(CheckpointError, match="48 wide"):
        render_init_recipe(base_model, ckpt)


def test_hub_id_checkpoint_is_refused_with_the_staging_command(base_model: Path) -> None:
    with pytest.raises(DFlashRecipeError, match="hf download z-lab/Qwen3-8B-DFlash-b16"):
        render_init_recipe(base_model, Path("z-lab/Qwen3-8B-DFlash-b16"))


def test_from_scratch_uses_target_defaults_and_the_first_unused_row(
    tmp_path: Path,
) -> None:
    base = write_base_model(
        tmp_path / "base",
        layers=36,
        hidden=64,
        heads=8,
        kv_heads=2,
        head_dim=8,
        intermediate=96,
        vocab=151936,
    )
    tokenizer_like_qwen3(base)
    text = render_init_recipe(base, None)
    assert "dflash_init_checkpoint" not in text
    assert "dflash_mask_token_id: 151669  # first unused embedding row" in text
    assert "start at the target's values" in text
    result = write_and_compile(tmp_path, text)
    assert_clean(result)
    plan = result.plan
    assert plan is not None and plan.init_checkpoint is None
    arch = plan.draft.architecture
    assert (arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads) == (5, 8, 2)
    assert (arch.head_dim, arch.intermediate_size) == (8, 96)
    assert plan.draft.target_layer_ids == (1, 9, 17, 25, 33)  # the reference's Qwen3-8B taps
    assert plan.draft.mask_token_id == 151669
    assert plan.training.learning_rate == 6.0e-4
    # taps are written out, so compile does not need to apply its default formula
    assert "taps-default" not in {d.code for d in result.diagnostics}


def test_tokenizer_mask_token_is_preferred(tmp_path: Path, base_model: Path) -> None:
    write_json(
        base_model / "tokenizer_config.json",
        {
            "mask_token": "<mask>",
            "added_tokens_decoder": {"7": {"content": "<mask>"}, "9": {"content": "<eos>"}},
        },
    )
    text = render_init_recipe(base_model, None)
    assert "dflash_mask_token_id: 7  # the tokenizer's own mask token" in text
    assert_clean(write_and_compile(tmp_path, text))


def test_from_scratch_without_tokenizer_refuses_to_guess_the_mask(
    tmp_path: Path, base_model: Path
) -> None:
    with pytest.raises(CheckpointError, match="mask") as caught:
        render_init_recipe(base_model, None)
    assert "151669" in str(caught.value)
    text = render_init_recipe(base_model, None, mask_token_id=255)
    assert_clean(write_and_compile(tmp_path, text))


DEMO_TARGET = Path(__file__).resolve().parents[2] / "dflash_recipes" / "demo_data" / "target"


def test_init_on_the_demo_target_writes_a_recipe_that_compiles_without_a_warning(
    tmp_path: Path,
) -> None:
    # the package's own target: transformers 5 wrote its tokenizer_config.json without
    # added_tokens_decoder, and with model_max_length 1048576, which is not a token id
    config = json.loads((DEMO_TARGET / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "added_tokens_decoder" not in config and config["model_max_length"] == 1048576
    text = render_init_recipe(DEMO_TARGET, None)
    # every one of its 392 rows is a token (ids 0..391): the mask is its first spare token
    assert (
        "dflash_mask_token_id: 384  # <|spare_0|>: a reserved special token the chat template "
        "never writes (every embedding row is a token; no mask token)"
    ) in text
    # its max_position_embeddings is 512: no longer rows than that
    assert (
        "training_seq_len: 512  # the target's max_position_embeddings (no longer sequences "
        "than it was built for)"
    ) in text
    result = write_and_compile(tmp_path, text)
    assert_clean(result)
    assert result.plan is not None
    assert result.plan.training.training_seq_len == 512


def test_only_token_ids_count_toward_the_first_unused_row(tmp_path: Path) -> None:
    base = write_base_model(tmp_path / "base", vocab=256)
    write_json(
        base / "tokenizer.json",
        {
            "model": {"type": "BPE", "vocab": {"a": 0, "b": 199}},
            "added_tokens": [{"id": 200, "content": "<|end|>", "special": True}],
        },
    )
    # numbers that are not token ids: a length, a config's own sizes
    write_json(
        base / "tokenizer_config.json",
        {"model_max_length": 131072, "eos_token": "<|end|>", "extra": {"n": 4096}},
    )
    text = render_init_recipe(base, None)
    assert "dflash_mask_token_id: 201  # first unused embedding row (token ids end at 200" in text
    assert_clean(write_and_compile(tmp_path, text))


def test_a_full_vocabulary_takes_the_first_reserved_token_the_template_never_writes(
    tmp_path: Path,
) -> None:
    base = write_base_model(tmp_path / "base", vocab=256)
    names = {250: "<|eot_id|>", 251: "<|reserved_special_token_0|>", 252: "<|reserved_1|>"}
    write_json(
        base / "tokenizer.json",
        {
            "model": {"type": "BPE", "vocab": {"a": 0, "z": 249}},
            "added_tokens": [
                {"id": i, "content": names.get(i, f"<|reserved_{i}|>"), "special": True}
                for i in range(250, 256)
            ],
        },
    )
    # the template writes reserved_special_token_0 (so it is text), and eos is reserved_1
    write_json(
        base / "tokenizer_config.json",
        {"eos_token": "<|reserved_1|>", "chat_template": "{{ '<|reserved_special_token_0|>' }}"},
    )
    text = render_init_recipe(base, None)
    assert "dflash_mask_token_id: 253  # <|reserved_253|>: a reserved special token" in text
    assert_clean(write_and_compile(tmp_path, text))
    (base / "tokenizer_config.json").unlink()
    write_json(
        base / "tokenizer.json",
        {"model": {"type": "BPE", "vocab": {"a": 0, "z": 255}}, "added_tokens": []},
    )
    with pytest.raises(CheckpointError) as caught:
        render_init_recipe(base, None)
    assert str(caught.value) == (
        "the tokenizer uses every embedding row (ids up to 255, vocab_size 256) and declares no "
        "mask token and no reserved special token\nfix: pass a mask id explicitly, e.g. a "
        "special token of this tokenizer that no text holds"
    )


def test_training_seq_len_stays_within_the_target_and_the_checkpoint(tmp_path: Path) -> None:
    base = write_base_model(tmp_path / "base", max_position_embeddings=2048)
    text = render_init_recipe(base, None, mask_token_id=255)
    assert "training_seq_len: 2048  # the target's max_position_embeddings" in text
    assert_clean(write_and_compile(tmp_path, text))
    roomy = write_base_model(tmp_path / "roomy", max_position_embeddings=32768)
    assert "  training_seq_len: 4096\n" in render_init_recipe(roomy, None, mask_token_id=255)
    # a drafter built for 512 positions: compile would warn checkpoint-positions-short at 4096
    ckpt = write_drafter_checkpoint(
        tmp_path / "drafter", config=drafter_config(max_position_embeddings=512)
    )
    text = render_init_recipe(roomy, ckpt)
    assert "training_seq_len: 512  # the init checkpoint's max_position_embeddings" in text
    result = write_and_compile(tmp_path, text)
    assert_clean(result)
    assert result.plan is not None and result.plan.training.training_seq_len == 512


def test_shallow_target_gets_fewer_draft_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = write_base_model(tmp_path / "base", layers=4)
    monkeypatch.chdir(tmp_path)  # paths given to init are relative to the shell's folder
    text = render_init_recipe(base, None, mask_token_id=255, output_dir="runs/a")
    result = write_and_compile(tmp_path, text)
    assert_clean(result)
    assert result.plan is not None
    assert result.plan.draft.architecture.num_hidden_layers == 1
    assert result.plan.draft.target_layer_ids == (2,)
    assert result.plan.training.output_dir == str(tmp_path / "runs" / "a")


def test_missing_base_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        render_init_recipe(tmp_path / "nope", None)
