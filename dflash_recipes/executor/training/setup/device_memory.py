"""`run`'s memory check: the compile-time resource plan against the real device, before the
target is loaded (docs/dflash.md, "Will it fit?").

On CUDA the estimate for the real world size is compared with the GPU's total memory, and a
plan that needs more is refused with what would fit, before minutes of loading an 8B target end
in an out-of-memory error, unless the check is skipped (`run --skip-memory-check`: the
estimate is an estimate), which logs what was measured and what the estimate said instead. On
CPU nothing is checked (a debug line says so).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflash_recipes.errors import ResourceError
from dflash_recipes.plan.resources.estimate import estimate_resources, gib, read_target_dims
from dflash_recipes.plan.resources.fit import exceed_message, fit_advice
from dflash_recipes.plan.run_plan import RunPlan

logger = logging.getLogger("dflash_recipes.run")


def check_device_memory(
    plan: RunPlan,
    *,
    device: torch.device,
    world_size: int,
    total_bytes: int | None = None,
    label: str | None = None,
    log: bool = True,
    skip: bool = False,
) -> str | None:
    """Refuse (ResourceError) a plan whose estimate exceeds the device's memory.

    Returns the one line `run` logs (estimate against the device), or None on CPU. A plan the
    estimate cannot size (a target config without the dims it reads) is logged and let through.
    `total_bytes` and `label` stand in for the device's total memory and name (tests); `log`
    False keeps the line out of the log (the ranks other than 0). `skip` (``run
    --skip-memory-check``) lets a plan that does not fit through with a warning instead: the
    device's memory, the estimate and its advice.
    """
    if device.type != "cuda":
        if log:
            logger.debug("memory check skipped: training on %s", device.type)
        return None
    if total_bytes is None:
        total_bytes = int(torch.cuda.get_device_properties(device).total_memory)
        label = f"{device} ({torch.cuda.get_device_name(device)})"
    where = label or str(device)
    try:
        target = read_target_dims(Path(plan.base_model.path))
        resources = estimate_resources(
            plan, world_size=world_size, device="cuda", target=target, device_bytes=total_bytes
        )
    except ResourceError as exc:
        if log:
            logger.warning("memory check skipped: %s", exc)
        return None
    needed = resources.memory.total
    if needed > total_bytes:
        advice = fit_advice(plan, total_bytes, world_size=world_size, device="cuda", target=target)
        message, hint = exceed_message(plan, resources, total_bytes, advice, where=where)
        if skip:
            warning = (
                f"warning: memory check skipped (--skip-memory-check): by the estimate {message}; "
                f"training anyway, so an out-of-memory error may stop the run (the estimate's "
                f"advice: {hint})"
            )
            if log:
                logger.warning("%s", warning)
            return warning
        msg = (
            f"{message}; {hint}; recompile with that change, use a device with more memory, or "
            "run with --skip-memory-check if the estimate is wrong for this device"
        )
        raise ResourceError(msg)
    line = (
        f"memory: about {gib(needed)} GiB per rank estimated, {where} has {gib(total_bytes)} "
        f"GiB ({world_size} rank(s)): fits"
    )
    if log:
        logger.info("%s", line)
    return line


__all__ = ["check_device_memory"]
