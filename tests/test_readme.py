"""The README's quoted output is what the code prints (issue 49: it quoted "linted 9 recipe
file(s)" with 10 recipes, and a demo table a fresh clone did not print). The demo's own
blocks, which need the demo's runs, are compared in tests/executor/demo/test_runner.py."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from testkit.readme import README, assert_quoted_output, output_differences, quoted_block

from dflash_recipes.cli import main

ROOT = README.parent


def test_the_quoted_lint_output_is_what_lint_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    command, *quoted = quoted_block("$ dflash-recipe lint recipes/ --strict")
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(main, command.split()[2:])
    assert result.exit_code == 0, result.output
    assert quoted == result.output.splitlines()  # no figure here may differ between machines


def test_a_figure_may_differ_in_its_last_digit_and_nothing_else() -> None:
    quoted = ["  measured acceptance length tau (eval)            1.92          1.45"]
    assert output_differences(quoted, [quoted[0].replace("1.92", "1.91")]) == []
    assert output_differences(quoted, [quoted[0].replace("1.92", "2.02")]) == [
        f"quoted {quoted[0]!r}, printed {quoted[0].replace('1.92', '2.02')!r}"
    ]
    assert output_differences(quoted, [quoted[0].replace("(eval)", "(train)")])
    assert output_differences(["79 verification steps"], ["81 verification steps"]) == []
    assert output_differences(["79 verification steps"], ["89 verification steps"])
    assert output_differences(quoted, [*quoted, ""])
    with pytest.raises(AssertionError, match=r"paste the printed lines into README\.md"):
        assert_quoted_output(["linted 9 recipe file(s)"], ["linted 10 recipe file(s)"])


def test_a_block_the_readme_does_not_quote_is_named() -> None:
    with pytest.raises(AssertionError, match=r"README\.md has 0 blocks starting '\$ dflash"):
        quoted_block("$ dflash-recipe no-such-command")
