"""The models builder: the frozen target, the drafter on it, its warm start, and the step module.

:func:`build_models` checks that the plan fits the device, loads the target (without its
decoder when training offline and nothing needs it; with ``training.fsdp`` on several ranks
built on meta and read shard by shard, :mod:`~dflash_recipes.executor.model.meta_load`),
attaches the drafter, warm-starts it from
``dflash_init_checkpoint`` on a fresh run (a resume restores it later), shards the target over
the ranks (``training.fsdp``) or moves it to the device, proves on it that a packed row keeps
its conversations apart (``data.packing``: one short forward, logged; a target that leaks
stops the run here, before any step), and builds the
:class:`~dflash_recipes.executor.training.step.DraftStep` the loop calls.

On several ranks the drafter is either replicated or sharded:

- ``training.fsdp: false``: the step is wrapped in DDP after the resume
  (:meth:`Models.wrap_for_ranks`), so a restored drafter is the one wrapped; every rank holds
  the whole drafter, its gradients and AdamW's moments.
- ``training.fsdp: true``: the drafter is sharded with FSDP2 here, before the optimizer is
  built over its sharded parameters (:mod:`~dflash_recipes.executor.sharded_drafter`); the
  resume then loads each rank's part, and checkpoints are sharded
  (:mod:`~dflash_recipes.executor.model.sharded_state`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import attrs
from torch import nn
from transformers import PreTrainedModel

from dflash_recipes.checkpoint.kinds.registry import needs_teacher
from dflash_recipes.executor.data.offline import load_target_without_decoder
from dflash_recipes.executor.dist_env import DistEnv, is_main
from dflash_recipes.executor.model.convert import (
    ConvertedModel,
    convert,
    dflash_module,
    lm_head,
    load_base_model,
)
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.meta_load import (
    load_target_on_meta,
    materialize_target,
    parameters_on_meta,
)
from dflash_recipes.executor.model.target_states import check_packed_isolation
from dflash_recipes.executor.model.warmstart import WarmStartReport, warm_start
from dflash_recipes.executor.parallel_wrappers import shard_target_fsdp2, wrap_ddp
from dflash_recipes.executor.sharded_drafter import fill_from_rank0, shard_drafter_fsdp2
from dflash_recipes.executor.training.setup.device_memory import check_device_memory
from dflash_recipes.executor.training.setup.precision import autocast_dtype, master_dtype
from dflash_recipes.executor.training.step import DraftStep
from dflash_recipes.plan.run_plan import RunPlan

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class Models:
    """The target with its drafter, and the step module the loop calls."""

    #: The frozen target with the drafter attached (``target.dflash_module``).
    target: ConvertedModel
    drafter: DFlashDraftModel
    #: The step module: DDP-wrapped on several ranks once :meth:`wrap_for_ranks` has run
    #: (the FSDP2 root instead when the drafter is sharded).
    step: nn.Module
    #: The drafter's parameters that train (the optimiser's; DTensors when sharded).
    trainable: list[nn.Parameter]
    #: What the warm start loaded (None: a resume, or no init checkpoint).
    warm: WarmStartReport | None
    distributed: bool
    #: The drafter is sharded over the ranks with FSDP2 (``training.fsdp`` on several ranks).
    sharded: bool = False

    def wrap_for_ranks(self, env: DistEnv) -> None:
        """Wrap the step module in DDP (no-op for a single process or a sharded drafter);
        after the resume."""
        if not self.sharded:
            self.step = wrap_ddp(self.step, env)

    def gradient_sync(self, *, last_micro_batch: bool) -> AbstractContextManager[object]:
        """No gradient reduction for every micro-batch but the last of an optimiser step:
        DDP's ``no_sync``, or FSDP2's ``set_requires_gradient_sync(False)``."""
        if last_micro_batch or not self.distributed:
            return nullcontext()
        if self.sharded:
            return _fsdp_no_sync(self.step)
        return self.step.no_sync()  # type: ignore[operator, no-any-return]

    def training_modes(self) -> None:
        """Frozen target in eval mode, drafter in train mode (set once, again after an eval)."""
        self.target.train(False)
        self.drafter.train(True)


def build_models(
    plan: RunPlan,
    env: DistEnv,
    *,
    offline: bool,
    warm: bool,
    max_chunk_logits: int | None,
    skip_memory_check: bool = False,
    loaded_target: PreTrainedModel | None = None,
) -> Models:
    """Load and place the target and the drafter as the plan says.

    `offline`: the target's states come from a capture, so its decoder is loaded only when a
    measured evaluation needs it. `warm`: a fresh run (warm-start the drafter); a resume
    restores the drafter's weights afterwards instead. `max_chunk_logits` bounds the logits one
    chunk of blocks holds (None: the step's default). `skip_memory_check`: a plan the estimate
    says will not fit is warned about, not refused (``run --skip-memory-check``). `loaded_target`:
    the frozen target already in memory (the drafter is attached to it), instead of loading it.
    """
    training = plan.training
    # Offline, the decoder runs only for measured evaluation (speculative decoding needs it).
    needs_decoder = not offline or (training.eval_steps is not None and plan.data.has_eval_data)
    # Every rank, before minutes of loading the target: refuse what cannot fit.
    check_device_memory(
        plan,
        device=env.device,
        world_size=env.world_size,
        log=is_main(env),
        skip=skip_memory_check,
    )
    # training.fsdp on several ranks shards both models (and loads the target on meta).
    sharded = training.fsdp and env.is_distributed
    if loaded_target is not None:
        base = loaded_target
    elif needs_decoder and sharded:
        # No full copy per process: the decoder layers stay on meta until they are sharded.
        base = load_target_on_meta(plan)
    else:
        base = load_base_model(plan) if needs_decoder else load_target_without_decoder(plan)
    # A sharded drafter is built whole on rank 0 only (initialised and warm-started there); the
    # other ranks build it on meta and receive their parts once it is sharded: a node holds one
    # whole drafter, not one per rank.
    on_meta = sharded and not is_main(env)
    with parameters_on_meta() if on_meta else nullcontext():
        target = convert(base, plan, init=False)
    drafter = dflash_module(target)
    # Before anything moves the drafter, so the loaded values are the checkpoint's.
    report = warm_start(drafter, plan) if warm and not on_meta else None
    if sharded:
        # Shard before moving: each decoder layer reaches the device already sharded.
        shard_target_fsdp2(target, env)
        if loaded_target is None:  # each rank reads the rows it keeps
            materialize_target(target, plan, env.device)
    else:
        nn.Module.to(target, env.device)
    if plan.data.packing and not offline:
        # Before any step: a packed row of two conversations must give each the states it gets
        # alone, on this very target (every rank runs it: a sharded target forwards together).
        isolation = check_packed_isolation(
            target,
            plan.resolved_draft().target_layer_ids,
            with_logits=needs_teacher(drafter.spec.projector_type, plan.draft.objective),
            limit=training.training_seq_len,
        )
        if is_main(env):
            logger.info("%s", isolation.describe())
    # The drafter's master weights in training.drafter_master_dtype (float32 by default); the
    # frozen target keeps the plan dtype.
    drafter.to(master_dtype(plan))
    drafter.activation_checkpointing = training.activation_checkpointing
    step = DraftStep(
        drafter, lm_head(target), plan.draft.objective, max_chunk_logits=max_chunk_logits
    )
    if sharded:  # before the optimizer: sharding replaces every parameter
        whole = None if on_meta else {n: p.detach() for n, p in drafter.named_parameters()}
        shard_drafter_fsdp2(
            step,
            drafter.layers,
            env,
            param_dtype=autocast_dtype(env.device.type, plan.base_model.dtype),
        )
        fill_from_rank0(step, drafter, whole, env)
        del whole
    return Models(
        target=target,
        drafter=drafter,
        step=step,
        trainable=[p for p in drafter.parameters() if p.requires_grad],
        warm=report,
        distributed=env.is_distributed,
        sharded=sharded,
    )


@contextmanager
def _fsdp_no_sync(step: nn.Module) -> Iterator[None]:
    """FSDP2 keeps this micro-batch's gradients unreduced (accumulated whole) for the body."""
    step.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        step.set_requires_gradient_sync(True)  # type: ignore[operator]


__all__ = ["Models", "build_models"]
