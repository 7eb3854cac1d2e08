"""Fixtures of the regenerate tests: one local OpenAI-compatible test server per module."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from openai_test_server import DEFAULT_KNOBS
from testkit.regenerating import (
    SERVER,
    TARGET,
    Server,
)


@pytest.fixture(scope="module")
def server_process() -> Iterator[Server]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--model-dir", str(TARGET), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("PORT "), f"the test server did not start: {line!r}"
        yield Server(f"http://127.0.0.1:{int(line.split()[1])}")
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def server(server_process: Server) -> Server:
    server_process.control(**DEFAULT_KNOBS)
    httpx.post(f"{server_process.url}/reset").raise_for_status()
    return server_process
