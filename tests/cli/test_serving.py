"""`dflash-recipe serve-target`: the `vllm serve` line a plan needs, checked field by field
against the protocol vLLM implements (docs/dflash.md, "A target served by vLLM")."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result
from testkit.cli_runner import cli

from dflash_recipes.cli import EXIT_FINDINGS, EXIT_USAGE

#: The tiny target's config (tests/testkit/st_fixtures): 8 decoder layers; the tiny drafter's taps.
LAYERS = 8
TAPS = (1, 5)


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def served_recipe(
    tmp_path: Path,
    base_model: Path,
    drafter: Path,
    train_file: Path,
    recipe_text: Callable[..., str],
    write_recipe: Callable[..., Path],
) -> Callable[..., Path]:
    """Write the tiny recipe with a target_server section (`extra` YAML lines appended)."""
    (tmp_path / "hs").mkdir()

    def write(*, dflash: dict[str, object] | None = None, extra: str = "") -> Path:
        text = recipe_text(dflash=dflash) + (
            "training:\n"
            "  training_seq_len: 256\n"
            "target_server:\n"
            "  urls: [http://gpu0:8123, http://gpu1:8000]\n"
            "  storage_dir: hs\n" + extra
        )
        return write_recipe(text)

    return write


def parse(result: Result) -> tuple[list[str], dict[str, str]]:
    """stdout as exactly one shell line: the argv, and its --options' values."""
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    argv = shlex.split(lines[0])
    assert argv[:2] == ["vllm", "serve"]
    options = argv[3:]
    assert all(name.startswith("--") for name in options[::2]), argv
    return argv, dict(zip(options[::2], options[1::2], strict=True))


def test_the_printed_command_serves_what_the_plan_needs(
    tmp_path: Path, base_model: Path, served_recipe: Callable[..., Path]
) -> None:
    argv, options = parse(cli("serve-target", str(served_recipe())))
    assert argv[2] == str(base_model)  # the target's path, positional
    assert options["--served-model-name"] == "base"
    assert options["--dtype"] == "bfloat16"  # the plan's, never auto
    assert options["--max-model-len"] == "257"  # training_seq_len + the generated token
    assert options["--port"] == "8123"  # target_server.urls[0]'s
    assert "--tensor-parallel-size" not in options
    speculative = json.loads(options["--speculative_config"])
    assert speculative["method"] == "extract_hidden_states"
    assert speculative["num_speculative_tokens"] == 1
    ids = speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [tap + 1 for tap in TAPS] == [2, 6]  # a tap t is vLLM's id t + 1
    kv = json.loads(options["--kv_transfer_config"])
    assert kv["kv_connector"] == "ExampleHiddenStatesConnector"
    assert kv["kv_role"] == "kv_producer"
    assert kv["kv_connector_extra_config"] == {
        "shared_storage_path": str(tmp_path / "hs"),
        "use_synchronization_lock": True,
    }


def test_a_teacher_objective_serves_the_last_layer_and_float32_stays_float32(
    served_recipe: Callable[..., Path],
) -> None:
    path = served_recipe(dflash={"dflash_self_logit_distillation": True})
    text = path.read_text().replace(
        "  model_name_or_path: base\n", "  model_name_or_path: base\n  dtype: float32\n"
    )
    path.write_text(text)
    _argv, options = parse(
        cli("serve-target", str(path), "--port", "9000", "--tensor-parallel-size", "2")
    )
    speculative = json.loads(options["--speculative_config"])
    ids = speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [2, 6, LAYERS]  # ascending, with num_hidden_layers (before the final norm)
    assert options["--dtype"] == "float32"
    assert (options["--port"], options["--tensor-parallel-size"]) == ("9000", "2")


def test_a_compiled_plan_prints_the_same_command_as_its_recipe(
    tmp_path: Path, served_recipe: Callable[..., Path]
) -> None:
    recipe = served_recipe()
    assert cli("compile", str(recipe), "-o", "plan.json").exit_code == 0
    from_plan = cli("serve-target", "plan.json")
    assert parse(from_plan) == parse(cli("serve-target", str(recipe)))
    refused = cli("serve-target", "plan.json", "training.training_seq_len=64")
    assert refused.exit_code == EXIT_USAGE
    assert "overrides apply to recipes" in refused.stderr


def test_overrides_reach_the_section(served_recipe: Callable[..., Path], tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    args = ("target_server.storage_dir=shm", "target_server.served_model_name=Qwen/Qwen3-8B")
    _argv, options = parse(cli("serve-target", str(served_recipe()), *args))
    assert options["--served-model-name"] == "Qwen/Qwen3-8B"
    kv = json.loads(options["--kv_transfer_config"])
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path / "shm")


def test_a_recipe_without_the_section_is_a_usage_error_that_says_to_add_it(
    good_recipe: Path,
) -> None:
    result = cli("serve-target", str(good_recipe))
    assert result.exit_code == EXIT_USAGE
    assert result.stdout == ""
    assert "has no target_server section" in result.stderr
    assert "target_server:\n  urls: [http://localhost:8000]" in result.stderr


def test_a_recipe_with_errors_prints_no_command(served_recipe: Callable[..., Path]) -> None:
    result = cli("serve-target", str(served_recipe()), "target_server.storage_dir=absent")
    assert result.exit_code == EXIT_FINDINGS
    assert result.stdout == ""
    assert "target-server-storage-missing" in result.stderr


def test_exec_without_vllm_on_path_says_so(
    served_recipe: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    result = cli("serve-target", str(served_recipe()), "--exec")
    assert result.exit_code == EXIT_FINDINGS
    assert "`vllm` is not on PATH" in result.stderr and "vllm>=0.24" in result.stderr


def test_exec_becomes_the_printed_command_with_the_key_in_the_environment(
    served_recipe: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "vllm"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("DFLASH_TEST_SERVER_KEY", "s3cret")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    calls: list[tuple[str, list[str], str | None]] = []

    def execvp(file: str, args: list[str]) -> None:
        import os

        calls.append((file, list(args), os.environ.get("VLLM_API_KEY")))

    monkeypatch.setattr("os.execvp", execvp)
    recipe = served_recipe(extra="  api_key_env: DFLASH_TEST_SERVER_KEY\n")
    printed, _ = parse(cli("serve-target", str(recipe)))
    assert "s3cret" not in " ".join(printed)  # the key is never on the command line
    result = cli("serve-target", str(recipe), "--exec")
    assert result.exit_code == 0, result.output
    assert calls == [("vllm", printed, "s3cret")]
    assert result.stdout == ""


def test_help_shows_an_example() -> None:
    result = cli("serve-target", "--help")
    assert result.exit_code == 0
    assert "dflash-recipe serve-target recipe.yaml --tensor-parallel-size 4" in result.stdout
    assert "vLLM 0.24" in result.stdout


_NO_TORCH = """
import sys
from dflash_recipes.cli import main
try:
    main(["serve-target", sys.argv[1]], standalone_mode=False)
finally:
    heavy = sorted(m for m in ("torch", "transformers", "safetensors") if m in sys.modules)
    print("heavy:", heavy, file=sys.stderr)
"""


def test_serve_target_imports_no_torch(served_recipe: Callable[..., Path], tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, str(served_recipe())],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=True,
    )
    assert done.stdout.startswith("vllm serve ")
    assert "heavy: []" in done.stderr
