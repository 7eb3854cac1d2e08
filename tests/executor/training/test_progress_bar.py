"""The progress bar's figures: the training-batch estimate is named as what it is (issue 36)."""

from __future__ import annotations

import io

import pytest

from dflash_recipes.executor.training.progress_bar import ProgressBar


def test_the_bar_names_the_tau_a_training_batch_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tqdm.auto

    sink = io.StringIO()
    made: list[object] = []

    def terminal_tqdm(**kwargs: object) -> object:  # a bar drawn as on a terminal
        real = tqdm.std.tqdm(**{**kwargs, "disable": False, "file": sink})
        made.append(real)
        return real

    monkeypatch.setattr(tqdm.auto, "tqdm", terminal_tqdm)
    bar = ProgressBar(total=10, start=0, show=True)
    bar.advance()
    bar.show_figures(loss=1.23456, tau=1.754)
    assert made, "the bar was not shown"
    assert "loss=1.235, train_batch_tau=1.75" in sink.getvalue()
    bar.close()


def test_no_bar_is_a_no_op() -> None:
    bar = ProgressBar(total=10, start=0, show=False)
    bar.advance()
    bar.show_figures(loss=1.0, tau=1.0)
    bar.close()
