"""Fuzzing the resource plan's inputs (the target's config.json as the estimate reads it): only a
ResourceError comes out, and no size beyond its plausible bound is ever used to size anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from testkit.fuzzing import FUZZ, json_values
from testkit.st_fixtures import base_model_config

from dflash_recipes.checkpoint.config_bounds import PLAUSIBLE_MAXIMA
from dflash_recipes.errors import ResourceError
from dflash_recipes.plan.resources.estimate import read_target_dims, target_dims

SIZES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)


@pytest.mark.parametrize("key", SIZES)
def test_a_size_beyond_its_bound_is_refused_before_the_tensor_table_is_made(key: str) -> None:
    bound = PLAUSIBLE_MAXIMA[key]
    for beyond in (bound + 1, 10**19):
        with pytest.raises(ResourceError) as caught:
            target_dims({**base_model_config(), key: beyond}, where="base/config.json")
        assert str(caught.value) == (
            f"base/config.json: {key} must be an integer in [1, {bound}] to estimate resources, "
            f"got {beyond}"
        )


def test_the_layer_count_at_its_bound_is_sized() -> None:
    bound = PLAUSIBLE_MAXIMA["num_hidden_layers"]
    dims = target_dims({**base_model_config(), "num_hidden_layers": bound})
    assert dims.num_hidden_layers == bound
    assert f"model.layers.{bound - 1}.mlp.down_proj.weight" in dims.shapes


@st.composite
def configs(draw: st.DrawFn) -> dict[str, object]:
    config: dict[str, object] = dict(base_model_config())
    for key in draw(st.lists(st.sampled_from([*SIZES, "text_config", "tie_word_embeddings"]))):
        config[key] = draw(
            st.one_of(
                json_values,
                st.sampled_from([PLAUSIBLE_MAXIMA.get(key, 1), 10**19, -1, 0, "x" * 10_000]),
            )
        )
    return config


@FUZZ
@given(config=configs())
def test_any_config_is_sized_within_bounds_or_refused(config: dict[str, object]) -> None:
    try:
        dims = target_dims(config, where="c")
    except ResourceError as exc:
        event("refused")
        assert len(str(exc)) < 1000
        return
    event("sized")
    for key in SIZES:
        # an unstated head_dim is hidden_size // heads: bounded by hidden_size's bound
        bound = PLAUSIBLE_MAXIMA["hidden_size" if key == "head_dim" else key]
        assert 0 < getattr(dims, key) <= bound


@FUZZ
@given(raw=st.one_of(st.binary(max_size=200), st.sampled_from([b"{" * 50_000, b'{"a": NaN}'])))
def test_any_config_file_is_read_or_a_resource_error(tmp_path: Path, raw: bytes) -> None:
    (tmp_path / "config.json").write_bytes(raw)
    with pytest.raises(ResourceError):
        read_target_dims(tmp_path)


def test_a_config_file_with_a_megabyte_value_is_refused_clipped(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({**base_model_config(), "vocab_size": "v" * 3_000_000}), encoding="utf-8"
    )
    with pytest.raises(ResourceError) as caught:
        read_target_dims(tmp_path)
    assert str(caught.value).endswith("... (2999880 more characters)")
