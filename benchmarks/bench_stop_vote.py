"""What the ranks' agreement on signals costs per optimiser step (2 gloo processes, CPU).

Each of two processes runs loops of N "steps" (a 5 ms sleep standing in for the step's
work), interleaved round by round: nothing at the boundary (the baseline), a blocking gloo
all-reduce of one float (what a synchronous vote would cost), and :meth:`StepVote.decide`
(the asynchronous all-reduce of two integers started at each boundary, read at the next,
long finished). Prints the microseconds each adds to a step over the baseline, and the time
the training thread spends inside ``decide`` itself (on a busy machine the loop figures also
hold the scheduling of gloo's background thread). The vote
never touches the accelerator, so on GPUs it adds this host-side figure and no sync.

    python benchmarks/bench_stop_vote.py
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_recipes.executor.coordination import StepVote
from dflash_recipes.executor.signals import SignalWatch

STEPS = 300
ROUNDS = 3
STEP_S = 0.005


def _worker(rank: int, port: int, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    vote = StepVote(SignalWatch(), distributed=True)
    value = torch.zeros(1)
    boundaries = {
        "nothing": lambda: None,
        "blocking": lambda: dist.all_reduce(value),
        "vote": vote.decide,
    }
    times: dict[str, list[float]] = {name: [] for name in boundaries}
    for _ in range(ROUNDS):
        for name, boundary in boundaries.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(STEPS):
                time.sleep(STEP_S)
                boundary()
            times[name].append((time.perf_counter() - start) / STEPS)
    inside = []
    for _ in range(STEPS):
        time.sleep(STEP_S)
        start = time.perf_counter()
        vote.decide()
        inside.append(time.perf_counter() - start)
    vote.close()
    dist.destroy_process_group()
    if rank == 0:
        medians = {name: statistics.median(values) for name, values in times.items()}
        medians["inside"] = statistics.median(inside)
        queue.put(medians)


def main() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_worker, args=(port, queue), nprocs=2, start_method="spawn")
    medians = queue.get()
    base = medians["nothing"]
    print(f"a {STEP_S * 1e3:.0f} ms step, nothing at the boundary : {base * 1e6:8.1f} us")
    for name, label in (("blocking", "blocking all-reduce"), ("vote", "StepVote.decide    ")):
        extra = medians[name] - base
        print(f"  + {label}: {extra * 1e6:+7.1f} us a step ({medians[name] / base:.4f}x)")
    print(f"time inside StepVote.decide (median) : {medians['inside'] * 1e6:8.1f} us")


if __name__ == "__main__":
    sys.exit(main())
