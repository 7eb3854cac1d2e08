"""Run the tests on a busy machine: keep the cores busy while pytest runs.

    python tools/stress.py -- -q -n 2                 # the whole suite, every core kept busy
    python tools/stress.py --load 4 --times 3 -- -q -n 2 -m timing

A test that passes on a quiet machine and fails on a laptop that is also compiling, or on a
shared CI runner, assumes a quiet machine: a wall-clock bound, a sleep instead of a wait, a
float tolerance that another thread count breaks. This script makes the busy machine
reproducible: it starts ``--load`` processes that spin at the normal priority (default: one per
core), runs ``python -m pytest`` with the arguments after ``--`` (``--times`` runs in a row,
stopping at the first failure), and stops the spinning processes when pytest ends, on Ctrl-C,
on SIGTERM, and (each spinner watches its parent) even when this script is killed. Its exit
status is pytest's. Each run prints one line with its exit status and seconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

#: One spinning process: busy until its parent (this script) is gone, whatever ended it.
_SPIN = """
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(100_000):
        pass
"""
#: The environment variable that tells the command the process ids of the load.
PIDS_ENV = "DFLASH_STRESS_PIDS"


@contextmanager
def busy_cores(load: int) -> Iterator[list[int]]:
    """Keep `load` processes spinning while the block runs; their process ids."""
    spinners: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(load):
            spinners.append(
                subprocess.Popen(
                    [sys.executable, "-c", _SPIN, str(os.getpid())],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        yield [spinner.pid for spinner in spinners]
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


def run_under_load(command: Sequence[str], *, load: int, times: int = 1) -> int:
    """Run `command` `times` times in a row (until one fails) with `load` busy processes;
    the last exit status. The command sees the load's process ids in :data:`PIDS_ENV`."""
    with busy_cores(load) as pids:
        env = {**os.environ, PIDS_ENV: ",".join(map(str, pids))}
        code = 0
        for run in range(1, times + 1):
            started = time.monotonic()
            code = subprocess.call(list(command), env=env)
            seconds = time.monotonic() - started
            print(
                f"stress: run {run} of {times} under a load of {load} busy processes: "
                f"exit status {code} in {seconds:.0f} s",
                flush=True,
            )
            if code != 0:
                break
    return code


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through busy_cores: the load goes with us


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        usage="%(prog)s [--load N] [--times K] [-- PYTEST_ARGS...]",
    )
    parser.add_argument(
        "--load",
        type=int,
        default=os.cpu_count() or 1,
        help="spinning processes to start (default: one per core, %(default)s here)",
    )
    parser.add_argument(
        "--times", type=int, default=1, help="runs in a row, stopping at the first failure"
    )
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="arguments for pytest")
    args = parser.parse_args(argv)
    if args.load < 0 or args.times < 1:
        parser.error("--load must be 0 or more and --times 1 or more")
    pytest_args = list(args.pytest_args)
    if pytest_args[:1] == ["--"]:
        pytest_args = pytest_args[1:]
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return run_under_load(
            [sys.executable, "-m", "pytest", *pytest_args], load=args.load, times=args.times
        )
    except KeyboardInterrupt:  # Ctrl-C reached pytest too; the load is gone by now
        return 130


if __name__ == "__main__":
    sys.exit(main())
