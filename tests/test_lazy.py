"""The packages' lazily imported names: read on first use, kept, and unknown names refused."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import dflash_recipes


def test_a_public_name_imports_its_module_only_when_read() -> None:
    code = (
        "import sys, dflash_recipes\n"
        "assert 'dflash_recipes.compiler.compilation' not in sys.modules\n"
        "f = dflash_recipes.compile_file\n"
        "assert 'dflash_recipes.compiler.compilation' in sys.modules\n"
        "assert vars(dflash_recipes)['compile_file'] is f\n"  # kept: later reads skip __getattr__
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_name_is_an_attribute_error_naming_the_package() -> None:
    with pytest.raises(AttributeError, match="module 'dflash_recipes' has no attribute 'nope'"):
        _ = dflash_recipes.nope  # type: ignore[attr-defined]


def test_dir_lists_the_lazy_names_before_they_are_read() -> None:
    assert {"compile_file", "RunPlan", "TrackerError"} <= set(dir(dflash_recipes))


def test_the_executors_former_name_is_the_same_class() -> None:
    import dflash_recipes.executor as executor

    assert executor.DFlashModel is executor.ConvertedModel
    refused = re.escape("module 'dflash_recipes.executor' has no attribute 'x'")
    with pytest.raises(AttributeError, match=refused):
        _ = executor.x  # type: ignore[attr-defined]
