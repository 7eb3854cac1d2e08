"""Hostile inputs through the CLI: each is one clean error (what, where, the fix), never a
traceback, a hang or output that grows with the input (issue 36).

- a base model's config.json stating an implausible size (10^19 decoder layers);
- a 3 MB string in a config.json field (every echoed value is clipped);
- an output_dir holding a lone surrogate (it cannot name a file);
- a training data line nested 50,000 deep (skipped by line number, like other bad lines).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from testkit.cli_runner import cli
from testkit.st_fixtures import base_model_config, write_json

#: The most a refusal of one bad value may print (the recipe's other findings included).
SMALL_OUTPUT = 8000


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)


def _explicit_recipe(write_recipe: Callable[..., Path], recipe_text: Callable[..., str]) -> Path:
    """A from-scratch recipe with taps and mask stated (nothing is taken from a checkpoint)."""
    text = recipe_text(init=None, arch={"target_layer_ids": [1, 5]}, dflash={})
    return write_recipe(text.replace("dflash:\n", "dflash:\n  dflash_mask_token_id: 250\n"))


# ---------------------------------------------------------------------------------------------
# implausible sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [4097, 10**19])
@pytest.mark.parametrize("with_init", [False, True])
def test_an_implausible_layer_count_is_refused_before_anything_is_sized_by_it(
    base_model: Path,
    drafter: Path,
    train_file: Path,
    write_recipe: Callable[..., Path],
    recipe_text: Callable[..., str],
    layers: int,
    with_init: bool,
) -> None:
    write_json(base_model / "config.json", base_model_config(layers=layers))
    recipe = (
        write_recipe(recipe_text(arch={"target_layer_ids": [1, 5]}))
        if with_init
        else _explicit_recipe(write_recipe, recipe_text)
    )
    result = cli("compile", str(recipe), "-o", "plan.json")
    assert result.exit_code == 1
    assert "error[target-config-field] model.model_name_or_path" in result.stderr
    assert f"`num_hidden_layers` must be an integer in [1, 4096], got {layers}" in result.stderr
    assert "restore `num_hidden_layers` from the model's original config.json" in result.stderr
    assert "GiB" not in result.stderr  # no resource table sized by it
    assert not Path("plan.json").exists()


# ---------------------------------------------------------------------------------------------
# a 3 MB string in a config.json field
# ---------------------------------------------------------------------------------------------

HUGE = "x" * 3_000_000


@pytest.mark.parametrize(
    "field", ["hidden_size", "num_attention_heads", "head_dim", "rope_theta", "layer_types"]
)
def test_a_megabyte_value_in_the_base_config_is_echoed_clipped(
    base_model: Path, drafter: Path, good_recipe: Path, field: str
) -> None:
    write_json(base_model / "config.json", {**base_model_config(), field: HUGE})
    result = cli("compile", str(good_recipe), "-o", "plan.json")
    # hidden_size and rope_theta are needed (errors); the target's heads are only suggestions
    assert f"`{field}` must be" in result.stderr
    assert "more characters)" in result.stderr
    assert len(result.stderr) < SMALL_OUTPUT


@pytest.mark.parametrize("field", ["hidden_size", "block_size", "target_layer_ids", "rope_theta"])
def test_a_megabyte_value_in_the_checkpoint_config_is_echoed_clipped(
    base_model: Path, drafter: Path, good_recipe: Path, field: str
) -> None:
    config = json.loads((drafter / "config.json").read_text())
    write_json(drafter / "config.json", {**config, field: HUGE})
    for command in (["compile", str(good_recipe), "-o", "plan.json"], ["compile", "--format",
                    "json", str(good_recipe)]):  # fmt: skip
        result = cli(*command)
        shown = result.stderr + result.stdout
        assert HUGE[:5000] not in shown
        assert "more characters" in shown
        assert len(result.stderr) < SMALL_OUTPUT


def test_the_json_format_clips_the_echoed_value_too(
    base_model: Path, drafter: Path, good_recipe: Path
) -> None:
    write_json(base_model / "config.json", {**base_model_config(), "hidden_size": HUGE})
    result = cli("compile", "--format", "json", str(good_recipe))
    assert result.exit_code == 1
    assert len(result.stdout) < SMALL_OUTPUT
    messages = [d["message"] for d in json.loads(result.stdout)["diagnostics"]]
    assert any("`hidden_size` must be" in m and "more characters)" in m for m in messages)


# ---------------------------------------------------------------------------------------------
# a lone surrogate in a path
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["compile", "run", "lint"])
def test_an_output_dir_with_a_lone_surrogate_is_a_located_error(
    base_model: Path,
    drafter: Path,
    train_file: Path,
    write_recipe: Callable[..., Path],
    recipe_text: Callable[..., str],
    command: str,
) -> None:
    text = recipe_text() + 'training:\n  output_dir: "runs/\\ud800x"\n'
    recipe = write_recipe(text)
    line = text.splitlines().index('  output_dir: "runs/\\ud800x"') + 1
    result = cli(command, str(recipe))
    assert result.exit_code == 1
    shown = result.output  # lint reports on stdout, compile and run on stderr
    assert f"recipe.yaml:{line}:3: error[invalid-value] training.output_dir: output_dir cannot " \
        "name a file: it holds a lone surrogate, which no file name can hold; got 'runs/\\ud800x'" \
        in shown  # fmt: skip
    assert "Traceback" not in shown
    assert not (Path("runs")).exists()


def test_a_lone_surrogate_in_an_override_path_is_refused_the_same_way(good_recipe: Path) -> None:
    result = cli("compile", str(good_recipe), 'data.cache_dir="c/\\udfff"')
    assert result.exit_code == 1
    assert "<override 1>: error[" in result.stderr
    assert "data.cache_dir" in result.stderr
    assert "cannot name a file" in result.stderr


# ---------------------------------------------------------------------------------------------
# deep JSON in the training data
# ---------------------------------------------------------------------------------------------


def test_a_50000_deep_data_line_does_not_stop_compile(
    base_model: Path, drafter: Path, good_recipe: Path, train_file: Path
) -> None:
    good = train_file.read_text(encoding="utf-8").strip()
    deep = '{"messages": ' + "[" * 50_000 + "]" * 50_000 + "}"
    train_file.write_text("\n".join([deep, "[" * 50_000, good]) + "\n", encoding="utf-8")
    result = cli("compile", str(good_recipe), "-o", "plan.json")
    assert result.exit_code == 0, result.stderr[-2000:]
    assert Path("plan.json").is_file()
