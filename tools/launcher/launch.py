"""Render (and optionally submit) a Slurm batch script for a dflash recipe.

    python tools/launcher/launch.py --yaml RECIPE --nodes N --gpus-per-node G [--yes]

The recipe is compiled first (errors stop here, before anything is queued). The compiled
plan is written next to the script, the job name carries the plan's fingerprint, and every
node runs `dflash-recipe run PLAN --nproc-per-node G --nnodes N --rdzv-endpoint HEAD:29500`
through srun, with the rendezvous id taken from the Slurm job id. Without --yes the script is
only written and printed, with the sbatch command to submit it.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.diagnostics import render_text, sort_diagnostics, summary_line
from dflash_recipes.errors import LaunchError

RDZV_PORT = 29500

#: Slurm names (partition, account): no spaces or newlines, which would break the #SBATCH line.
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.,:+\-]+$")
#: Slurm --time forms used here: MM:SS is ambiguous, so ask for [D-]HH:MM:SS.
_SLURM_TIME = re.compile(r"^(\d+-)?\d{1,3}:[0-5]\d:[0-5]\d$")


def render_slurm_script(
    plan_path: Path,
    fingerprint: str,
    *,
    nodes: int,
    gpus_per_node: int,
    partition: str | None = None,
    time: str | None = None,
    account: str | None = None,
    cpus_per_task: int = 16,
) -> str:
    """The batch script text: one srun task per node, each a torchrun of G processes.

    Invalid values raise LaunchError (they would otherwise surface only when Slurm rejects
    the script, or split an #SBATCH line).
    """
    if nodes < 1 or gpus_per_node < 1 or cpus_per_task < 1:
        msg = (
            "--nodes, --gpus-per-node and cpus per task must be >= 1, got "
            f"{nodes}, {gpus_per_node} and {cpus_per_task}"
        )
        raise LaunchError(msg)
    for option, value in (("--partition", partition), ("--account", account)):
        if value is not None and not _SLURM_NAME.match(value):
            msg = f"{option} {value!r} is not a Slurm name (letters, digits, '_', '-', '.')"
            raise LaunchError(msg)
    if time is not None and not _SLURM_TIME.match(time):
        msg = f"--time {time!r} is not HH:MM:SS (or D-HH:MM:SS), e.g. --time 24:00:00"
        raise LaunchError(msg)
    if not re.fullmatch(r"[0-9a-f]{12,64}", fingerprint):
        msg = f"fingerprint {fingerprint!r} is not a plan fingerprint (hex sha256)"
        raise LaunchError(msg)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=dflash-{fingerprint[:12]}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        f"#SBATCH --cpus-per-task={cpus_per_task}",
        f"#SBATCH --output=dflash-{fingerprint[:12]}-%j.log",
        # USR1 to this shell 120 s before the time limit (trapped below); a preempted or
        # requeued job goes back to the queue and its rerun resumes from the last checkpoint.
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --requeue",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if time:
        lines.append(f"#SBATCH --time={time}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    plan = shlex.quote(str(plan_path))
    lines += [
        "",
        "set -euo pipefail",
        "# The first node of the allocation hosts the c10d rendezvous.",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"# Plan fingerprint {fingerprint}",
        "# 120 s before the time limit: every process saves a checkpoint now (USR1, passed on",
        "# by srun and by each node's launcher), then the job is requeued: Slurm stops it with",
        "# SIGTERM (each process finishes its step and saves) and the requeued job resumes.",
        'trap \'kill -USR1 "$SRUN_PID" 2>/dev/null || true; '
        'scontrol requeue "$SLURM_JOB_ID" || true\' USR1',
        "srun --kill-on-bad-exit=1 dflash-recipe run "
        f"{plan} --nproc-per-node {gpus_per_node} --nnodes {nodes} "
        f'--rdzv-endpoint "$HEAD_NODE:{RDZV_PORT}" --rdzv-id "$SLURM_JOB_ID" --no-progress &',
        "SRUN_PID=$!",
        "# A trap interrupts `wait` (status 138): wait again while srun runs, then once more for",
        "# its own status (bash keeps it), so the job ends as srun did, never as the signal.",
        'while kill -0 "$SRUN_PID" 2>/dev/null; do wait "$SRUN_PID" || true; done',
        'STATUS=0; wait "$SRUN_PID" || STATUS=$?; exit "$STATUS"',
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--yaml", required=True, type=Path, help="the recipe to launch")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--partition")
    parser.add_argument("--time", help="HH:MM:SS wall-clock limit")
    parser.add_argument("--account")
    parser.add_argument("--output", type=Path, help="script path (default: next to the recipe)")
    parser.add_argument("--yes", action="store_true", help="submit with sbatch")
    parser.add_argument("overrides", nargs="*", help="a.b.c=value recipe overrides")
    args = parser.parse_args(argv)

    result = compile_file(args.yaml, overrides=tuple(args.overrides))
    if result.diagnostics:
        print(render_text(sort_diagnostics(result.diagnostics)), file=sys.stderr)
    if result.plan is None:
        print(f"not launched: {summary_line(result.diagnostics)}", file=sys.stderr)
        return 1
    fingerprint = result.plan.fingerprint
    script_path = args.output or args.yaml.with_name(f"{args.yaml.stem}.{fingerprint[:12]}.sbatch")
    plan_path = script_path.with_suffix(".plan.json").resolve()
    try:
        script = render_slurm_script(
            plan_path,
            fingerprint,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            partition=args.partition,
            time=args.time,
            account=args.account,
        )
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    script_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_text(result.plan.to_json(), encoding="utf-8")
    script_path.write_text(script, encoding="utf-8")
    print(script)
    if not args.yes:
        print(f"# wrote {script_path}; submit with: sbatch {script_path}", file=sys.stderr)
        return 0
    try:
        completed = subprocess.run(["sbatch", str(script_path)], check=False)
    except OSError as exc:
        print(
            f"error: could not run sbatch ({exc}); submit on a Slurm login node with: "
            f"sbatch {script_path}",
            file=sys.stderr,
        )
        return 1
    return completed.returncode


if __name__ == "__main__":
    sys.exit(main())
