"""DFlash 2 (``DFlash2DraftModel``, ``projector_type: dflash2``), torch-free.

What DFlash 2 adds to the DFlash backbone (docs/dflash.md, "DFlash 2"): per
layer a grouped dynamic causal convolution on both sides of attention (``attention_conv``) and
of the MLP (``mlp_conv``), each a ``base_kernel`` ``[2, K, H]`` and a ``kernel_projection``
``[2 * K * H / group, H]``; one ``candidate_selector`` with a ``hidden_projection``
``[rank, H]`` and two codebooks ``[vocab, rank]`` stored without a ``.weight`` suffix, as z-lab
releases them (81 tensors for 5 layers, 23 of them new). Its four ``dflash_config`` keys
(:data:`NEW_CONFIG_KEYS`) and three optional ones are recipe fields of the same names; left
unset they are taken from a DFlash 2 init checkpoint (``inherited_fields``). The rules they
obey: ``conv_group_size`` divides the hidden size, ``1 <= conv_kernel_size <= block_size``,
``1 <= selector_top_k <= vocab`` (:func:`config_problems`, :meth:`DFlash2Facts.settings_findings`).

A DFlash 1 checkpoint warm-starts the backbone; the convolutions start as the identity and the
successor codebook at zero, so the drafter first computes what the DFlash 1 one did.

The torch half (the convolution, the selector and its loss; not yet registered, so compile ends
a DFlash 2 recipe with ``dflash2-not-yet``): :mod:`dflash_recipes.executor.kinds.dflash2`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

from dflash_recipes.checkpoint.kinds.protocol import (
    AlignmentSettings,
    HeadSettings,
    JsonValue,
    KindFinding,
    LayoutSettings,
    ObjectiveSettings,
    Shape,
    StatedHead,
    dim,
    with_kind_fields,
)

#: The ``dflash_config`` keys DFlash 2 adds, each required by vLLM's loader.
NEW_CONFIG_KEYS: tuple[str, ...] = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
)

#: Optional ``dflash_config`` keys of DFlash 2 (absent: 1.0, no soft cap, 1.0).
OPTIONAL_CONFIG_KEYS: tuple[str, ...] = (
    "output_multiplier",
    "final_logit_softcapping",
    "input_embedding_scale",
)

#: The architecture string engines switch on.
ARCHITECTURE = "DFlash2DraftModel"

#: The compiler's codes for DFlash 2's findings (registered in compiler/codes.py).
DFLASH2_NOT_YET = "dflash2-not-yet"
DFLASH2_SETTING_INVALID = "dflash2-setting-invalid"

_ARCH = "dflash_architecture_config"
_CONVS = ("attention_conv", "mlp_conv")
_SELECTOR = "candidate_selector"
#: Top-level keys the other kinds' exports write that a DFlash 2 release has not: ``auto_map``
#: (remote code) and ``block_size`` (only ``dflash_config.block_size``).
_NOT_RELEASED = frozenset({"auto_map", "block_size"})


def extra_layout(
    *, hidden: int, vocab: int, layers: int, kernel: int, group_size: int, rank: int
) -> dict[str, tuple[int, ...]]:
    """The tensors DFlash 2 adds to the backbone, unprefixed, name -> shape."""
    groups = hidden // group_size
    out: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        for conv in _CONVS:
            out[f"layers.{i}.{conv}.base_kernel"] = (2, kernel, hidden)
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * kernel * groups, hidden)
    out[f"{_SELECTOR}.hidden_projection.weight"] = (rank, hidden)
    out[f"{_SELECTOR}.predecessor_codebook"] = (vocab, rank)
    out[f"{_SELECTOR}.successor_codebook"] = (vocab, rank)
    return out


def extra_parameters(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """How many parameters `shapes` (an :func:`extra_layout`) holds."""
    return sum(math.prod(shape) for shape in shapes.values())


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rule_problems(
    settings: Mapping[str, object], *, hidden: int, vocab: int, block_size: int
) -> list[tuple[str, str, str]]:
    """(field, what is wrong, the fix) for each DFlash 2 rule `settings` break; a field that is
    None (unset) is not checked, a value of the wrong type is a problem."""
    found: list[tuple[str, str, str]] = []
    for key in NEW_CONFIG_KEYS:
        value = settings.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            found.append(
                (key, f"{key} {value!r} must be a positive integer", f"set {key}: 1 or more")
            )
    for key in OPTIONAL_CONFIG_KEYS:
        value = settings.get(key)
        if value is not None and (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not math.isfinite(value)
            or value <= 0
        ):
            found.append(
                (
                    key,
                    f"{key} {value!r} must be a finite number > 0",
                    f"set {key}, or leave it null",
                )
            )
    if found:
        return found
    kernel, group, top_k = (
        settings.get(k) for k in ("conv_kernel_size", "conv_group_size", "selector_top_k")
    )
    if isinstance(group, int) and hidden % group:
        divisors = [d for d in range(1, min(hidden, 64) + 1) if hidden % d == 0]
        found.append(
            (
                "conv_group_size",
                f"conv_group_size {group} must divide the hidden size {hidden}",
                f"set {_ARCH}.conv_group_size to a divisor of {hidden}, e.g. {divisors[-1]} "
                "(every release uses 16)",
            )
        )
    if isinstance(kernel, int) and kernel > block_size:
        found.append(
            (
                "conv_kernel_size",
                f"conv_kernel_size {kernel} must be in 1..block_size ({block_size})",
                f"set {_ARCH}.conv_kernel_size to at most {block_size} (the convolution never "
                "reaches across a block; releases use 2), or raise dflash.dflash_block_size",
            )
        )
    if isinstance(top_k, int) and top_k > vocab:
        found.append(
            (
                "selector_top_k",
                f"selector_top_k {top_k} must be in 1..vocab ({vocab})",
                f"set {_ARCH}.selector_top_k to at most {vocab} (releases use 16)",
            )
        )
    return found


def config_problems(
    dflash_config: Mapping[str, object], *, hidden: int, vocab: int, block_size: int
) -> list[str]:
    """What is wrong with a DFlash 2 ``dflash_config`` (empty when nothing is)."""
    problems = [
        f"dflash_config.{key} is missing (DFlash 2 needs it)"
        for key in NEW_CONFIG_KEYS
        if not _is_int(dflash_config.get(key))
    ]
    if problems:
        return problems
    rules = _rule_problems(dflash_config, hidden=hidden, vocab=vocab, block_size=block_size)
    return [what for _, what, _ in rules]


class DFlash2Facts:
    """DFlash 2 (module doc)."""

    name = "dflash2"
    # Not head sizes: they come from a DFlash 2 init checkpoint when unset (inherited_fields).
    head_fields: tuple[str, ...] = ()
    field_meaning: Mapping[str, str] = {
        "conv_kernel_size": "the taps of DFlash 2's grouped dynamic causal convolution; "
        "releases use 2",
        "conv_group_size": "the channels that share one DFlash 2 convolution coefficient; "
        "releases use 16",
        "selector_rank": "the rank of DFlash 2's candidate-selector codebooks; releases use 256",
        "selector_top_k": "the candidates per position DFlash 2's selector scores; releases use 16",
    }
    switch_fields: tuple[str, ...] = ()
    layout_needs: tuple[str, ...] = (
        "vocab_size",
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
    )
    shifts_labels = False
    marker_prefixes: tuple[str, ...] = (f"{_SELECTOR}.",)
    # The unary logits after the multiplier and soft cap: a rough count, not measured.
    loss_logit_copies = 1
    head_name: str | None = "dflash2"
    inherited_fields: tuple[str, ...] = (*NEW_CONFIG_KEYS, *OPTIONAL_CONFIG_KEYS)
    required_fields: tuple[str, ...] = NEW_CONFIG_KEYS
    trains = True
    objective_fields: tuple[str, ...] = ("selector_loss_alpha", "selector_missing_gold")
    # Every release states is_causal: false: its sliding layers see the whole block.
    sliding_causal = False
    # tau of the unary argmax path beside the selector's, so users see what the selector buys.
    eval_without_head = True
    fresh_start = (
        "are new (identity convolutions and a zero successor codebook, as SpecForge "
        "initialises them, so at step 0 the drafter computes what the DFlash 1 checkpoint "
        "computes) and train"
    )

    def layout(self, spec: LayoutSettings) -> dict[str, Shape]:
        """The convolutions of every layer and the candidate selector (module doc)."""
        assert spec.vocab_size is not None
        assert spec.conv_kernel_size is not None
        assert spec.conv_group_size is not None
        assert spec.selector_rank is not None
        return extra_layout(
            hidden=spec.hidden_size,
            vocab=spec.vocab_size,
            layers=spec.num_hidden_layers,
            kernel=spec.conv_kernel_size,
            group_size=spec.conv_group_size,
            rank=spec.selector_rank,
        )

    def tensor_groups(self, spec: LayoutSettings) -> dict[str, tuple[str, ...]]:
        """``attention_conv`` and ``mlp_conv`` (every layer's), and ``candidate_selector``."""
        groups: dict[str, tuple[str, ...]] = {}
        for name in self.layout(spec):
            parts = name.split(".")
            module = parts[2] if parts[0] == "layers" else parts[0]
            groups[module] = (*groups.get(module, ()), name)
        return groups

    def infer_dims(self, found: Mapping[str, Shape]) -> dict[str, int]:
        """vocab_size and selector_rank from the predecessor codebook; conv_kernel_size and
        conv_group_size from the first layer's attention convolution."""
        dims: dict[str, int] = {}
        codebook = f"{_SELECTOR}.predecessor_codebook"
        vocab, rank = dim(found, codebook, 2, 0), dim(found, codebook, 2, 1)
        if vocab:
            dims["vocab_size"] = vocab
        if rank:
            dims["selector_rank"] = rank
        base = "layers.0.attention_conv.base_kernel"
        kernel, hidden = dim(found, base, 3, 1), dim(found, base, 3, 2)
        rows = dim(found, "layers.0.attention_conv.kernel_projection.weight", 2, 0)
        if kernel:
            dims["conv_kernel_size"] = kernel
            if (
                hidden
                and rows
                and rows % (2 * kernel) == 0
                and hidden % (rows // (2 * kernel)) == 0
            ):
                dims["conv_group_size"] = hidden // (rows // (2 * kernel))
        return dims

    def describe(self, draft: HeadSettings) -> str:
        """``dflash2 (conv kernel 2, groups of 16; selector rank 256, top-16)``."""
        return (
            f"dflash2 (conv kernel {draft.conv_kernel_size}, groups of {draft.conv_group_size}; "
            f"selector rank {draft.selector_rank}, top-{draft.selector_top_k})"
        )

    def export_config(
        self, draft: HeadSettings, config: dict[str, JsonValue]
    ) -> dict[str, JsonValue]:
        """The z-lab layout of the DFlash 2 releases (docs/dflash.md, "DFlash 2"):
        ``DFlash2DraftModel``, ``is_causal: false``, and every DFlash key in ``dflash_config``
        (block size, mask id, taps, the four DFlash 2 keys, the optional ones only when set),
        where vLLM's loader indexes them.

        Left out, as the releases leave them out: ``auto_map`` (engines load DFlash 2 without
        remote code, so the export writes no ``dflash.py``), the top-level ``block_size``, and
        ``dflash_config.projector_type`` (the architecture string is the switch, for engines and
        for the compiler). ``attention_sink_bias`` is written only when true (no release has
        sinks).
        """
        nested: dict[str, JsonValue] = {
            "conv_kernel_size": draft.conv_kernel_size,
            "conv_group_size": draft.conv_group_size,
            "selector_rank": draft.selector_rank,
            "selector_top_k": draft.selector_top_k,
        }
        for key, value in (
            ("output_multiplier", draft.output_multiplier),
            ("final_logit_softcapping", draft.final_logit_softcapping),
            ("input_embedding_scale", draft.input_embedding_scale),
        ):
            if value is not None:
                nested[key] = value
        result = {
            key: value
            for key, value in with_kind_fields(config, nested=nested).items()
            if key not in _NOT_RELEASED
        }
        dflash = result.get("dflash_config")
        if isinstance(dflash, dict):  # a copy (with_kind_fields): the caller's is untouched
            dflash.pop("projector_type", None)
            if dflash.get("attention_sink_bias") is not True:
                dflash.pop("attention_sink_bias", None)
        result["architectures"] = [ARCHITECTURE]
        result["is_causal"] = False
        return result

    def serving_warnings(self, draft: HeadSettings) -> list[str]:
        """vLLM (0.28+) and SGLang serve DFlash 2 drafters."""
        return []

    def needs_teacher(self, objective: ObjectiveSettings) -> bool:
        """The selector's label is the data token: no target logits needed."""
        return False

    def recipe_findings(self, arch: HeadSettings, block_size: int) -> list[KindFinding]:
        """While the executor cannot train DFlash 2: the one ``dflash2-not-yet`` error."""
        if self.trains:
            return []
        return [
            KindFinding(
                DFLASH2_NOT_YET,
                "projector_type",
                "projector_type dflash2: the recipe and its init checkpoint are checked (fields, "
                "layout, rules), but this version of dflash-recipes cannot train DFlash 2 "
                "drafters yet: its convolution and candidate selector are not wired into "
                "training, evaluation and export",
                "nothing in the recipe fixes this: DFlash 2 training comes with a later "
                "release (issue 37); to fine-tune a DFlash 1 drafter instead, warm-start one "
                f"and set {_ARCH}.projector_type: dflash",
            )
        ]

    def checkpoint_findings(
        self, nested: Mapping[str, object], recipe: AlignmentSettings
    ) -> list[KindFinding]:
        """The DFlash 2 keys are inherited or compared by the compiler (``inherited_fields``)."""
        return []

    def settings_findings(
        self, settings: Mapping[str, object], *, hidden: int, vocab: int, block_size: int
    ) -> list[KindFinding]:
        """The group divides the hidden size, the kernel fits the block, top-K fits the
        vocabulary, and each value is of its type (:func:`config_problems`' rules)."""
        return [
            KindFinding(
                DFLASH2_SETTING_INVALID,
                field,
                f"{what}; DFlash 2 cannot be built with it (hidden size {hidden}, vocab "
                f"{vocab}, dflash_block_size {block_size})",
                fix,
            )
            for field, what, fix in _rule_problems(
                settings, hidden=hidden, vocab=vocab, block_size=block_size
            )
        ]

    def trained_for(
        self, where: str, nested: Mapping[str, object], draft: HeadSettings
    ) -> tuple[str, bool] | None:
        """DFlash 2 has no head alignment."""
        return None

    def starter_fields(
        self, stated: StatedHead, tensors: Collection[str]
    ) -> dict[str, tuple[object, str]]:
        """Nothing: the DFlash 2 fields are taken from the checkpoint at compile."""
        return {}


FACTS = DFlash2Facts()

__all__ = [
    "ARCHITECTURE",
    "DFLASH2_NOT_YET",
    "DFLASH2_SETTING_INVALID",
    "FACTS",
    "NEW_CONFIG_KEYS",
    "OPTIONAL_CONFIG_KEYS",
    "DFlash2Facts",
    "config_problems",
    "extra_layout",
    "extra_parameters",
]
