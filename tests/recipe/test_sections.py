"""Typed construction of recipes in Python: same rules as YAML, frozen, `attrs.evolve` works."""

from __future__ import annotations

import attrs
import pytest

from dflash_recipes import (
    CardSection,
    DataSection,
    DFlashArchitectureConfig,
    DFlashSection,
    ModelSection,
    Recipe,
    TrainingSection,
)
from dflash_recipes.recipe.sections import default_loss_decay_factor


def make() -> Recipe:
    return Recipe(
        model=ModelSection(model_name_or_path="/models/qwen3-8b"),
        dflash=DFlashSection(
            dflash_block_size=16,
            dflash_mask_token_id=151669,
            dflash_architecture_config=DFlashArchitectureConfig(
                num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128
            ),
        ),
    )


def test_defaults_fill_the_unnamed_sections() -> None:
    recipe = make()
    assert recipe.data == DataSection()
    assert recipe.training == TrainingSection()
    assert recipe.training.learning_rate == 1e-4
    assert recipe.dflash.dflash_num_anchors == 512


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: DFlashSection(dflash_block_size=1),
            r"dflash_block_size must be an integer in \[2, 128\]",
        ),
        (lambda: DFlashArchitectureConfig(head_dim=127), "head_dim must be even"),
        (lambda: DFlashArchitectureConfig(target_layer_ids=()), "non-empty list"),
        (lambda: TrainingSection(warmup_ratio=1.0), r"warmup_ratio must be in \[0, 1\)"),
        (
            lambda: TrainingSection(lr_scheduler_type="cosin"),  # type: ignore[arg-type]
            "must be one of cosine, linear, constant",
        ),
        (
            lambda: TrainingSection(drafter_master_dtype="float16"),  # type: ignore[arg-type]
            "drafter_master_dtype must be one of float32, bfloat16",
        ),
        (lambda: ModelSection(model_name_or_path=""), "non-empty string"),
        (lambda: DFlashSection(dflash_dpace_alpha=0.0), r"\(0, 1\]"),
        (lambda: CardSection(base_model="/models/Qwen3-8B"), "never a local path"),
        (lambda: CardSection(datasets=("ok/name", "data/")), "OWNER/NAME"),
        (lambda: CardSection(license="Apache 2.0"), "license id as the Hub writes it"),
        (lambda: TrainingSection(eval_min_tau=0.0), "eval_min_tau must be a finite number > 0"),
    ],
)
def test_python_construction_runs_the_same_validators(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


def test_evolve_changes_one_field_and_revalidates() -> None:
    recipe = make()
    smaller = attrs.evolve(recipe, dflash=attrs.evolve(recipe.dflash, dflash_block_size=8))
    assert smaller.dflash.dflash_block_size == 8
    assert recipe.dflash.dflash_block_size == 16  # the original is untouched
    with pytest.raises(ValueError, match="dflash_block_size"):
        attrs.evolve(recipe.dflash, dflash_block_size=0)


def test_recipes_are_frozen_and_hashable_by_value() -> None:
    recipe = make()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        recipe.model = ModelSection(model_name_or_path="/other")  # type: ignore[misc]
    assert recipe == make()
    assert hash(recipe) == hash(make())


def test_model_is_required() -> None:
    with pytest.raises(TypeError, match="model"):
        Recipe()  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("block_size", "gamma"),
    [
        (16, 7.0),
        (10, 5.0),
        (8, 4.0),
        (9, 4.5),
        (13, 6.0),
        (12, 5 + 2 / 3),
        (32, 7 + 16 / 3),
        (4, 2.0),
        (2, 1.0),
    ],
)
def test_loss_decay_default_follows_the_paper_points(block_size: int, gamma: float) -> None:
    assert default_loss_decay_factor(block_size) == pytest.approx(gamma)


def test_decay_default_never_drops_below_one() -> None:
    assert all(default_loss_decay_factor(b) >= 1.0 for b in range(2, 129))
