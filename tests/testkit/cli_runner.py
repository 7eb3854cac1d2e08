"""Invoking `dflash-recipe` in-process for tests: anything but an exit fails the test."""

from __future__ import annotations

from click.testing import CliRunner, Result

from dflash_recipes.cli import main


def cli(*args: str, env: dict[str, str] | None = None) -> Result:
    """Invoke `dflash-recipe ARGS`; fail the test if anything but an exit escaped."""
    result = CliRunner().invoke(main, list(args), env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"dflash-recipe {' '.join(args)} raised") from result.exception
    assert "Traceback" not in result.output
    return result
