"""What a drafter kind declares, torch-free: :class:`KindFacts`, and the settings it reads.

A drafter kind is a ``projector_type`` (``dflash``, ``domino``, ``dspark``, ``dflash2``). It has
two halves, each a module named after the kind:

- ``dflash_recipes/checkpoint/kinds/<kind>.py``: its torch-free facts (a :class:`KindFacts`):
  the tensors it adds to the backbone, the recipe fields it needs, its ``config.json`` fields,
  the checkpoint and recipe fields it checks, whether its objective reads the target's logits,
  its label alignment, what its head adds to the resource estimate. The compiler, the plan,
  the run directory's files and ``dflash-recipe init`` read these (never torch).
- ``dflash_recipes/executor/kinds/<kind>.py``: its torch parts (a
  :class:`~dflash_recipes.executor.kinds.protocol.KindModules`): head modules, objective,
  eval proposals (greedy, or drawn for sampled verification).

Each half is registered by name in its registry (:mod:`~dflash_recipes.checkpoint.kinds.
registry`, :mod:`~dflash_recipes.executor.kinds.registry`); nothing else compares a
``projector_type`` with a kind's name (``tests/test_architecture.py`` enforces it).

The hooks read the drafter's settings through small protocols (:class:`LayoutSettings`,
:class:`HeadSettings`, :class:`ObjectiveSettings`): a recipe section, a plan part, a
``LayoutSpec`` and a ``ResolvedDraft`` all satisfy them, so this layer imports none of them. A
kind with new settings adds them to the recipe section, the plan and these protocols.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Protocol

import attrs

from dflash_recipes.records import Record

#: A tensor shape, as a safetensors header states it.
Shape = tuple[int, ...]

#: A value of an exported ``config.json``.
JsonValue = str | int | float | bool | None | list["JsonValue"] | dict[str, "JsonValue"]


class LayoutSettings(Protocol):
    """What a kind's tensor layout reads (a ``LayoutSpec`` provides it)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def vocab_size(self) -> int | None: ...
    @property
    def emb_dim(self) -> int | None: ...
    @property
    def gru_hidden_dim(self) -> int | None: ...
    @property
    def markov_rank(self) -> int | None: ...
    @property
    def use_confidence_head(self) -> bool: ...
    @property
    def markov_head_type(self) -> str: ...
    @property
    def conv_kernel_size(self) -> int | None: ...
    @property
    def conv_group_size(self) -> int | None: ...
    @property
    def selector_rank(self) -> int | None: ...


class AlignmentSettings(Protocol):
    """How a head's block positions are trained (the recipe's or the plan's fields)."""

    @property
    def shift_label(self) -> bool: ...
    @property
    def pure_draft_prefix_len(self) -> int: ...
    @property
    def markov_head_type(self) -> str: ...


class HeadSettings(AlignmentSettings, Protocol):
    """A drafter's kind settings: the recipe's ``dflash_architecture_config``, the plan's
    architecture or its ``ResolvedDraft``."""

    @property
    def emb_dim(self) -> int | None: ...
    @property
    def gru_hidden_dim(self) -> int | None: ...
    @property
    def markov_rank(self) -> int | None: ...
    @property
    def use_confidence_head(self) -> bool: ...
    @property
    def conv_kernel_size(self) -> int | None: ...
    @property
    def conv_group_size(self) -> int | None: ...
    @property
    def selector_rank(self) -> int | None: ...
    @property
    def selector_top_k(self) -> int | None: ...
    @property
    def output_multiplier(self) -> float | None: ...
    @property
    def final_logit_softcapping(self) -> float | None: ...
    @property
    def input_embedding_scale(self) -> float | None: ...


class ObjectiveSettings(Protocol):
    """The objective's settings a kind's teacher rule reads (the plan's ``ObjectivePlan``, or an
    :class:`ObjectiveTerms` built from the recipe)."""

    @property
    def self_logit_distillation(self) -> bool: ...
    @property
    def dspark_tv_weight(self) -> float: ...


@attrs.frozen(repr=False, eq=False, slots=False)
class ObjectiveTerms(Record):
    """:class:`ObjectiveSettings` for a caller that holds the recipe's fields, not a plan."""

    self_logit_distillation: bool
    dspark_tv_weight: float


class StatedHead(Protocol):
    """What a checkpoint's config.json states about its head (``hfconfig``'s parsed config)."""

    @property
    def use_confidence_head(self) -> bool | None: ...


@attrs.frozen(repr=False, eq=False, slots=False)
class KindFinding(Record):
    """A finding of a kind's rule about one field; the compiler emits it as a diagnostic.

    `code` is a code registered in the compiler (its severity comes from the registry).
    """

    code: str
    #: The recipe field under ``dflash.dflash_architecture_config``.
    field: str
    message: str
    hint: str


class KindFacts(Protocol):
    """The torch-free half of a drafter kind (module doc); one instance per kind module."""

    #: The ``projector_type`` value.
    name: str
    #: Head sizes (recipe names under dflash_architecture_config) the kind needs set.
    head_fields: tuple[str, ...]
    #: What each head size means, for messages.
    field_meaning: Mapping[str, str]
    #: Switches (recipe booleans) that only this kind reads; set for another kind they warn.
    switch_fields: tuple[str, ...]
    #: The :class:`LayoutSettings` a layout of this kind cannot be built without.
    layout_needs: tuple[str, ...]
    #: Whether ``shift_label`` applies: block position k predicts anchor + k + 1 (ModelOpt's
    #: labels for a head) when it is true. False: position k predicts anchor + k.
    shifts_labels: bool
    #: Tensor-name prefixes that only a checkpoint of this kind holds (``dflash-recipe init``
    #: tells the kind of a checkpoint whose config.json does not state it).
    marker_prefixes: tuple[str, ...]
    #: float32 copies of a chunk's ``[blocks, K, vocab]`` logits the head's objective keeps
    #: beyond the plain loss's (the resource estimate's rough count).
    loss_logit_copies: int
    #: The name of the head the kind adds to the DFlash backbone (a model card's tag and title),
    #: or None for a drafter without one.
    head_name: str | None
    #: Recipe fields (under dflash_architecture_config, named as the checkpoint's
    #: ``dflash_config`` keys) that, left unset, are taken from the init checkpoint's
    #: ``dflash_config`` (an info each); a recipe value the checkpoint contradicts is an error.
    inherited_fields: tuple[str, ...]
    #: Those of :attr:`inherited_fields` that must have a value, from the recipe or the
    #: checkpoint (``head-field-missing`` otherwise).
    required_fields: tuple[str, ...]
    #: Whether this version's executor trains the kind (its torch half is registered). False:
    #: :meth:`recipe_findings` ends a compile of the kind with one ``<name>-not-yet`` error.
    trains: bool
    #: The objective's settings (``ObjectivePlan`` fields) that only this kind's loss reads,
    #: named with their values on a model card's Objective line.
    objective_fields: tuple[str, ...]
    #: Whether the kind's ``sliding_attention`` layers are causal inside the block (DFlash 1
    #: drafters, as engines run them without ``is_causal: false``) or see the whole block
    #: (DFlash 2, whose releases state ``is_causal: false``); the window cuts the context.
    sliding_causal: bool
    #: Whether evaluation also measures tau of the backbone's own greedy proposals, the head
    #: switched off (DFlash 2: the unary argmax path beside the selector's), so users see what
    #: the head buys.
    eval_without_head: bool
    #: What happens to head submodules the init checkpoint lacks, after their names in the
    #: ``heads-from-scratch`` warning ("will train from scratch").
    fresh_start: str

    def layout(self, spec: LayoutSettings) -> dict[str, Shape]:
        """The kind's tensors beyond the DFlash backbone: name -> shape (empty for DFlash)."""
        ...

    def tensor_groups(self, spec: LayoutSettings) -> dict[str, tuple[str, ...]]:
        """The kind's submodules -> their tensors: each loads whole or trains from scratch."""
        ...

    def infer_dims(self, found: Mapping[str, Shape]) -> dict[str, int]:
        """The kind's sizes (recipe names, and vocab_size) that tensor shapes show."""
        ...

    def describe(self, draft: HeadSettings) -> str:
        """The head as it drafts, in words (``dflash (no head)``)."""
        ...

    def export_config(
        self, draft: HeadSettings, config: dict[str, JsonValue]
    ) -> dict[str, JsonValue]:
        """The exported ``config.json``: `config` (every kind's common fields, in order) with
        the kind's own fields added (top level and ``dflash_config``)."""
        ...

    def serving_warnings(self, draft: HeadSettings) -> list[str]:
        """Why no serving engine computes what this drafter computes (empty when one does)."""
        ...

    def needs_teacher(self, objective: ObjectiveSettings) -> bool:
        """Whether the kind's own loss terms read the target's logits (self-distillation aside:
        :func:`~dflash_recipes.checkpoint.kinds.registry.needs_teacher` is the whole rule)."""
        ...

    def recipe_findings(self, arch: HeadSettings, block_size: int) -> list[KindFinding]:
        """The kind's own checks of the recipe's settings (compile)."""
        ...

    def checkpoint_findings(
        self, nested: Mapping[str, object], recipe: AlignmentSettings
    ) -> list[KindFinding]:
        """An init checkpoint's ``dflash_config`` fields against the recipe's head (compile)."""
        ...

    def settings_findings(
        self, settings: Mapping[str, object], *, hidden: int, vocab: int, block_size: int
    ) -> list[KindFinding]:
        """The rules of the kind's :attr:`inherited_fields` (resolved: the recipe's, else the
        checkpoint's; None where neither states one) against the target and the block."""
        ...

    def trained_for(
        self, where: str, nested: Mapping[str, object], draft: HeadSettings
    ) -> tuple[str, bool] | None:
        """(one line, whether the plan differs) when the checkpoint `where` was trained for
        another alignment than `draft`, or for the one earlier exports used; else None."""
        ...

    def starter_fields(
        self, stated: StatedHead, tensors: Collection[str]
    ) -> dict[str, tuple[object, str]]:
        """Recipe fields beyond the head sizes that ``dflash-recipe init`` reads from a
        checkpoint of this kind: name -> (value, where it comes from)."""
        ...


def group_by_submodule(names: Collection[str]) -> dict[str, tuple[str, ...]]:
    """Tensor names grouped by their top-level submodule (``markov_w1.weight`` -> markov_w1)."""
    groups: dict[str, tuple[str, ...]] = {}
    for name in names:
        module = name.split(".", 1)[0]
        groups[module] = (*groups.get(module, ()), name)
    return groups


def with_kind_fields(
    config: dict[str, JsonValue],
    *,
    top: Mapping[str, JsonValue] | None = None,
    nested: Mapping[str, JsonValue] | None = None,
) -> dict[str, JsonValue]:
    """`config` with `top` after its top-level ``block_size`` and `nested` at the end of its
    ``dflash_config`` (where the exports of every kind have always put them); a new dict."""
    result: dict[str, JsonValue] = {}
    for key, value in config.items():
        if key == "dflash_config" and isinstance(value, dict):
            value = {**value, **(nested or {})}
        result[key] = value
        if key == "block_size":
            result.update(top or {})
    return result


def dim(found: Mapping[str, Shape], name: str, rank: int, axis: int) -> int | None:
    """``found[name][axis]`` when the tensor has `rank` dims and a positive size there."""
    shape = found.get(name)
    if shape is None or len(shape) != rank or shape[axis] <= 0:
        return None
    return int(shape[axis])


__all__ = [
    "AlignmentSettings",
    "HeadSettings",
    "JsonValue",
    "KindFacts",
    "KindFinding",
    "LayoutSettings",
    "ObjectiveSettings",
    "ObjectiveTerms",
    "Shape",
    "StatedHead",
    "dim",
    "group_by_submodule",
    "with_kind_fields",
]
