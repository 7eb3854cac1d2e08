"""Start the ranks of a real gloo process group as separate processes, as torchrun would."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Mapping, Sequence

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_ranks(
    argv: Sequence[str],
    *,
    world_size: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    what: str = "the ranks",
) -> list[subprocess.CompletedProcess[str]]:
    """Run `argv` as ranks 0..world_size-1 of one group (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT set; one OpenMP thread each) and wait for all of them; their results in
    rank order (stdout and stderr as text). A rank still running after `timeout` seconds fails
    the test (every rank is killed) with a message naming `what` hung."""
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    base.update(env or {})
    procs = [
        subprocess.Popen(
            list(argv),
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    results = []
    try:
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{what} hung for {timeout:.0f} s")
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results
