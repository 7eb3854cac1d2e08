"""What the trainer, the capture and the evaluation read from the frozen target.

**Taps.** DFlash tap ``k`` is the output of the target's decoder layer ``k``: the residual
stream as the layer returns it, before any final norm. That is the state the serving engines
feed a drafter (vLLM's auxiliary hidden state ``k + 1``, SGLang's capture), so every reader here
takes it the same way: a forward hook on the tapped decoder layers (:func:`target_states`).
Hugging Face's ``output_hidden_states`` is not used: its last entry is after the final norm,
so a tap on the last layer would train on a state no engine serves.

**The decoder stack** of a causal LM is found by :func:`decoder_stack`, for the families whose
``get_decoder()`` does not lead to it (Llama 4's text model answers with itself).

**Packed rows** (several conversations in one row, ``document_ids``): each conversation must get
the states it would get alone. Positions restart at 0 per document and the attention masks are
transformers' own, built per layer type (full, sliding-window, chunked) with the packed
positions, in the format of the model's attention implementation (eager's additive mask,
SDPA's boolean one, flex's block mask): :func:`packed_attention`. Layers that carry a state
from token to token (linear attention, state-space layers) cannot be kept apart by a mask; the
compiler refuses packing for targets that declare them (``packing-recurrent-layers``), and
:func:`check_packed_isolation` proves isolation on the real target before a packed run trains.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence

import attrs
import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from dflash_recipes.errors import CheckpointError, PlanError
from dflash_recipes.executor.model.masks import document_starts
from dflash_recipes.records import Record

#: Where a decoder stack is looked for, after ``get_decoder()``: dotted attribute paths from the
#: causal LM (Llama 4's text model keeps its layers at ``.model.layers``).
_DECODER_PATHS = ("model", "language_model", "model.language_model", "transformer")

#: Attention layer types whose masks transformers builds from positions, with the function that
#: builds each (``transformers.masking_utils``).
_MASK_BUILDERS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
    "chunked_attention": "create_chunked_causal_mask",
}

#: Relative error between a packed row's states and each document's alone above which packing
#: is refused at run start. Isolated rows agree to rounding (about 1e-6 in float32, 1e-2 in
#: bfloat16); a leak across documents or a lost sliding window measured 0.1 to 1.3.
ISOLATION_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 3e-2}


def _attribute_path(root: nn.Module, path: str) -> object:
    value: object = root
    for name in path.split("."):
        value = getattr(value, name, None)
        if value is None:
            return None
    return value


def decoder_stack(model: nn.Module) -> nn.Module:
    """The module that runs the target's decoder layers (``.layers``) and final norm.

    ``get_decoder()`` first, then the usual attribute paths; raises CheckpointError (naming
    the class and where it looked) for a model with no decoder stack to tap.
    """
    candidates: list[object] = []
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        candidates.append(get_decoder())
    candidates.extend(_attribute_path(model, path) for path in _DECODER_PATHS)
    candidates.append(model)
    for candidate in candidates:
        if isinstance(candidate, nn.Module) and isinstance(
            getattr(candidate, "layers", None), nn.ModuleList
        ):
            return candidate
    looked = ", ".join(["get_decoder()", *(f".{p}" for p in _DECODER_PATHS), "the model"])
    msg = (
        f"[target-no-decoder] {type(model).__name__} has no decoder stack to tap: none of "
        f"{looked} has a `layers` list of decoder layers; DFlash taps the outputs of a causal "
        "LM's decoder layers, so the target must be a decoder-only causal LM "
        "(model.model_name_or_path)"
    )
    raise CheckpointError(msg)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's decoder layers, in order (see :func:`decoder_stack`)."""
    layers = decoder_stack(model).layers
    assert isinstance(layers, nn.ModuleList)
    return layers


def final_norm(model: nn.Module) -> nn.Module:
    """The target's final norm (the decoder stack's ``norm``), applied before ``lm_head``."""
    norm = getattr(decoder_stack(model), "norm", None)
    if not isinstance(norm, nn.Module):
        msg = (
            f"{type(model).__name__} has no final norm on its decoder stack (`norm`); offline "
            "self-distillation needs it to recompute the teacher logits"
        )
        raise CheckpointError(msg)
    return norm


def document_position_ids(document_ids: Tensor) -> Tensor:
    """``[B, S]`` positions restarting at 0 where the document number changes."""
    seq_len = document_ids.shape[1]
    index = torch.arange(seq_len, device=document_ids.device).expand_as(document_ids)
    return index - document_starts(document_ids)


def _text_config(model: nn.Module) -> object:
    config = getattr(decoder_stack(model), "config", None) or getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def packed_attention(
    model: nn.Module, document_ids: Tensor, *, dtype: torch.dtype
) -> tuple[object, Tensor]:
    """What a packed row hands the target: ``(attention_mask, position_ids)``.

    Positions restart per document. A model whose config declares ``layer_types`` gets one
    mask per attention layer type, each built by transformers' own mask function for that type
    with a mask function that keeps the documents apart (an attention chunk counted from each
    document's start; a sliding window's distances are the same within a document), in the
    format of its attention implementation, with nothing read back to the host; other models
    get the one mask they would build for every layer (causal, or sliding when the config sets
    a window), the same way, as a 4-D mask they take as it is. Raises PlanError for a declared
    layer type no mask can isolate (linear attention, state-space layers).
    """
    positions = document_position_ids(document_ids)
    config = _text_config(model)
    layer_types = getattr(config, "layer_types", None)
    from transformers import masking_utils

    # the mask functions read only the shape, dtype and device of the embeddings
    stub = torch.empty(*document_ids.shape, 1, dtype=dtype, device=document_ids.device)
    if not layer_types:
        # one mask for every layer, as the model would build it (a window when the config
        # sets one), handed over whole (a 4-D mask is taken as it is); None for an
        # implementation that takes no mask (flash-attention: the packed positions then)
        window = getattr(config, "sliding_window", None)
        name = _MASK_BUILDERS["sliding_attention" if window else "full_attention"]
        whole = getattr(masking_utils, name)(
            config, stub, None, None, **_document_masks(document_ids)
        )
        return whole, positions
    mapping: dict[str, object] = {}
    for layer_type in dict.fromkeys(layer_types):
        builder_name = _MASK_BUILDERS.get(layer_type)
        if builder_name is None:
            msg = (
                f"packing cannot keep documents apart in the target's {layer_type!r} layers "
                f"({type(model).__name__}): only attention layers ({', '.join(_MASK_BUILDERS)}) "
                "take a per-document mask; set data.packing=false"
            )
            raise PlanError(msg)
        build: Callable[..., object] = getattr(masking_utils, builder_name)
        chunk = getattr(config, "attention_chunk_size", None)
        if layer_type == "chunked_attention" and isinstance(chunk, int) and chunk > 0:
            extra = _document_chunks(document_ids, positions, chunk)
        else:
            extra = _document_masks(document_ids)
        # no positions given: transformers tests nothing on the host (no packed-sequence
        # detection), windows count row indices (the same distances within a document)
        mapping[layer_type] = build(config, stub, None, None, **extra)
    return mapping, positions


#: The name under which SDPA attention runs with the mask handed to the model as it is (None:
#: SDPA's causal kernel): registered in transformers' attention functions but not in its mask
#: functions, so the model's own mask preparation (and its packed-sequence test, a host
#: read-back) is skipped for the forwards that run under it (:func:`causal_attention`).
CAUSAL_SDPA = "dflash_prepared_sdpa"


@attrs.frozen(eq=False)
class CausalAttention:
    """What unpadded (or right-padded) rows hand the target (:func:`causal_attention`)."""

    #: The ``attention_mask`` argument: None, a tensor, a block mask or one per layer type.
    mask: object
    #: The attention implementation to run the forward under (None: the model's own).
    implementation: str | None = None


def _windowless(config: object) -> bool:
    """No sliding window and no attention chunks: every layer attends causally to the row."""
    for name in ("sliding_window", "attention_chunk_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return False
    return True


def causal_attention(model: nn.Module, input_ids: Tensor, *, dtype: torch.dtype) -> CausalAttention:
    """The attention of unpadded (or right-padded) rows, prepared without a host read-back.

    - A model whose config declares only attention ``layer_types``: one mask per layer type
      from transformers' own mask functions, given no 2-D mask and no positions, so they test
      nothing on the host (SDPA's gets None: its causal fast path); the model takes the mapping
      as it is.
    - A model without ``layer_types``, window or chunks (Llama, DeepSeek-V3, Granite, OLMo 2,
      GLM, and Mistral or Mixtral as released, with ``sliding_window: null``): transformers'
      ``create_causal_mask`` built the same way. Eager's 4-D mask and flex's block mask are
      taken as they are; SDPA's None (the causal kernel) runs under :data:`CAUSAL_SDPA`, the
      same SDPA function with the model's mask preparation skipped, since that preparation
      would read the device back to test the positions for packing.
    - Others (a window without ``layer_types``, recurrent layers) get None and build their
      mask themselves; transformers then reads one value back from the device per forward.

    Right padding needs no mask: under causal attention no real position sees the padding
    after it.
    """
    config = _text_config(model)
    layer_types = getattr(config, "layer_types", None)
    from transformers import masking_utils

    stub = torch.empty(*input_ids.shape, 1, dtype=dtype, device=input_ids.device)
    if not layer_types:
        if not _windowless(config):
            return CausalAttention(None)
        mask = masking_utils.create_causal_mask(config, stub, None, None)
        if mask is None and getattr(config, "_attn_implementation", None) == "sdpa":
            _register_causal_sdpa()
            return CausalAttention(None, CAUSAL_SDPA)
        return CausalAttention(mask)
    if any(t not in _MASK_BUILDERS for t in layer_types):
        return CausalAttention(None)
    return CausalAttention(
        {
            layer_type: getattr(masking_utils, _MASK_BUILDERS[layer_type])(config, stub, None, None)
            for layer_type in dict.fromkeys(layer_types)
        }
    )


@functools.cache
def _register_causal_sdpa() -> None:
    """Register :data:`CAUSAL_SDPA` with transformers' attention functions (once per process)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)


@contextlib.contextmanager
def attention_implementation(model: nn.Module, name: str | None) -> Iterator[None]:
    """Run the forwards inside the block under the attention implementation `name` (the
    decoder's config says so for the time of the block; None: unchanged)."""
    config = _text_config(model)
    if name is None or config is None:
        yield
        return
    before = getattr(config, "_attn_implementation", None)
    config._attn_implementation = name  # type: ignore[attr-defined]
    try:
        yield
    finally:
        config._attn_implementation = before  # type: ignore[attr-defined]


def _document_masks(document_ids: Tensor) -> dict[str, object]:
    """The mask function that keeps a packed row's documents apart (``and`` with the causal,
    window or chunk mask transformers builds)."""

    def same_document(batch: Tensor, head: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        del head
        same: Tensor = document_ids[batch, q] == document_ids[batch, kv]
        return same

    return {"and_mask_function": same_document}


def _document_chunks(document_ids: Tensor, positions: Tensor, chunk: int) -> dict[str, object]:
    """Mask functions that make a chunked-attention mask count chunks from each document's
    start and keep documents apart: ``(causal and chunk by index) or (causal and same chunk by
    position)``, then ``and (same document and same chunk by position)`` leaves exactly
    causal-within-the-document's-chunk."""

    def same_chunk(batch: Tensor, head: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        del head
        same: Tensor = (positions[batch, q] // chunk == positions[batch, kv] // chunk) & (
            document_ids[batch, q] == document_ids[batch, kv]
        )
        return same

    def causal_same_chunk(batch: Tensor, head: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (kv <= q) & same_chunk(batch, head, q, kv)

    return {"or_mask_function": causal_same_chunk, "and_mask_function": same_chunk}


@attrs.frozen(eq=False)
class TargetStates:
    """What one frozen target forward gives the trainer."""

    #: ``[B, S, n_taps * H]`` the tapped decoder layers' outputs, in ``target_layer_ids`` order
    #: (the target's dtype).
    tapped: Tensor
    #: ``[B, S, V]`` next-token logits, only when asked for (None otherwise).
    logits: Tensor | None


def stop_after_layer(target_layer_ids: Sequence[int], *, needs_logits: bool) -> int | None:
    """The one rule for stopping the target early: after the deepest tapped layer, unless
    something needs the later layers (logits for a teacher or KL objective); None = run to
    the end."""
    if needs_logits or not target_layer_ids:
        return None
    return max(target_layer_ids)


class TapRecorder:
    """Forward hooks that record the tapped decoder layers' outputs during a target forward.

    Use as a context manager around any forward of the target (training, capture, a cached
    verification pass): :meth:`tapped` then gives ``[B, S, n_taps * H]``. The hooks only
    record: nothing is raised through the target's modules.
    """

    def __init__(self, model: nn.Module, target_layer_ids: Sequence[int]) -> None:
        layers = decoder_layers(model)
        bad = [k for k in target_layer_ids if not 0 <= k < len(layers)]
        if bad:
            msg = f"target_layer_ids {bad} are outside the target's {len(layers)} decoder layers"
            raise ValueError(msg)
        self.layers = layers
        self.target_layer_ids = tuple(target_layer_ids)
        self.captured: dict[int, Tensor] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _hook_for(self, k: int) -> Callable[[nn.Module, object, object], None]:
        def hook(_module: nn.Module, _args: object, output: object) -> None:
            out = output[0] if isinstance(output, tuple) else output
            assert isinstance(out, Tensor)
            self.captured[k] = out

        return hook

    def __enter__(self) -> TapRecorder:
        self.captured = {}
        self._handles = [
            self.layers[k].register_forward_hook(self._hook_for(k))
            for k in dict.fromkeys(self.target_layer_ids)
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def tapped(self) -> Tensor:
        """``[B, S, n_taps * H]`` the recorded taps, in ``target_layer_ids`` order."""
        missing = [k for k in self.target_layer_ids if k not in self.captured]
        if missing:
            msg = f"the target forward never ran decoder layers {missing}"
            raise RuntimeError(msg)
        return torch.cat([self.captured[k] for k in self.target_layer_ids], dim=-1)


@contextlib.contextmanager
def layers_up_to(model: nn.Module, last: int | None) -> Iterator[None]:
    """Run only the decoder layers ``0 .. last`` in the forwards inside the block.

    transformers' decoders loop over ``layers[: config.num_hidden_layers]``, so the decoder's
    config says fewer layers for the time of the block: the forward runs to its end (every
    module's post-forward hooks run, as FSDP2's root needs; nothing is raised through the
    model) and the layers after `last` are never called. A family whose loop ignores the
    setting (gpt-oss) runs every layer: the same taps, only slower. None: every layer.
    """
    config = getattr(decoder_stack(model), "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    if last is None or config is None or not isinstance(layers, int) or last + 1 >= layers:
        yield
        return
    config.num_hidden_layers = last + 1
    try:
        yield
    finally:
        config.num_hidden_layers = layers


def target_states(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    target_layer_ids: Sequence[int],
    *,
    with_logits: bool,
    stop_after: int | None = None,
    document_ids: Tensor | None = None,
) -> TargetStates:
    """The taps of a frozen target forward (hooks on the tapped decoder layers), and its logits
    only when asked.

    Without logits only the decoder stack runs: the ``lm_head`` product over every position
    is skipped, and with `stop_after` (:func:`stop_after_layer`) only the layers up to it
    run (:func:`layers_up_to`). With logits the whole causal LM runs, so the logits are
    exactly the model's (any scaling or soft-capping included). A packed row passes
    `document_ids` (``[B, S]``, the document number of each token, -1 for the filler): see
    :func:`packed_attention`. Unpadded or right-padded rows may pass no `attention_mask`
    (:func:`causal_attention`: no host read-back unless the target has a sliding window but
    no ``layer_types``, or recurrent layers).
    Call it under ``torch.no_grad()``. Works under any wrapper that keeps the layer modules
    (FSDP2's ``fully_shard`` hooks are module hooks too).
    """
    extra: dict[str, object] = {}
    mask: object = attention_mask
    implementation: str | None = None
    dtype = next(model.parameters()).dtype
    if document_ids is not None:
        mask, extra["position_ids"] = packed_attention(model, document_ids, dtype=dtype)
    elif attention_mask is None:
        causal = causal_attention(model, input_ids, dtype=dtype)
        mask, implementation = causal.mask, causal.implementation
    runner: nn.Module = model if with_logits else decoder_stack(model)
    last = None if with_logits else stop_after
    with (
        TapRecorder(model, target_layer_ids) as recorder,
        layers_up_to(model, last),
        attention_implementation(model, implementation),
    ):
        out = runner(input_ids=input_ids, attention_mask=mask, use_cache=False, **extra)
    logits = getattr(out, "logits", None) if with_logits else None
    return TargetStates(recorder.tapped(), logits)


@attrs.frozen(repr=False, eq=False, slots=False)
class IsolationReport(Record):
    """What :func:`check_packed_isolation` measured."""

    #: Tokens of each document of the packed test row.
    document_tokens: tuple[int, ...]
    #: Per document, ``|packed - alone| / |alone|`` over its tapped states (and logits).
    relative_errors: tuple[float, ...]
    tolerance: float
    seconds: float

    @property
    def worst(self) -> float:
        """The largest relative error over the documents."""
        return max(self.relative_errors)

    def describe(self) -> str:
        """One log line: what was compared, the worst error and the cost."""
        sizes = " + ".join(str(n) for n in self.document_tokens)
        return (
            f"packing isolation check: a packed row of {sizes} tokens equals each document "
            f"alone (worst relative error {self.worst:.1e}, tolerance {self.tolerance:.0e}; "
            f"one forward, {self.seconds:.2f} s)"
        )


def _window(config: object) -> int:
    values = [getattr(config, name, None) for name in ("sliding_window", "attention_chunk_size")]
    return max([v for v in values if isinstance(v, int) and v > 0], default=0)


def isolation_lengths(model: nn.Module, *, limit: int) -> tuple[int, int]:
    """The two test documents' lengths: past the target's sliding window or attention chunk
    (so those layers are exercised), within `limit` tokens in all."""
    longest = max(16, _window(_text_config(model)) + 8)
    first = max(2, min(longest, limit // 2))
    second = max(2, min(longest - 3, limit - first))
    return first, second


def _relative(packed: Tensor, alone: Tensor) -> float:
    reference = float(alone.float().norm().item())
    return float((packed.float() - alone.float()).norm().item()) / max(reference, 1e-12)


def _packed_and_alone(
    model: PreTrainedModel,
    documents: Sequence[Tensor],
    document_ids: Tensor,
    target_layer_ids: Sequence[int],
    *,
    with_logits: bool,
) -> tuple[TargetStates, list[TargetStates]]:
    device = document_ids.device
    packed = target_states(
        model,
        torch.cat(list(documents), dim=1).to(device),
        None,
        target_layer_ids,
        with_logits=with_logits,
        document_ids=document_ids,
    )
    alone = [
        target_states(
            model,
            ids.to(device),
            torch.ones_like(ids, device=device),
            target_layer_ids,
            with_logits=with_logits,
        )
        for ids in documents
    ]
    return packed, alone


def check_packed_isolation(
    model: PreTrainedModel,
    target_layer_ids: Sequence[int],
    *,
    with_logits: bool,
    limit: int = 4096,
    vocab_size: int | None = None,
    seed: int = 0,
) -> IsolationReport:
    """Prove on the real target that a packed row keeps its documents apart.

    Runs :func:`target_states` once on a packed row of two documents of seeded random tokens
    (lengths from :func:`isolation_lengths`) and once on each document alone, and compares
    every document's taps (and logits, `with_logits`). Raises PlanError, naming the target's
    class, the document and the error, when they differ beyond
    :data:`ISOLATION_TOLERANCE` for the model's dtype: that target cannot be trained packed.
    """
    started = time.perf_counter()
    parameter = next(model.parameters())
    device, dtype = parameter.device, parameter.dtype
    embeddings: nn.Module = model.get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    rows = vocab_size or (int(weight.shape[0]) if isinstance(weight, Tensor) else 2)
    generator = torch.Generator().manual_seed(seed)
    lengths = isolation_lengths(model, limit=limit)
    documents = [torch.randint(0, rows, (1, n), generator=generator) for n in lengths]
    document_ids = torch.cat(
        [torch.full((1, n), number) for number, n in enumerate(lengths)], dim=1
    ).to(device)
    try:
        with torch.no_grad():
            packed, alone = _packed_and_alone(
                model, documents, document_ids, target_layer_ids, with_logits=with_logits
            )
    except (TypeError, ValueError, RuntimeError, AttributeError, KeyError) as exc:
        msg = (
            f"{type(model).__name__} cannot run a packed row: {type(exc).__name__}: {exc}; "
            "set data.packing=false"
        )
        raise PlanError(msg) from exc
    errors: list[float] = []
    start = 0
    for n, states in zip(lengths, alone, strict=True):
        part = slice(start, start + n)
        parts = [_relative(packed.tapped[:, part], states.tapped)]
        if with_logits and packed.logits is not None and states.logits is not None:
            parts.append(_relative(packed.logits[:, part], states.logits))
        errors.append(max(parts))
        start += n
    tolerance = ISOLATION_TOLERANCE.get(dtype, 3e-2)
    report = IsolationReport(
        document_tokens=tuple(lengths),
        relative_errors=tuple(errors),
        tolerance=tolerance,
        seconds=time.perf_counter() - started,
    )
    if report.worst > tolerance:
        which = errors.index(report.worst) + 1
        msg = (
            f"packing would train on states the target never produces: in a packed row of "
            f"{' + '.join(map(str, lengths))} random tokens, document {which}'s tapped states "
            f"differ from the same document run alone by a relative error of {report.worst:.2g} "
            f"(tolerance {tolerance:.0e}) on {type(model).__name__}; some layer of this "
            "target sees across document boundaries. Set data.packing=false"
        )
        raise PlanError(msg)
    return report


__all__ = [
    "CAUSAL_SDPA",
    "ISOLATION_TOLERANCE",
    "CausalAttention",
    "IsolationReport",
    "TapRecorder",
    "TargetStates",
    "attention_implementation",
    "causal_attention",
    "check_packed_isolation",
    "decoder_layers",
    "decoder_stack",
    "document_position_ids",
    "final_norm",
    "isolation_lengths",
    "layers_up_to",
    "packed_attention",
    "stop_after_layer",
    "target_states",
]
