"""The compiler's diagnostic codes: registered, kebab-case, each with its severity."""

from __future__ import annotations

import functools
import importlib
import re
from pathlib import Path

import pytest

from dflash_recipes.checkpoint import hfconfig
from dflash_recipes.compiler import codes as compile_codes
from dflash_recipes.diagnostics import (
    CODE_MODULES,
    Severity,
    code_severity,
    registered_codes,
)


def test_every_compiler_code_is_registered_kebab_case_with_its_severity() -> None:
    registered = {info.code: info for info in registered_codes()}
    compiler_codes = [getattr(compile_codes, name) for name in compile_codes.__all__]
    assert len(compiler_codes) > 30
    for code in compiler_codes:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)+", code), code
        assert code_severity(code) is registered[code].severity
        assert registered[code].summary
    assert code_severity("heads-from-scratch") is Severity.WARNING
    assert code_severity("checkpoint-layout-mismatch") is Severity.ERROR
    config_codes = [c for c in vars(hfconfig).values() if isinstance(c, str) and c in registered]
    assert len(config_codes) == 8
    assert all(re.fullmatch(r"(target|checkpoint)(-[a-z0-9]+)+", c) for c in config_codes)


TESTS = Path(__file__).resolve().parents[1]


@functools.cache
def _test_sources() -> str:
    own = {Path(__file__).resolve(), TESTS / "test_docs.py"}
    return "\n".join(
        path.read_text(encoding="utf-8")
        for path in sorted(TESTS.rglob("test_*.py"))
        if path.resolve() not in own
    )


def _constant_names(code: str) -> set[str]:
    """Names bound to `code` in the modules that register codes."""
    names = set()
    for module_name in CODE_MODULES:
        module = importlib.import_module(module_name)
        names |= {name for name, value in vars(module).items() if value == code and name.isupper()}
    return names


@pytest.mark.parametrize("code", [info.code for info in registered_codes()])
def test_every_code_is_asserted_by_some_test(code: str) -> None:
    """A code no test names is a rule nothing guards: a new code needs its own test."""
    sources = _test_sources()
    spelled = f'"{code}"' in sources or f"'{code}'" in sources
    by_name = any(re.search(rf"\b{name}\b", sources) for name in _constant_names(code))
    assert spelled or by_name, f"no test names the diagnostic code {code}"
