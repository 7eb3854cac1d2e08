"""Warm start: load an exported drafter into a freshly built ``DFlashDraftModel``, bit-exactly.

The checkpoint is the plan's ``init_checkpoint`` (a local directory with ``model.safetensors``
or shards). Before any tensor byte is read, its header is checked against the layout the plan
describes with the same code and words as ``dflash-recipe compile``
(``dflash_recipes.checkpoint.tensor_layout``), so a mismatch that slipped past compile (the Python
API
called directly, or the directory changed since) raises
:class:`~dflash_recipes.errors.WarmStartError` listing every tensor.

Tensors are streamed one at a time (``safetensors.safe_open``) straight into the existing
parameters: no state dict, no second full copy. A drafter already sharded with FSDP2 reads on
each rank only the rows that rank keeps (the same values, bit for bit, once gathered). A copy
is exact by construction: the parameter's dtype is the checkpoint's, or a wider float that
holds every value of it (BF16/F16 -> F32/F64, F32 -> F64); anything else is refused, because
it would round.

Head variants may start from a plain DFlash checkpoint: head submodules absent from the
checkpoint keep their fresh initialisation (warning names them); a partly present head
submodule is an error.

A checkpoint in another known layout (``dflash_recipes.checkpoint.known_layouts``: the
MuseGlimmer assistant's ``encoder.*`` fusion tensors, a DSpark head under ``markov_head.``) is
read under the z-lab names by the compiler's table, so it loads and exports like a z-lab one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs
import torch
from safetensors import safe_open
from torch import nn

from dflash_recipes.checkpoint.known_layouts import canonical_weights, stored_name
from dflash_recipes.checkpoint.tensor_layout import (
    LayoutSpec,
    Shape,
    checkpoint_dims,
    compare_layout,
    expected_layout,
    format_layout_diff,
    format_partial_heads,
    head_presence,
    head_submodules,
    layout_fixes,
    layout_spec_for,
)
from dflash_recipes.checkpoint.weight_index import CheckpointWeights, read_checkpoint_weights
from dflash_recipes.errors import CheckpointError, PlanError, WarmStartError
from dflash_recipes.executor.model.shard_reads import local_part, read_local
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.records import Record

logger = logging.getLogger(__name__)

#: Safetensors dtype names -> torch dtypes (those a drafter can hold).
SAFETENSORS_DTYPES: Mapping[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

# (checkpoint dtype, parameter dtype) pairs whose conversion preserves every value exactly.
_EXACT_WIDENING: frozenset[tuple[torch.dtype, torch.dtype]] = frozenset(
    {
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float64),
        (torch.float16, torch.float32),
        (torch.float16, torch.float64),
        (torch.float32, torch.float64),
    }
)


@attrs.frozen(repr=False, eq=False, slots=False)
class WarmStartReport(Record):
    """What a warm start loaded."""

    checkpoint: str
    weight_files: tuple[str, ...]
    tensors_loaded: int
    #: Safetensors dtypes of the loaded tensors, sorted (e.g. ("BF16",)).
    dtypes: tuple[str, ...]
    #: Head submodules absent from the checkpoint: they keep their fresh initialisation.
    heads_from_scratch: tuple[str, ...]
    #: The warnings that were logged (degraded warm start, heads from scratch).
    warnings: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line: checkpoint, tensors loaded, dtype, heads trained from scratch."""
        return (
            f"warm start from {self.checkpoint}: {self.tensors_loaded} tensors loaded "
            f"({', '.join(self.dtypes)}); heads trained from scratch: "
            f"{', '.join(self.heads_from_scratch) or 'none'}"
        )


def layout_spec(spec: ResolvedDraft) -> LayoutSpec:
    """The layout description of a resolved drafter (what decides its tensor names/shapes)."""
    return layout_spec_for(
        spec,
        hidden_size=spec.hidden_size,
        n_taps=len(spec.target_layer_ids),
        vocab_size=spec.vocab_size,
    )


def _heads_from_scratch(
    plan: RunPlan, lspec: LayoutSpec, found: Mapping[str, Shape]
) -> tuple[str, ...]:
    """The head submodules the compiler decided start from scratch (the plan says so).

    A plan compiled without reading the checkpoint's header (``tensor_count`` unset) has no
    decision to read; then the checkpoint's header decides, by the same rule as the compiler.
    A partly present head is an error either way.
    """
    presence = head_presence(lspec, found)
    if presence.partial:
        raise WarmStartError(format_partial_heads(presence))
    init = plan.init_checkpoint
    if init is not None and init.tensor_count is not None:
        return tuple(init.heads_from_scratch)
    return presence.absent


def _torch_dtype(name: str, tensor: str) -> torch.dtype:
    try:
        return SAFETENSORS_DTYPES[name]
    except KeyError:
        msg = f"checkpoint tensor {tensor} has dtype {name}, which a drafter cannot hold"
        raise WarmStartError(msg) from None


def load_exact_weights(drafter: nn.Module, weights: CheckpointWeights, *, mismatch: str) -> int:
    """Stream `weights` into `drafter` after checking names, shapes and exact dtypes.

    For saved drafters (training checkpoints, exports) that must match the module exactly:
    a layout difference raises CheckpointError with `mismatch` and the grouped tensor list.
    Returns the number of tensors copied.
    """
    own = drafter.state_dict(keep_vars=True)
    weights = _known_layout(weights, error=CheckpointError)
    diff = compare_layout({name: tuple(t.shape) for name, t in own.items()}, weights.shapes)
    if not diff.is_empty:
        msg = f"{mismatch}:\n" + format_layout_diff(diff)
        raise CheckpointError(msg)
    for name, info in weights.tensors.items():
        source = SAFETENSORS_DTYPES.get(info.dtype)
        if source is None:
            msg = (
                f"{weights.directory}: tensor {name} has dtype {info.dtype}, which a drafter "
                "cannot hold"
            )
            raise CheckpointError(msg)
        check_exact_copy(name, source, own[name].dtype, error=CheckpointError)
    return stream_tensors(drafter, weights, list(weights.tensors))


def check_exact_copy(
    name: str,
    source: torch.dtype,
    target: torch.dtype,
    *,
    error: type[CheckpointError] = WarmStartError,
) -> None:
    """Raise ``error`` unless copying ``source`` values into ``target`` keeps them exactly."""
    if source == target or (source, target) in _EXACT_WIDENING:
        return
    msg = (
        f"checkpoint tensor {name} is {source} but the drafter parameter is {target}: the copy "
        "would round; load the checkpoint before casting the module (convert does this)"
    )
    raise error(msg)


def stream_tensors(module: nn.Module, weights: CheckpointWeights, names: Iterable[str]) -> int:
    """Copy the checkpoint tensors ``names`` into ``module``'s same-named tensors, one at a time.

    Shapes and dtypes must already be checked (:func:`check_exact_copy`). A module sharded with
    FSDP2 (its parameters DTensors, on meta or not: materialise them first with ``to_empty``)
    gets on each rank only the rows that rank holds, read from the file without the rest
    (:func:`~dflash_recipes.executor.model.shard_reads.read_local`). Returns the count.
    """
    targets = module.state_dict(keep_vars=True)
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(weights.tensor_files[name], []).append(name)
    loaded = 0
    with torch.no_grad():
        for file_name in weights.weight_files:
            wanted = by_file.get(file_name)
            if not wanted:
                continue
            path = weights.directory / file_name
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in wanted:
                    # a sharded drafter's parameter (a DTensor) reads only its own rows
                    source = read_local(handle, stored_name(weights, name), targets[name])
                    local_part(targets[name]).copy_(source)
                    del source
                    loaded += 1
    return loaded


def _known_layout(weights: CheckpointWeights, *, error: type[CheckpointError]) -> CheckpointWeights:
    """`weights` under the z-lab names (the compiler's table of known layouts); a clash of two
    stored tensors on one name raises `error`."""
    renamed, reading = canonical_weights(weights)
    if reading.clashes:
        msg = (
            f"{weights.directory}: two stored tensors would load into the same drafter "
            f"parameter (names of two known layouts mixed):\n{reading.format_clashes()}"
        )
        raise error(msg)
    if reading.renamed:
        logger.info("%s: read in the known layout %s", weights.directory, reading.describe())
    return renamed


def _init_directory(plan: RunPlan) -> Path:
    init = plan.init_checkpoint
    if init is None:
        msg = "the run plan has no init_checkpoint (dflash.dflash_init_checkpoint is null)"
        raise PlanError(msg)
    directory = Path(init.path)
    if not directory.is_dir():
        msg = (
            f"dflash_init_checkpoint {directory} does not exist or is not a directory; it must be "
            "a local directory holding an exported drafter (model.safetensors + config.json). "
            f"Hub ids are not fetched: stage it first with `hf download <repo> --local-dir "
            f"{directory}`"
        )
        raise CheckpointError(msg)
    return directory


def load_init_checkpoint(module: nn.Module, plan: RunPlan) -> WarmStartReport:
    """Warm-start ``module`` (a DFlashDraftModel built from ``plan``) from the init checkpoint.

    Raises CheckpointError for a missing or unreadable directory and WarmStartError for a
    layout or dtype mismatch (nothing is copied then). Logs the degraded-start warnings and one
    INFO line: checkpoint, tensors loaded, dtype, heads trained from scratch. The warnings are
    the plan's (``init_checkpoint.warnings``, what the compiler said), not decided here.
    """
    directory = _init_directory(plan)
    spec = plan.resolved_draft()
    lspec = layout_spec(spec)
    expected = expected_layout(lspec)
    own = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    if own != expected:
        diff = compare_layout(expected, own)
        msg = (
            "the module is not the drafter this plan describes; build it with "
            "DFlashDraftModel(plan.resolved_draft()):\n" + format_layout_diff(diff)
        )
        raise WarmStartError(msg)

    weights = _known_layout(read_checkpoint_weights(directory), error=WarmStartError)
    found = weights.shapes
    from_scratch = _heads_from_scratch(plan, lspec, found)
    # A submodule's tensors by the kind's grouping: DFlash 2's convolutions live inside the
    # layers (layers.0.attention_conv.base_kernel belongs to attention_conv).
    groups = head_submodules(lspec)
    fresh = {name for module in from_scratch for name in groups.get(module, ())}
    wanted = {n: s for n, s in expected.items() if n not in fresh}
    diff = compare_layout(wanted, found)
    if not diff.is_empty:
        # The compiler's words (its CHECKPOINT_LAYOUT_MISMATCH message), then the fixes.
        config = plan.init_checkpoint
        fixes = "".join(
            f"\nfix: {fix}"
            for fix in layout_fixes(
                lspec,
                checkpoint_dims(None, found),
                found,
                stated_taps=config.target_layer_ids if config is not None else None,
            )
        )
        msg = f"{format_layout_diff(diff)}\n(checkpoint: {weights.directory}){fixes}"
        raise WarmStartError(msg)

    params = module.state_dict(keep_vars=True)
    for name in wanted:
        source = _torch_dtype(weights.tensors[name].dtype, name)
        check_exact_copy(name, source, params[name].dtype)

    # What the compiler warned about this warm start (a degraded start, heads from scratch),
    # said again where it happens; a plan that never read the header has only the header's word.
    init = plan.init_checkpoint
    warnings = list(init.warnings) if init is not None else []
    if from_scratch and (init is None or init.tensor_count is None):
        warnings.append(
            "head submodules absent from the init checkpoint train from scratch: "
            + ", ".join(from_scratch)
        )
    for text in warnings:
        logger.warning(text)

    loaded = stream_tensors(module, weights, wanted)
    report = WarmStartReport(
        checkpoint=str(directory),
        weight_files=tuple(weights.weight_files),
        tensors_loaded=loaded,
        dtypes=tuple(sorted({weights.tensors[n].dtype for n in wanted})),
        heads_from_scratch=tuple(from_scratch),
        warnings=tuple(warnings),
    )
    logger.info("%s", report.describe())
    return report


def warm_start(module: nn.Module, plan: RunPlan) -> WarmStartReport | None:
    """The plan's warm start of a fresh drafter: :func:`load_init_checkpoint` when the plan
    has an init checkpoint and is not a resume; None (nothing loaded) otherwise."""
    if plan.init_checkpoint is None or plan.resume is not None:
        return None
    return load_init_checkpoint(module, plan)


__all__ = [
    "SAFETENSORS_DTYPES",
    "WarmStartReport",
    "check_exact_copy",
    "layout_spec",
    "load_exact_weights",
    "load_init_checkpoint",
    "stream_tensors",
    "warm_start",
]
