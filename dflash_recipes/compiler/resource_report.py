"""The resource plan as `compile` reports it: the GiB table, step and disk lines, time at an MFU,
and the `resources-exceed-device` error of `compile --device-memory`.

The estimate itself is :mod:`dflash_recipes.plan.resources` (the executor's `run` reads it too).
"""

from __future__ import annotations

from pathlib import Path

from dflash_recipes.compiler.codes import RESOURCES_EXCEED_DEVICE
from dflash_recipes.diagnostics import Diagnostic, Severity
from dflash_recipes.errors import ResourceError
from dflash_recipes.plan.resources.estimate import (
    DEFAULT_PEAK_TFLOPS,
    GIB,
    ResourcePlan,
    TargetDims,
    estimate_resources,
    gib,
    read_target_dims,
)
from dflash_recipes.plan.run_plan import RunPlan

# ---------------------------------------------------------------------------------------------
# text
# ---------------------------------------------------------------------------------------------


def render_resources(
    resources: ResourcePlan,
    *,
    mfu: float | None = None,
    peak_tflops: float = DEFAULT_PEAK_TFLOPS,
    sequences: int | None = None,
    per_step_rows: int = 1,
) -> str:
    """The small GiB table compile prints, then the step and disk figures.

    With `mfu`, time per step at that fraction of `peak_tflops` per rank, and per epoch when
    `sequences` (the training set's size) is known; `per_step_rows` is sequences per step.
    """
    memory, step, disk = resources.memory, resources.step, resources.disk
    sharding = ""
    if resources.fsdp_sharded:
        drafter = " and drafter" if resources.drafter_sharded else ""
        sharding = f", target{drafter} sharded (fsdp)"
    if resources.activation_checkpointing:
        sharding += ", draft layers recomputed (activation_checkpointing)"
    if memory.eval_drafter_copy:  # the peak is held-out evaluation's (issue 51)
        step_total = (resources.step_memory or memory).total
        sharding += f", peak at held-out evaluation (training step {gib(step_total)} GiB)"
    rows = (*memory.rows(), ("total", memory.total))  # with the eval copy at such a peak
    width = max(18, *(len(name) + 2 for name, _ in rows))
    lines = [
        f"resources per rank (estimate: {resources.world_size} rank(s), {resources.device}"
        f'{sharding}; docs/dflash.md "Will it fit?"):',
        f"  {'part':<{width}}{'GiB':>9}",
    ]
    for name, value in rows:
        lines.append(f"  {name:<{width}}{gib(value):>9}")
    host = resources.host_memory
    how = "decoder layers read shard by shard" if host.sharded_load else "target read whole"
    built = "built whole"
    if host.drafter_other_ranks is not None:
        built = f"built whole on rank 0 only, {gib(host.drafter_other_ranks)} on each other rank"
    lines.append(
        f"host memory per process while loading: {gib(host.total)} GiB (target "
        f"{gib(host.target)}, {how}; drafter {gib(host.drafter)}, {built})"
    )
    lines.append(
        f"step (all ranks): {step.tokens:,} tokens, {step.supervised_positions:,} supervised "
        f"block positions, {step.flops / 1e12:,.1f} TFLOP (target {step.target_flops / 1e12:,.1f}, "
        f"drafter {step.drafter_flops / 1e12:,.1f})"
    )
    if mfu is not None:
        seconds = step.flops / resources.world_size / (mfu * peak_tflops * 1e12)
        timing = f"at MFU {mfu:.2f} of {peak_tflops:g} TFLOPS per rank: {seconds:.3f} s per step"
        if sequences is not None:
            steps = max(1, sequences // max(1, per_step_rows))
            epoch = steps * seconds
            shown = f"{epoch / 3600:.2f} h" if epoch >= 360 else f"{epoch:.1f} s"
            timing += f", {shown} per epoch ({steps:,} steps of {sequences:,} sequences)"
        lines.append(timing)
    # the peak during a save (save_total_limit + the new one before the oldest goes), not
    # what is kept afterwards (issue 49: "x 3 kept" read as three kept for a limit of 2)
    kept = (
        f" ({disk.checkpoints_kept} on disk while one is saved, save_total_limit + 1: "
        f"{gib(disk.checkpoints_peak_bytes or 0)} GiB)"
        if disk.checkpoints_kept is not None
        else " (no save_total_limit: every checkpoint stays)"
    )
    lines.append(
        f"disk: checkpoint {gib(disk.checkpoint_bytes)} GiB{kept}; export "
        f"{gib(disk.export_bytes)} GiB; capture {disk.capture_bytes_per_sequence / 2**20:,.1f} MiB "
        "per sequence"
    )
    return "\n".join(lines)


def count_sequences(path: Path) -> int | None:
    """Lines holding something in a JSONL file (counted in 1 MiB reads), None if unreadable."""
    count = 0
    try:
        with open(path, "rb") as handle:
            tail = b"\n"
            while chunk := handle.read(2**20):
                count += chunk.count(b"\n")
                tail = chunk[-1:]
    except OSError:
        return None
    return count + (0 if tail == b"\n" else 1)


# ---------------------------------------------------------------------------------------------
# what `compile` shows
# ---------------------------------------------------------------------------------------------


def compile_resources(
    plan: RunPlan, *, world_size: int
) -> tuple[ResourcePlan | None, TargetDims | None, str | None]:
    """The resource plan `compile` shows, the target's dims it used, and why there is none
    (the plan still compiled) when it cannot be estimated."""
    try:
        target = read_target_dims(Path(plan.base_model.path))
        return estimate_resources(plan, world_size=world_size, target=target), target, None
    except ResourceError as exc:
        return None, None, str(exc)


def render_for_compile(
    plan: RunPlan,
    resources: ResourcePlan | None,
    problem: str | None,
    *,
    mfu: float | None = None,
    peak_tflops: float | None = None,
) -> str:
    """The text compile prints on stderr (the table, or why there is none)."""
    if resources is None:
        return f"resources: not estimated ({problem})"
    training = plan.training
    sequences = None
    if mfu is not None and plan.data.data_path is not None:
        sequences = count_sequences(Path(plan.data.data_path))
    rows = (
        training.per_device_train_batch_size
        * resources.world_size
        * training.gradient_accumulation_steps
    )
    return render_resources(
        resources,
        mfu=mfu,
        peak_tflops=peak_tflops or DEFAULT_PEAK_TFLOPS,
        sequences=sequences,
        per_step_rows=rows,
    )


def device_diagnostic(
    plan: RunPlan,
    resources: ResourcePlan,
    device_memory: float,
    *,
    recipe_file: str | None,
    target: TargetDims | None = None,
) -> Diagnostic | None:
    """The `resources-exceed-device` error when `resources` need more than `device_memory`
    GiB per rank (with what would fit), else None."""
    device_bytes = int(device_memory * GIB)
    if resources.memory.total <= device_bytes:
        return None
    from dflash_recipes.plan.resources.fit import exceed_message, fit_advice  # only on refusal

    advice = fit_advice(
        plan, device_bytes, world_size=resources.world_size, device=resources.device, target=target
    )
    message, hint = exceed_message(
        plan, resources, device_bytes, advice, where=f"--device-memory {device_memory:g}"
    )
    return Diagnostic(
        severity=Severity.ERROR,
        code=RESOURCES_EXCEED_DEVICE,
        path="training",
        message=message,
        hint=hint,
        file=recipe_file,
    )


__all__ = [
    "compile_resources",
    "count_sequences",
    "device_diagnostic",
    "render_for_compile",
    "render_resources",
]
