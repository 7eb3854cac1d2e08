"""Memory per rank by part, and held-out evaluation's share of it under ``training.fsdp``.

A run's peak per rank is the larger of two phases: the training step
(:func:`~dflash_recipes.plan.resources.estimate.estimate_resources`), and, when the drafter is
sharded over several ranks and the run measures held-out acceptance, that measurement (issue 51).
Every rank then measures in step on an unsharded copy of the drafter
(:mod:`~dflash_recipes.executor.training.eval_policy`,
:func:`~dflash_recipes.executor.sharded_drafter.whole_drafter`): one whole drafter in its
master dtype (the sharded parameters' dtype), built with its parameters on meta and given each
all-gathered tensor as it arrives, so at most one tensor is in flight beside it. The rank still
holds what training left: the target's and the drafter's shards, AdamW's moments and the
drafter's sharded gradients (the trainer sets them to None at the start of the next step,
``zero_grad(set_to_none=True)``, not before evaluation). Evaluation's activations, as counted: the
larger of that tensor in flight and the two decoder layers FSDP2 gathers while the sharded
target forwards. Not counted: the prompts' own KV cache and forwards, whose lengths are the
data's (the target's cache takes ``2 x layers x kv_heads x head_dim`` bytes of its dtype per
token: 0.31 MiB for a Llama-70B, so 0.63 GiB for a 2,048-token prompt).

How often evaluation runs (``training.eval_steps``) or on how many prompts does not change that
peak: each measurement holds the whole copy. What lowers it: no held-out evaluation during
training (``training.eval_steps: 0``; ``dflash-recipe eval`` measures the export afterwards), a
bfloat16 master (half the copy), or a device with more memory.
"""

from __future__ import annotations

import attrs

from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.records import Record

#: How :meth:`MemoryPerRank.rows` (the advice's breakdown) names the copy (issue 51).
EVAL_COPY = "held-out eval: whole drafter copy"
#: CUDA context, cuBLAS/NCCL workspaces and the compiled kernels' buffers, per rank.
CUDA_CONTEXT_BYTES = 3 * 2**30 // 2
#: Share of the activations added for the caching allocator's fragmentation (CUDA only).
FRAGMENTATION = 0.10


@attrs.frozen(repr=False, eq=False, slots=False)
class MemoryPerRank(Record):
    """Bytes one rank holds at the peak of a phase (a training step, or held-out evaluation),
    by part."""

    target_weights: int
    drafter_weights: int
    #: The gradients alive at the peak (none at the end of a lone micro-step's forward).
    gradients: int
    optimizer_states: int
    #: The activations of the peak phase.
    activations: int
    allowance: int
    #: The whole drafter copy held-out evaluation gathers on every rank under training.fsdp
    #: (0: the peak is the training step's).
    eval_drafter_copy: int = 0

    @property
    def total(self) -> int:
        """Every part together."""
        return sum(value for _, value in self.rows())

    def rows(self) -> tuple[tuple[str, int], ...]:
        """The parts as the table and the advice name them, in order (the eval copy only at an
        evaluation peak)."""
        copy = ((EVAL_COPY, self.eval_drafter_copy),) if self.eval_drafter_copy else ()
        return (
            ("target weights", self.target_weights),
            ("drafter weights", self.drafter_weights),
            ("gradients", self.gradients),
            ("optimizer states", self.optimizer_states),
            *copy,
            ("activations", self.activations),
            ("allowance", self.allowance),
        )


def allowance(activations: int, *, cuda: bool) -> int:
    """The stated margin of a phase: the CUDA context and the allocator's fragmentation (none on
    the CPU)."""
    return CUDA_CONTEXT_BYTES + int(FRAGMENTATION * activations) if cuda else 0


def evaluates_whole_drafter(plan: RunPlan, *, drafter_sharded: bool) -> bool:
    """Whether every rank measures held-out acceptance on a whole copy of the drafter: it is
    sharded (`drafter_sharded`: training.fsdp over several ranks) and the run measures, as
    ``EvalPolicy.due`` decides (eval data, and training.eval_steps or the final measurement
    training.eval_min_tau asks for)."""
    training = plan.training
    planned = training.eval_steps is not None or training.eval_min_tau is not None
    return drafter_sharded and plan.data.has_eval_data and planned


@attrs.frozen(repr=False, eq=False, slots=False)
class EvalParts(Record):
    """What held-out evaluation of a sharded drafter adds on a rank (bytes)."""

    #: The whole drafter in the master dtype.
    drafter_copy: int
    #: While the copy is built: one gathered tensor in flight (the largest, padded as FSDP2 pads).
    in_flight: int
    #: While the sharded target forwards: its two gathered decoder layers.
    target_gathered: int

    @property
    def activations(self) -> int:
        """Evaluation's activations as counted: the larger of the two transients."""
        return max(self.in_flight, self.target_gathered)


def eval_phase(
    step: MemoryPerRank, parts: EvalParts, *, gradients: int, cuda: bool
) -> MemoryPerRank:
    """Held-out evaluation's memory per rank beside `step`'s (the training step's): the same
    weights and AdamW states, this rank's sharded `gradients`, the whole drafter copy and
    evaluation's activations (`parts`)."""
    return attrs.evolve(
        step,
        gradients=gradients,
        activations=parts.activations,
        allowance=allowance(parts.activations, cuda=cuda),
        eval_drafter_copy=parts.drafter_copy,
    )


__all__ = [
    "CUDA_CONTEXT_BYTES",
    "EVAL_COPY",
    "FRAGMENTATION",
    "EvalParts",
    "MemoryPerRank",
    "allowance",
    "eval_phase",
    "evaluates_whole_drafter",
]
