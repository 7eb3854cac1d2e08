"""Every diagnostic and error message is printable and bounded, whatever its builder echoed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from testkit.fuzzing import FUZZ

from dflash_recipes.diagnostics import Diagnostic, Severity, render_text
from dflash_recipes.echo import LINE_LIMIT, MESSAGE_LIMIT, bound_message, printable
from dflash_recipes.errors import CheckpointError, CompileError, DataError

HUGE = "x" * 3_000_000


def test_a_huge_line_is_cut_in_its_middle_keeping_both_ends() -> None:
    text = bound_message("head " + HUGE + " tail: the fix")
    assert len(text) <= LINE_LIMIT + 60
    assert text.startswith("head xxx")
    assert text.endswith("xxx tail: the fix")
    assert f"[... {len(HUGE) + 19 - LINE_LIMIT * 3 // 4 - LINE_LIMIT // 8} characters left out" in (
        text
    )


def test_many_lines_are_bounded_as_a_whole() -> None:
    text = bound_message("\n".join(f"line {i}" for i in range(100_000)))
    assert len(text) <= MESSAGE_LIMIT + 60
    assert text.startswith("line 0\nline 1\n")
    assert text.endswith("line 99999")


def test_short_messages_are_unchanged() -> None:
    message = "a\nb: `x` must be an integer >= 1, got 'y'"
    assert bound_message(message) == message


def test_lone_surrogates_become_escapes_that_any_stream_can_encode() -> None:
    assert printable("out\ud800put") == "out\\ud800put"
    assert bound_message("out\udcffput").encode("utf-8") == b"out\\udcffput"


def test_a_diagnostic_bounds_its_message_and_hint_when_made() -> None:
    d = Diagnostic(Severity.ERROR, "some-code", "a.b", "got " + HUGE, hint="set " + HUGE)
    assert len(d.message) <= LINE_LIMIT + 60
    assert d.hint is not None
    assert len(d.hint) <= LINE_LIMIT + 60
    assert len(render_text([d])) < 3 * LINE_LIMIT
    assert "characters left out" in d.to_json()["message"]  # type: ignore[operator]


@pytest.mark.parametrize("error", [CheckpointError, DataError])
def test_an_error_message_is_bounded_when_shown(error: type[Exception]) -> None:
    text = str(error("bad value " + HUGE + "\ud800; fix it"))
    assert len(text) <= LINE_LIMIT + 60
    assert text.endswith("\\ud800; fix it")


def test_an_error_carrying_diagnostics_is_bounded_as_a_whole() -> None:
    many = [Diagnostic(Severity.ERROR, "c", "p", f"problem {i} " + "y" * 1000) for i in range(500)]
    text = str(CompileError("compile failed", many))
    assert len(text) <= MESSAGE_LIMIT + 60
    assert text.startswith("compile failed\nerror[c] p: problem 0 ")


def test_the_cli_prints_an_error_about_a_huge_argument_bounded(tmp_path: Path) -> None:
    # the whole process as a user runs it, stderr ASCII-only and strict: a 100 kB plan name (about
    # the most one argument may hold) comes back as one bounded line, no traceback
    plan = tmp_path / ("p" * 100_000 + ".json")
    env = {**os.environ, "PYTHONIOENCODING": "ascii:strict"}
    done = subprocess.run(
        [sys.executable, "-m", "dflash_recipes.cli", "export", str(plan), str(tmp_path / "out")],
        capture_output=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert b"Traceback" not in done.stderr
    assert done.returncode in (1, 2)
    assert b"characters left out" in done.stderr
    assert len(done.stderr) < 3 * LINE_LIMIT


@FUZZ
@given(text=st.text(alphabet=st.characters(), max_size=5000), repeat=st.integers(1, 2000))
def test_any_text_comes_out_encodable_and_bounded(text: str, repeat: int) -> None:
    shown = bound_message(text * repeat)
    shown.encode("utf-8")
    assert len(shown) <= MESSAGE_LIMIT + 60
    assert all(len(line) <= LINE_LIMIT + 60 for line in shown.split("\n"))
