"""The target's cache during verification, rolled back to the accepted inputs after each pass.

The KV-cached loop (:mod:`~dflash_recipes.executor.evaluation.cached_decoding`) runs the
target over a block (anchor + proposals) on top of a ``transformers.DynamicCache`` and keeps
only the inputs it accepted. Rejected inputs must leave no trace in any layer, so each kind of
cache layer is rolled back its own way:

- **full attention** (``DynamicLayer``): one key and value per slot; a crop drops the slots of
  the rejected inputs.
- **sliding window / chunked** (``DynamicSlidingWindowLayer``: Gemma 3, gpt-oss, Mistral,
  Qwen3 with ``use_sliding_window``): the layer records its past from the first verification
  on, keeping every state a pass added until the crop, which drops the rejected ones and cuts
  the layer back to the ``window - 1`` states the next pass attends to. So a crop follows
  every pass, a fully accepted one too (``crop(0)`` is not a no-op there).
- **linear attention** (``LinearAttentionLayer``: Qwen3-Next's Gated DeltaNet, Mamba-style
  layers): a convolution state, recorded in full and cropped like keys, and a recurrent state
  that sums up every input, which no crop can take apart. Told how many states to keep
  (``activate_past_recording(recurrent_states_to_keep=pass length)``, transformers newer
  than 5.17), the model records the state after every input of a pass, and the crop picks the
  one after the last accepted input. Where that record falls short (transformers 5.17
  records none; a model whose code ignores the setting records only the last), the pass is
  taken back whole instead (the states saved before it restored, attention layers cropped by
  the pass length) and the accepted inputs are run again: one more target pass over at most
  a block, on the steps that rejected something.

Recording starts after the prefill (:meth:`TargetCache.start_recording`), as transformers'
own assisted decoding does: a prompt's prefill keeps only what the next pass needs (a window,
a convolution's last inputs) instead of its every state.

Only a cache of full-attention layers can keep a batch row's rejected slots as masked holes
(:func:`holds_holes`): a window counts slots, so a hole narrows it, and a recurrent state has no
slot to mask. Other targets verify the prompts of a batch one at a time.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, LinearAttentionCacheLayerMixin


def cache_argument(target: PreTrainedModel) -> str:
    """The forward argument that takes the cache: ``cache`` in newer transformers 5 releases
    (``past_key_values`` is deprecated there), ``past_key_values`` before."""
    forward = getattr(target, "forward", None)
    try:
        parameters = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):
        parameters = {}
    return "cache" if "cache" in parameters else "past_key_values"


def _holds_holes(layer: object) -> bool:
    """A full-attention key/value layer, or one that stores nothing (a layer reading another
    layer's keys): what a masked hole leaves exact. Any other kind is taken as one that does
    not (a window, a recurrent state, a sparse indexer)."""
    if type(layer) is DynamicLayer:
        return True
    return not isinstance(layer, (CacheLayerMixin, LinearAttentionCacheLayerMixin))


def holds_holes(target: PreTrainedModel) -> bool:
    """Whether the target's cache can keep a batch row's rejected slots as masked holes.

    True when every layer of its ``DynamicCache`` is a full-attention key/value layer (or
    stores nothing); a sliding-window, chunked or linear-attention layer makes it False, and
    the loop verifies the prompts of a batch one at a time.
    """
    # A config without layer types gives no layers: they are made, full-attention ones, as
    # the cache fills.
    return all(_holds_holes(layer) for layer in DynamicCache(config=target.config).layers)


def _attention_crop(layer: object) -> Callable[[object, int], None] | None:
    """The crop of a layer's attention part (None for a layer that has none): its class's
    own, or for a layer that holds attention and linear-attention states alike (whose own
    ``crop`` crops both) that of its attention base."""
    for klass in type(layer).__mro__:
        if (
            issubclass(klass, CacheLayerMixin)
            and not issubclass(klass, LinearAttentionCacheLayerMixin)
            and "crop" in vars(klass)
        ):
            crop: Callable[[object, int], None] = vars(klass)["crop"]
            return crop
    return None


class _LinearStates:
    """A linear-attention layer's convolution and recurrent states (and token count), saved."""

    def __init__(self, layer: LinearAttentionCacheLayerMixin) -> None:
        self.conv = {i: _clone(t) for i, t in layer.conv_states.items()}
        self.recurrent = {i: _clone(t) for i, t in layer.recurrent_states.items()}
        self.has_previous = dict(layer.has_previous_state)
        count = getattr(layer, "cumulative_length_linear", None)  # newer than 5.17
        self.count = count.clone() if isinstance(count, Tensor) else None

    def restore(self, layer: LinearAttentionCacheLayerMixin) -> None:
        for i, conv in self.conv.items():
            layer.conv_states[i] = conv
        for i, recurrent in self.recurrent.items():
            current = layer.recurrent_states[i]
            # In place where the layer has a tensor: its address may be marked static.
            if isinstance(current, Tensor) and recurrent is not None:
                current.copy_(recurrent)
            else:
                layer.recurrent_states[i] = recurrent
        layer.has_previous_state = dict(self.has_previous)
        if self.count is not None:
            layer.cumulative_length_linear.copy_(self.count)
        if getattr(layer, "recurrent_states_history", None) is not None:
            layer.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}


def _clone(tensor: Tensor | None) -> Tensor | None:
    return None if tensor is None else tensor.clone()


def _recorded_every_state(layer: LinearAttentionCacheLayerMixin, pass_length: int) -> bool:
    """Whether the layer's record holds the recurrent state before each input of the last pass
    (what its crop picks from), for every recurrent state it has."""
    history = getattr(layer, "recurrent_states_history", None)
    for i, initialized in layer.is_recurrent_states_initialized.items():
        if not initialized:
            continue
        if not isinstance(history, dict) or len(history.get(i) or ()) != pass_length:
            return False
    return True


class TargetCache:
    """A ``DynamicCache`` for ``target`` and the rollback of each verification pass.

    Order of calls: the prefill on :attr:`cache`, :meth:`start_recording`, then per step
    :meth:`before_pass`, the pass on :attr:`cache` and :meth:`keep`.
    """

    def __init__(self, target: PreTrainedModel) -> None:
        self.target = target
        self.cache = DynamicCache(config=target.config)
        #: The forward argument that takes :attr:`cache`.
        self.argument = cache_argument(target)
        self._linear = [
            layer
            for layer in self.cache.layers
            if isinstance(layer, LinearAttentionCacheLayerMixin)
        ]
        self._saved: list[tuple[LinearAttentionCacheLayerMixin, _LinearStates]] = []

    def start_recording(self, pass_length: int) -> None:
        """From now on each pass is recorded until :meth:`keep`; ``pass_length`` is the
        longest pass (the recurrent states a linear-attention layer keeps)."""
        activate = getattr(self.cache, "activate_past_recording", None)
        if not callable(activate):
            return
        parameters = inspect.signature(activate).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters) or any(
            p.name == "recurrent_states_to_keep" for p in parameters
        ):
            activate(recurrent_states_to_keep=pass_length)
        else:  # transformers 5.17: no recurrent record; keep() takes such passes back whole
            activate()

    def before_pass(self) -> None:
        """Save the linear-attention states (small: no sequence axis) the pass will change."""
        self._saved = [(layer, _LinearStates(layer)) for layer in self._linear]

    def keep(self, kept: int, input_ids: Tensor, positions: Tensor) -> None:
        """Keep the first ``kept`` inputs of the last pass, whose inputs were ``input_ids`` at
        ``positions`` (``[1, n]`` where a pass may be taken back whole: only a cache that
        holds no holes has linear-attention layers)."""
        length = int(input_ids.shape[1])
        removed = length - kept
        if removed and not all(_recorded_every_state(layer, length) for layer in self._linear):
            self._take_back(length)
            if kept:
                self.target(
                    input_ids=input_ids[:, :kept],
                    position_ids=positions[:, :kept],
                    use_cache=True,
                    logits_to_keep=1,
                    **{self.argument: self.cache},
                )
            removed = 0
        # Also after a full acceptance: crop(0) cuts a recording window back to window - 1
        # states (transformers 5.17 would hand a later pass all it recorded while the mask
        # counts window - 1, a shape mismatch) and a convolution record to its kernel.
        self.cache.crop(-removed)

    def _take_back(self, length: int) -> None:
        """Undo the whole last pass: attention layers cropped by ``length``, linear-attention
        states restored from :meth:`before_pass`."""
        for layer in self.cache.layers:
            crop = _attention_crop(layer)
            if crop is not None:
                crop(layer, -length)
        for linear, states in self._saved:
            states.restore(linear)


__all__ = ["TargetCache", "cache_argument", "holds_holes"]
