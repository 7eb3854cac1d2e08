"""Fuzzing the trackers' state (trackers.json, read on resume to continue the tracker runs):
whatever it holds, the reader returns the well-formed entries and never raises (a run resumes
with fresh tracker runs rather than failing on a damaged state file)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hypothesis import event, given
from hypothesis import strategies as st
from testkit.fuzzing import FUZZ, json_values

from dflash_recipes.executor.training.trackers.fanout import TRACKERS_FILE, _read_kept

HOSTILE = [
    b"{" * 50_000,
    b'{"mlflow": {"run_id": "\\ud800"}}',
    b'{"mlflow": {"run_id": ' + b"9" * 5000 + b"}}",
    b'{"wandb": {"id": NaN}}',
    b'{"mlflow": {"run_id": "a"}, "mlflow": {"run_id": "b"}}',
    b"\xff\xfe",
    json.dumps({"mlflow": {"run_id": "x" * (2**20)}}).encode(),
]


@FUZZ
@given(
    raw=st.one_of(
        st.sampled_from(HOSTILE),
        st.binary(max_size=200),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.dictionaries(st.sampled_from(["mlflow", "wandb", "tensorboard"]), json_values).map(
            lambda v: json.dumps(v).encode()
        ),
    )
)
def test_any_tracker_state_reads_as_string_entries_or_nothing(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / TRACKERS_FILE
    path.write_bytes(raw)
    kept = _read_kept(path)
    event("kept" if kept else "nothing")
    for name, entry in kept.items():
        assert isinstance(name, str)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in entry.items())


def test_a_fifo_or_a_folder_in_place_of_the_state_is_nothing(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / TRACKERS_FILE)
    assert _read_kept(tmp_path / TRACKERS_FILE) == {}
    (tmp_path / "folder").mkdir()
    assert _read_kept(tmp_path / "folder") == {}
