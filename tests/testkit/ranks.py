"""Start the ranks of a real gloo process group as separate processes, as torchrun would."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

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
    timeout: float = 300.0,
    what: str = "the ranks",
) -> list[subprocess.CompletedProcess[str]]:
    """Run `argv` as ranks 0..world_size-1 of one group (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT set; one OpenMP thread each) and wait for all of them; their results in
    rank order (stdout and stderr as text, each read whole once every rank has exited).

    Each rank writes its stdout and stderr into files, not pipes: a rank never blocks on a full
    pipe while the test waits on another rank, and a report longer than a pipe's buffer
    (64 KiB) is read whole. A rank still running `timeout` seconds after the start (a generous
    deadline: it only catches hangs) fails the test, every rank killed, with a message naming
    `what` and the end of each rank's stderr.
    """
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    base.update(env or {})
    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        outputs = [(Path(folder, f"{r}.out"), Path(folder, f"{r}.err")) for r in range(world_size)]
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank, (out, err) in enumerate(outputs):
                with out.open("wb") as stdout, err.open("wb") as stderr:
                    procs.append(
                        subprocess.Popen(
                            list(argv),
                            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                            stdout=stdout,
                            stderr=stderr,
                        )
                    )
            deadline = time.monotonic() + timeout
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    tails = "\n".join(
                        f"rank {r} stderr: ...{_text(err)[-1500:]}"
                        for r, (_, err) in enumerate(outputs)
                    )
                    pytest.fail(f"{what} hung for {timeout:.0f} s\n{tails}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return [
            subprocess.CompletedProcess(proc.args, proc.returncode, _text(out), _text(err))
            for proc, (out, err) in zip(procs, outputs, strict=True)
        ]


def _text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")
