"""The compiler's diagnostic codes: registered, kebab-case, each with its severity."""

from __future__ import annotations

import re

from dflash_recipes.checkpoint import hfconfig
from dflash_recipes.compiler import codes as compile_codes
from dflash_recipes.diagnostics import (
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
