"""The README's quoted output is what the code prints (issue 49: it quoted "linted 9 recipe
file(s)" with 10 recipes, and a demo table a fresh clone did not print). The demo's own
blocks, which need the demo's runs, are compared in tests/executor/demo/test_runner.py."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from testkit.readme import (
    README,
    assert_quoted_output,
    intro,
    output_differences,
    quoted_block,
    unkeepable_figures,
)

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


def test_the_install_lines_quote_no_figure_the_readme_cannot_keep() -> None:
    """Issue 49: package counts and timings drifted (57 and 161 packages; "the tests about 10"
    [minutes] took 20 on a busy 2-core machine). The README says how to see them instead."""
    text = intro()
    assert unkeepable_figures(text) == []
    assert "pip install --dry-run torch==2.13.0 -e '.[dev,plot]'" in " ".join(text.split())
    assert "--durations=10" in text


def test_the_figure_finder_catches_what_the_readme_used_to_say() -> None:
    old = (
        "(57 packages: torch, transformers, matplotlib), 3.5 minutes with pip's cache warm and "
        "6 without it; 161 packages: 11 minutes, up to an hour; took 34 s and 69 s; the tests "
        "about 10."
    )
    assert unkeepable_figures(old) == [
        "57 packages", "3.5 minutes", "161 packages", "11 minutes", "an hour", "34 s", "69 s",
        "about 10",
    ]  # fmt: skip
    assert unkeepable_figures("torch==2.13.0, -n 2, block size 16, Python 3.11") == []
