"""Every reader behind a compile-side command returns a clean error, whatever it is pointed at.

FIFOs (never opened, so never a hang), oversized files, over-long names, text that is not
Unicode, odd config values and output directories `run` could not use: each is one clean
message at the CLI (exit 1 for findings, 2 for usage problems), never a traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from testkit.cli_runner import cli
from testkit.st_fixtures import base_model_config, write_base_model

from dflash_recipes.files.jsonio import clip, shorten
from dflash_recipes.plan.run_plan import RunPlan


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


# -- FIFOs and sizes ---------------------------------------------------------------------------


def test_a_fifo_recipe_is_refused_before_it_is_opened(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "recipe.yaml")  # opening it for reading would block forever
    result = cli("compile", "recipe.yaml")
    assert result.exit_code == 2
    assert "error[recipe-not-a-file]" in result.stderr
    assert "it is a FIFO (named pipe), not a regular file" in result.stderr
    lint = cli("lint", "recipe.yaml")
    assert lint.exit_code == 2
    assert "recipe.yaml: it is a FIFO (named pipe), not a regular file" in lint.stderr


def test_a_fifo_config_json_is_refused_before_it_is_opened(
    good_recipe: Path, tmp_path: Path
) -> None:
    config = tmp_path / "drafter" / "config.json"
    config.unlink()
    os.mkfifo(config)
    result = cli("compile", str(good_recipe))
    assert result.exit_code == 1
    assert "not a regular file (a JSON config was expected)" in result.stderr
    init = cli("init", "--base-model", "base", "--init-checkpoint", "drafter")
    assert init.exit_code == 1
    assert "it is a FIFO (named pipe), not a regular file" in init.stderr


def test_a_recipe_over_one_mebibyte_is_refused_unread(tmp_path: Path) -> None:
    (tmp_path / "big.yaml").write_text("# padding\n" * 200_000, encoding="utf-8")  # 2 MB
    result = cli("compile", "big.yaml")
    assert result.exit_code == 2
    assert "error[recipe-too-large]" in result.stderr
    assert "larger than the limit of 1048576 bytes" in result.stderr


def test_shorten_and_clip_bound_echoed_values() -> None:
    assert len(shorten("x" * 5_000_000)) < 200
    assert shorten("x" * 5_000_000).endswith("(4999880 more characters)")
    assert "digits" in shorten(10**5000)
    assert clip("/a/b") == "/a/b"
    assert len(clip("y" * 10_000)) < 400


def test_a_4000_digit_integer_is_a_bounded_diagnostic_with_its_dotted_path(
    tmp_path: Path,
) -> None:
    (tmp_path / "r.yaml").write_text(
        "model:\n  model_name_or_path: base\ntraining:\n  max_steps: " + "9" * 4000 + "\n",
        encoding="utf-8",
    )
    result = cli("lint", "r.yaml")
    assert result.exit_code == 1
    assert "r.yaml:4:3: error[invalid-value] training.max_steps:" in result.stdout
    assert "max_steps must be a positive integer no larger than 1000000000" in result.stdout
    assert len(result.output) < 2000


# -- names and encodings -----------------------------------------------------------------------


def test_an_over_long_path_is_a_usage_error_not_a_traceback(base_model: Path) -> None:
    long = "a" * 300 + ".yaml"
    init = cli("init", "--base-model", "base", "--mask-token-id", "250", "-o", long)
    assert init.exit_code == 2
    assert "File name too long" in init.stderr
    compiled = cli("compile", long)
    assert compiled.exit_code == 2
    assert "error[recipe-unreadable]" in compiled.stderr
    assert "File name too long" in compiled.stderr


def test_a_recipe_name_that_is_not_utf8_compiles_into_a_plan_that_reads_back(
    good_recipe: Path, tmp_path: Path
) -> None:
    odd = os.fsdecode(b"r\xff.yaml")  # the byte 0xff becomes the lone surrogate \udcff
    os.rename(good_recipe, tmp_path / odd)
    result = cli("compile", odd, "-o", "plan.json")
    assert result.exit_code == 0, result.stderr
    text = (tmp_path / "plan.json").read_text(encoding="ascii")
    assert '"recipe_file": "' + str(tmp_path) + '/r\\udcff.yaml"' in text
    plan = RunPlan.from_json(text)
    assert plan.recipe_file == str(tmp_path / odd)
    assert os.fsencode(plan.recipe_file).endswith(b"/r\xff.yaml")


def test_a_lone_surrogate_in_a_config_string_does_not_break_the_fingerprint(
    good_recipe: Path, tmp_path: Path
) -> None:
    config = base_model_config()
    config["model_type"] = "qwen3\ud800"
    (tmp_path / "base" / "config.json").write_text(json.dumps(config), encoding="utf-8")
    result = cli("compile", str(good_recipe), "-o", "plan.json")
    assert result.exit_code == 0, result.stderr
    plan = RunPlan.from_json((tmp_path / "plan.json").read_bytes())
    assert plan.base_model.facts is not None
    assert plan.base_model.facts.model_type == "qwen3\ud800"


# -- odd config and tokenizer values -----------------------------------------------------------


def test_layer_types_holding_non_strings_is_a_diagnostic(good_recipe: Path, tmp_path: Path) -> None:
    config = base_model_config()
    config["layer_types"] = [{"kind": "full"}, 3]
    write_base_model(tmp_path / "base", config=config)
    result = cli("compile", str(good_recipe))
    assert result.exit_code == 1
    assert "error[target-config-field]" in result.stderr
    assert "`layer_types` must be a list of attention kinds" in result.stderr
    assert "got {'kind': 'full'}" in result.stderr


def test_init_ignores_tokenizer_keys_that_are_not_token_ids(base_model: Path) -> None:
    tokenizer_config = {
        "mask_token": {"content": 5},
        "added_tokens_decoder": {"²": {"content": "x"}, "9" * 30: {}, "12": {"content": "y"}},
    }
    (base_model / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config), encoding="utf-8"
    )
    result = cli("init", "--base-model", "base")
    assert result.exit_code == 0, result.stderr
    assert "dflash_mask_token_id: 13  # first unused embedding row" in result.stdout


def test_export_into_the_current_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine", encoding="utf-8")
    for out in (".", "..", str(tmp_path)):
        result = cli("export", "ckpt", out, "--plan", "plan.json")
        assert result.exit_code == 2
        assert f"refusing to export into {out}: " in result.stderr, result.stderr
    assert (tmp_path / "keep.txt").read_text(encoding="utf-8") == "mine"


def test_export_into_a_name_too_long_is_a_clean_usage_error(tmp_path: Path) -> None:
    result = cli("export", "ckpt", "a" * 5000, "--plan", "plan.json")
    assert result.exit_code == 2
    assert "cannot use OUT_DIR aaa" in result.stderr and "File name too long" in result.stderr
    assert "Traceback" not in result.stderr


# -- output_dir --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output_dir", "expected"),
    [
        ('"run\\x00dir"', "contains a NUL byte"),
        ("afile/run", "lies below"),
        ("afile", "exists and is a regular file, not a directory"),
    ],
)
def test_compile_rejects_an_output_dir_run_cannot_use(
    good_recipe: Path, tmp_path: Path, output_dir: str, expected: str
) -> None:
    (tmp_path / "afile").write_text("not a folder", encoding="utf-8")
    text = good_recipe.read_text(encoding="utf-8") + f"training:\n  output_dir: {output_dir}\n"
    good_recipe.write_text(text, encoding="utf-8")
    result = cli("compile", str(good_recipe))
    assert result.exit_code == 1
    assert "error[output-dir-unusable] training.output_dir:" in result.stderr
    assert expected in result.stderr
