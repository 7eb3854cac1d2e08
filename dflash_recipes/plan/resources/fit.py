"""What would fit a device: the search `compile --device-memory` and `run` report when a
plan's estimated memory per rank (:mod:`~dflash_recipes.plan.resources.estimate`) exceeds it.

When the peak is held-out evaluation's (a whole drafter copy on every rank under
``training.fsdp``: :mod:`~dflash_recipes.plan.resources.rank_memory`), the message says so and
the advice names what lowers that peak: no evaluation during training (``training.eval_steps:
0``), a bfloat16 master, a device with more memory; evaluating less often or on fewer prompts
does not.

Imported only on that path, so a compile that fits pays nothing for it. The compiler turns the
advice into the `resources-exceed-device` diagnostic
(:func:`~dflash_recipes.compiler.resource_report.device_diagnostic`); `run` refuses with the same
message and hint (:mod:`~dflash_recipes.executor.training.setup.device_memory`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs

from dflash_recipes.plan.resources.estimate import (
    Device,
    ResourcePlan,
    TargetDims,
    estimate_resources,
    gib,
    read_target_dims,
)
from dflash_recipes.plan.resources.rank_memory import evaluates_whole_drafter
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.records import Record

#: The plan's training without held-out evaluation during training (the recipe's
#: ``training.eval_steps: 0``; the gate training.eval_min_tau, which needs a measurement, unset).
_NO_EVAL = {"eval_steps": None, "eval_min_tau": None}


@attrs.frozen(repr=False, eq=False, slots=False)
class FitAdvice(Record):
    """The largest values that fit one knob at a time (None: not even the smallest does)."""

    num_anchors: int | None
    per_device_train_batch_size: int | None
    training_seq_len: int | None
    #: Whether the plan with training.fsdp over the world size fits (None: one rank only).
    fsdp_fits: bool | None
    #: Whether the plan with training.activation_checkpointing fits (None: it is already on).
    activation_checkpointing_fits: bool | None = None
    #: Whether the plan with a bfloat16 drafter_master_dtype fits (None: it is already).
    bfloat16_master_fits: bool | None = None
    #: The settings that fit together when no single one does: training.fsdp (several ranks),
    #: then activation_checkpointing, then a bfloat16 master, then no held-out evaluation (when
    #: it holds a whole drafter copy), added in that order until the plan fits (empty: none
    #: needed or even all of them do not fit).
    together: tuple[str, ...] = ()
    #: Whether the plan without held-out evaluation during training fits (None: its evaluation
    #: holds no whole drafter copy).
    without_eval_fits: bool | None = None


def _largest(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """Largest value in [low, high] for which `fits` holds (monotone), or None."""
    if high < low or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def fit_advice(
    plan: RunPlan,
    device_bytes: int,
    *,
    world_size: int,
    device: Device | None = None,
    target: TargetDims | None = None,
) -> FitAdvice:
    """What would fit `device_bytes` per rank: each knob searched with the others as planned."""
    if target is None:
        target = read_target_dims(Path(plan.base_model.path))
    training, draft = plan.training, plan.draft

    def total(candidate: RunPlan, ranks: int = world_size) -> int:
        found = estimate_resources(candidate, world_size=ranks, device=device, target=target)
        return found.memory.total

    def with_training(**changes: object) -> RunPlan:
        return attrs.evolve(plan, training=attrs.evolve(training, **changes))  # type: ignore[arg-type]

    def with_anchors(count: int) -> RunPlan:
        objective = attrs.evolve(draft.objective, num_anchors=count)
        return attrs.evolve(plan, draft=attrs.evolve(draft, objective=objective))

    seq = training.training_seq_len
    anchors = _largest(lambda a: total(with_anchors(a)) <= device_bytes, 1, max(1, seq))
    batch = _largest(
        lambda x: total(with_training(per_device_train_batch_size=x)) <= device_bytes, 1, 4096
    )
    block = draft.block_size
    longest = max(
        seq, plan.base_model.facts.max_position_embeddings if plan.base_model.facts else seq
    )
    seq_len = _largest(
        lambda s: total(with_training(training_seq_len=s)) <= device_bytes, block + 1, longest
    )
    fsdp_fits: bool | None = None
    if world_size > 1 and not training.fsdp:
        fsdp_fits = total(with_training(fsdp=True)) <= device_bytes
    elif world_size > 1:
        fsdp_fits = total(plan) <= device_bytes
    checkpointing_fits: bool | None = None
    if not training.activation_checkpointing:
        checkpointing_fits = total(with_training(activation_checkpointing=True)) <= device_bytes
    bf16_fits: bool | None = None
    if training.drafter_master_dtype != "bfloat16":
        bf16_fits = total(with_training(drafter_master_dtype="bfloat16")) <= device_bytes
    # Held-out evaluation holds a whole drafter copy on every rank once the drafter is sharded.
    evaluates = world_size > 1 and evaluates_whole_drafter(plan, drafter_sharded=True)
    without_eval: bool | None = None
    if evaluates and training.fsdp:
        without_eval = total(with_training(**_NO_EVAL)) <= device_bytes
    singles = (anchors, batch, seq_len)
    one_fits = (
        any(
            value is not None and value < planned
            for value, planned in zip(
                singles,
                (draft.objective.num_anchors, training.per_device_train_batch_size, seq),
                strict=True,
            )
        )
        or fsdp_fits is True
        or checkpointing_fits is True
        or bf16_fits is True
        or without_eval is True
    )
    together: tuple[str, ...] = ()
    if not one_fits:
        together = _together(
            plan, device_bytes, world_size, lambda p: total(p), evaluates=evaluates
        )
    return FitAdvice(
        num_anchors=anchors,
        per_device_train_batch_size=batch,
        training_seq_len=seq_len,
        fsdp_fits=fsdp_fits,
        activation_checkpointing_fits=checkpointing_fits,
        bfloat16_master_fits=bf16_fits,
        together=together,
        without_eval_fits=without_eval,
    )


def _together(
    plan: RunPlan,
    device_bytes: int,
    world_size: int,
    total: Callable[[RunPlan], int],
    *,
    evaluates: bool,
) -> tuple[str, ...]:
    """The settings (as recipe lines) that fit together, added one at a time in the order that
    costs the least: sharding (several ranks), recomputing the draft layers, a bfloat16 master,
    no held-out evaluation during training (`evaluates`: it holds a whole drafter copy once the
    drafter is sharded); empty when even all of them do not fit."""
    steps: list[tuple[str, dict[str, object]]] = []
    training = plan.training
    if world_size > 1 and not training.fsdp:
        steps.append(("training.fsdp: true", {"fsdp": True}))
    if not training.activation_checkpointing:
        steps.append(
            ("training.activation_checkpointing: true", {"activation_checkpointing": True})
        )
    if training.drafter_master_dtype != "bfloat16":
        steps.append(
            ("training.drafter_master_dtype: bfloat16", {"drafter_master_dtype": "bfloat16"})
        )
    if evaluates:
        steps.append((_no_eval_line(plan), dict(_NO_EVAL)))
    changes: dict[str, object] = {}
    named: list[str] = []
    for line, change in steps:
        changes.update(change)
        named.append(line)
        candidate = attrs.evolve(plan, training=attrs.evolve(training, **changes))  # type: ignore[arg-type]
        if total(candidate) <= device_bytes:
            return tuple(named)
    return ()


def exceed_message(
    plan: RunPlan, resources: ResourcePlan, device_bytes: int, advice: FitAdvice, *, where: str
) -> tuple[str, str]:
    """The message and hint of a plan that does not fit `device_bytes` per rank."""
    memory = resources.memory
    parts = ", ".join(f"{name} {gib(value)}" for name, value in memory.rows())
    at_eval = ""
    if memory.eval_drafter_copy:
        step = resources.step_memory or memory
        at_eval = (
            " while it measures the held-out acceptance (under training.fsdp every rank holds a "
            f"whole copy of the drafter then; the training step needs {gib(step.total)} GiB)"
        )
    message = (
        f"the plan needs about {gib(memory.total)} GiB per rank on {resources.world_size} "
        f"rank(s){at_eval} ({parts} GiB), more than {where} ({gib(device_bytes)} GiB)"
    )
    fixes = []
    objective, training = plan.draft.objective, plan.training
    if advice.num_anchors is not None and advice.num_anchors < objective.num_anchors:
        fixes.append(f"dflash.dflash_num_anchors: {advice.num_anchors}")
    if (
        advice.per_device_train_batch_size is not None
        and advice.per_device_train_batch_size < training.per_device_train_batch_size
    ):
        fixes.append(f"training.per_device_train_batch_size: {advice.per_device_train_batch_size}")
    if advice.training_seq_len is not None and advice.training_seq_len < training.training_seq_len:
        fixes.append(f"training.training_seq_len: {advice.training_seq_len}")
    if advice.fsdp_fits and not training.fsdp:
        fixes.append(
            f"training.fsdp: true (over {resources.world_size} ranks: the target's decoder "
            "layers, the drafter, its gradients and AdamW states sharded)"
        )
    if advice.activation_checkpointing_fits:
        fixes.append("training.activation_checkpointing: true")
    if advice.bfloat16_master_fits:
        fixes.append("training.drafter_master_dtype: bfloat16")
    if advice.without_eval_fits:
        fixes.append(
            f"{_no_eval_line(plan)} (no held-out evaluation during training; `dflash-recipe "
            "eval` measures the export afterwards)"
        )
    knobs = ["dflash_num_anchors", "per_device_train_batch_size", "training_seq_len"]
    if advice.activation_checkpointing_fits is not None:  # searched: it is off
        knobs.append("activation_checkpointing")
    if advice.bfloat16_master_fits is not None:  # searched: the master is float32
        knobs.append("drafter_master_dtype")
    if advice.fsdp_fits is not None and not training.fsdp:
        knobs.append(f"fsdp (over {resources.world_size} ranks)")
    if advice.without_eval_fits is not None:
        knobs.append("eval_steps")
    copy = " and the held-out evaluation's drafter copy" if memory.eval_drafter_copy else ""
    hint = (
        "any one of these fits (the others as planned): " + "; ".join(fixes)
        if fixes
        else f"no single change of {', '.join(knobs[:-1])} or {knobs[-1]} fits: the weights, "
        f"gradients and optimizer states{copy} alone need "
        f"{gib(memory.total - memory.activations)} GiB with the allowance"
    )
    if advice.together:
        hint += "; these fit together: " + ", ".join(advice.together)
    if memory.eval_drafter_copy:
        hint += (
            f"; or a device with at least {gib(memory.total)} GiB per rank (evaluating less "
            "often or on fewer prompts is no fix: each measurement holds the whole "
            f"{gib(memory.eval_drafter_copy)} GiB copy)"
        )
    if resources.world_size == 1:
        hint += "; or shard the target with training.fsdp: true over several ranks (--world-size N)"
    return message, hint


def _no_eval_line(plan: RunPlan) -> str:
    """The recipe lines that turn held-out evaluation during training off (the gate
    training.eval_min_tau needs it: unset too)."""
    if plan.training.eval_min_tau is None:
        return "training.eval_steps: 0"
    return "training.eval_steps: 0 with training.eval_min_tau: null"


__all__ = ["FitAdvice", "exceed_message", "fit_advice"]
