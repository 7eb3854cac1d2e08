"""Shared fixtures: tiny base-model folders, tiny drafter checkpoints and tiny recipes.

Everything is generated into `tmp_path` (no downloads, no torch). The default sizes agree with
`testkit.st_fixtures`: an 8-layer target 32 wide with a 256-token vocabulary, and a 2-layer drafter
(4 heads, 2 kv heads, head_dim 8, intermediate 64) tapping [1, 5] with mask id 250, block 16.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from testkit.compiling import RecipeFactory
from testkit.fuzzing import ACTIVE_PROFILE, PROFILE_ENV
from testkit.st_fixtures import write_base_model, write_drafter_checkpoint

from dflash_recipes.compiler.compilation import compile_recipe
from dflash_recipes.files.data_cache import CACHE_ENV
from dflash_recipes.recipe.sections import (
    DataSection,
    DFlashArchitectureConfig,
    DFlashSection,
    ModelSection,
    Recipe,
    TrainingSection,
)

_SESSION_CACHE = pytest.StashKey[str]()


def pytest_report_header() -> str:
    """Property tests draw the same examples on every run (profile `fixed`, no example
    database) unless DFLASH_HYPOTHESIS_PROFILE=explore says otherwise: a landing, or a
    newcomer's first run, is not decided by a fresh random draw. Importing testkit.fuzzing
    loaded the profile; `.ci/run` explores in a leg of its own."""
    return f"{PROFILE_ENV}: {ACTIVE_PROFILE}"


def pytest_configure(config: pytest.Config) -> None:
    """The tests' own markers are registered, and the tests never write to the real per-user
    cache: the tokenized-data cache of anything that runs outside a test function (module
    fixtures) goes to a folder of this session, and each test gets its own
    (:func:`_own_data_cache`); subprocesses inherit the variable."""
    _register_markers(config)
    folder = tempfile.mkdtemp(prefix="dflash-recipes-cache-")
    config.stash[_SESSION_CACHE] = folder
    os.environ[CACHE_ENV] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_SESSION_CACHE, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _own_data_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Each test's own tokenized-data cache (a fresh one, as its own output_dir gave before)."""
    folder = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder


#: The architecture of the default tiny drafter (testkit.st_fixtures.write_drafter_checkpoint).
TINY_ARCH: Mapping[str, int] = {
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
}
TINY_TAPS = (1, 5)
TINY_MASK = 250


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The `slow` tests first, each group in its collected order (the same in every xdist
    worker): started early, they run beside the many short ones instead of alone at the end,
    where one worker would go on for minutes after the other ran out of tests."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _register_markers(config: pytest.Config) -> None:
    # Registered here, not in pyproject.toml: the tests own their markers.
    config.addinivalue_line(
        "markers",
        "timing: tests whose outcome once depended on the machine being quiet (processes that "
        "race, locks, signals, deadlines, float sums); `.ci/run` runs them under "
        "tools/stress.py",
    )


@pytest.fixture
def base_model(tmp_path: Path) -> Path:
    """`tmp_path/base`: config.json of an 8-layer Qwen3-style target (hidden 32, vocab 256)."""
    return write_base_model(tmp_path / "base")


@pytest.fixture
def drafter(tmp_path: Path) -> Path:
    """`tmp_path/drafter`: an exported 2-layer drafter (model.safetensors + config.json)."""
    return write_drafter_checkpoint(tmp_path / "drafter")


@pytest.fixture
def train_file(tmp_path: Path) -> Path:
    """`tmp_path/train.jsonl` with one conversation."""
    path = tmp_path / "train.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n', encoding="utf-8")
    return path


@pytest.fixture
def make_recipe(base_model: Path, train_file: Path) -> RecipeFactory:
    """Build a Recipe for the tiny target; paths are relative to tmp_path (pass base_dir).

    Keyword arguments: `init` (init checkpoint value or None), `arch` (fields replacing the
    tiny architecture; None values unset them), `dflash`, `data`, `training` (section fields).
    """

    def build(
        *,
        init: str | None = "drafter",
        arch: Mapping[str, Any] | None = None,
        dflash: Mapping[str, Any] | None = None,
        data: Mapping[str, Any] | None = None,
        training: Mapping[str, Any] | None = None,
        model: str = "base",
    ) -> Recipe:
        arch_fields: dict[str, Any] = {**TINY_ARCH, **(arch or {})}
        return Recipe(
            model=ModelSection(model_name_or_path=model),
            data=DataSection(**{"data_path": train_file.name, **(data or {})}),
            training=TrainingSection(**(training or {})),
            dflash=DFlashSection(
                dflash_init_checkpoint=init,
                dflash_architecture_config=DFlashArchitectureConfig(**arch_fields),
                **(dflash or {}),
            ),
        )

    return build


@pytest.fixture
def write_recipe(tmp_path: Path) -> Callable[..., Path]:
    """Write a recipe file into tmp_path: YAML text as given, or a dict dumped as YAML."""

    def write(content: str | Mapping[str, Any], name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        text = content if isinstance(content, str) else yaml.safe_dump(dict(content))
        path.write_text(text, encoding="utf-8")
        return path

    return write


@pytest.fixture
def recipe_text() -> Callable[..., str]:
    """Render a tiny recipe as YAML text (see :func:`_recipe_yaml`)."""
    return _recipe_yaml


def _recipe_yaml(
    *,
    init: str | None = "drafter",
    arch: Mapping[str, Any] | None = None,
    dflash: Mapping[str, Any] | None = None,
    data_path: str | None = "train.jsonl",
) -> str:
    """A tiny recipe as YAML text, one key per line (so diagnostics have distinct lines)."""
    arch_fields = {**TINY_ARCH, **(arch or {})}
    lines = ["model:", "  model_name_or_path: base", "data:"]
    lines.append(f"  data_path: {data_path}" if data_path else "  data_path: null")
    lines += ["dflash:"]
    if init is not None:
        lines.append(f"  dflash_init_checkpoint: {init}")
    for key, value in (dflash or {}).items():
        lines.append(f"  {key}: {_flow(value)}")
    lines.append("  dflash_architecture_config:")
    for key, value in arch_fields.items():
        if value is not None:
            lines.append(f"    {key}: {_flow(value)}")
    return "\n".join(lines) + "\n"


def _flow(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


@pytest.fixture
def good_recipe(
    base_model: Path,
    drafter: Path,
    train_file: Path,
    write_recipe: Callable[..., Path],
    recipe_text: Callable[..., str],
) -> Path:
    """A tiny warm-start recipe that compiles (taps and mask come from the checkpoint)."""
    return write_recipe(recipe_text())


@pytest.fixture
def plan_dict(make_recipe: RecipeFactory, drafter: Path, tmp_path: Path) -> dict[str, Any]:
    """The tiny recipe's compiled plan, as the dict `RunPlan.to_dict` gives."""
    result = compile_recipe(make_recipe(), base_dir=tmp_path)
    assert result.plan is not None
    return result.plan.to_dict()


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Many tiny forwards: one torch thread avoids OpenMP waits on busy shared cores."""
    import torch  # only the executor tests ask for this fixture; the rest stay torch-free

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
