"""Taps, mask token id, attention kinds and rms_norm_eps: from the recipe, else the resumed run,
else the init checkpoint, else the default formula (taps) or the documented default (rms_norm_eps,
1e-6); the mask id is never guessed.
"""

from __future__ import annotations

from dflash_recipes.checkpoint.tensor_layout import default_target_layer_ids
from dflash_recipes.compiler.codes import (
    CHECKPOINT_LAYER_TYPES_DIFFER,
    CHECKPOINT_MASK_DIFFERS,
    CHECKPOINT_TAPS_DIFFER,
    LAYER_TYPES_FROM_CHECKPOINT,
    LAYER_TYPES_FROM_PREVIOUS_RUN,
    MASK_FROM_CHECKPOINT,
    MASK_FROM_PREVIOUS_RUN,
    MASK_TOKEN_MISSING,
    RMS_NORM_EPS_FROM_CHECKPOINT,
    RMS_NORM_EPS_FROM_PREVIOUS_RUN,
    SLIDING_WINDOW_MISSING,
    SLIDING_WINDOW_UNUSED,
    TAPS_DEFAULT,
    TAPS_FROM_CHECKPOINT,
    TAPS_FROM_PREVIOUS_RUN,
    TAPS_OUT_OF_RANGE,
    TAPS_UNKNOWN,
)
from dflash_recipes.compiler.state import (
    ARCH_PATH,
    MASK_PATH,
    TAPS_PATH,
    CompileState,
    format_ids,
)

#: rms_norm_eps of a drafter when neither the recipe nor a checkpoint states one (Qwen3's).
DEFAULT_RMS_NORM_EPS = 1.0e-6


class DraftIdChecks(CompileState):
    """Resolve target_layer_ids, dflash_mask_token_id, layer_types, sliding_window and
    rms_norm_eps."""

    def resolve_rms_norm_eps(self) -> float:
        """The plan's rms_norm_eps: recipe, else resumed run, else checkpoint, else 1e-6.

        A recipe value the checkpoint contradicts is warned about by check_checkpoint_config.
        """
        eps = self.arch.rms_norm_eps
        if eps is not None:
            return float(eps)
        path = f"{ARCH_PATH}.rms_norm_eps"
        previous = self.previous_plan.draft.architecture if self.previous_plan else None
        if self.resume is not None and previous is not None:
            self.emit(
                RMS_NORM_EPS_FROM_PREVIOUS_RUN,
                path,
                f"rms_norm_eps not set: using {previous.rms_norm_eps!r}, the epsilon of the run "
                "being resumed (its plan.json)",
                f"set rms_norm_eps: {previous.rms_norm_eps!r} to pin it in the recipe",
            )
            return previous.rms_norm_eps
        config = self.config if self.config is not None and self.config.readable else None
        stated = config.rms_norm_eps if config is not None else None
        if self.resume is None and stated is not None:
            self.emit(
                RMS_NORM_EPS_FROM_CHECKPOINT,
                path,
                f"rms_norm_eps not set: using the init checkpoint's {stated!r} (its config.json)",
                f"set rms_norm_eps: {stated!r} to pin it in the recipe",
            )
            return stated
        return DEFAULT_RMS_NORM_EPS

    def resolve_taps(self) -> tuple[int, ...] | None:
        taps = self.arch.target_layer_ids
        stated = self.config.target_layer_ids if self.config is not None else None
        if taps is not None:
            if stated is not None and stated != taps:
                self.emit(
                    CHECKPOINT_TAPS_DIFFER,
                    TAPS_PATH,
                    f"target_layer_ids {format_ids(taps)} differ from the init checkpoint's "
                    f"{format_ids(stated)}; the warm start loads, but its fused context is "
                    "built from other target layers, so it starts degraded",
                    f"set target_layer_ids: {format_ids(stated)} (or delete the field to take "
                    "the checkpoint's), unless retapping is intended",
                )
            return taps
        previous = self.previous_plan.draft.target_layer_ids if self.previous_plan else None
        if self.resume is not None and previous is not None:
            self.emit(
                TAPS_FROM_PREVIOUS_RUN,
                TAPS_PATH,
                f"target_layer_ids not set: using {format_ids(previous)}, the taps of the run "
                "being resumed (its plan.json)",
                f"set target_layer_ids: {format_ids(previous)} to pin them in the recipe",
            )
            return previous
        if stated is not None:
            self.emit(
                TAPS_FROM_CHECKPOINT,
                TAPS_PATH,
                f"target_layer_ids not set: using the init checkpoint's {format_ids(stated)} "
                "(its config.json)",
                f"set target_layer_ids: {format_ids(stated)} to pin them in the recipe",
            )
            return stated
        if self.recipe.dflash.dflash_init_checkpoint is not None:
            if self.checkpoint_broken:
                return None
            n_taps = self.dims.values.get("n_taps")
            count = f" (its fc.weight takes {n_taps} taps)" if n_taps else ""
            where = "the run being resumed" if self.resume is not None else "the init checkpoint"
            self.emit(
                TAPS_UNKNOWN,
                TAPS_PATH,
                f"target_layer_ids not set, and {where} does not state the taps it was trained "
                f"with{count}; taps are never guessed",
                "set dflash_architecture_config.target_layer_ids to the drafter's taps (its "
                "model card or original config.json)",
            )
            return None
        layers = self.arch.num_hidden_layers
        if self.facts is None or layers is None:
            return None
        target_layers = self.facts.num_hidden_layers
        try:
            taps = default_target_layer_ids(target_layers, layers)
        except ValueError as exc:
            self.emit(
                TAPS_OUT_OF_RANGE,
                TAPS_PATH,
                f"target_layer_ids not set and {exc}",
                f"set target_layer_ids to distinct layers in 0..{target_layers - 1}",
            )
            return None
        self.emit(
            TAPS_DEFAULT,
            TAPS_PATH,
            f"target_layer_ids not set: using the default formula for a {target_layers}-layer "
            f"target and {layers} draft layers: {format_ids(taps)}",
            f"set target_layer_ids: {format_ids(taps)} to pin them in the recipe",
        )
        return taps

    def resolve_mask(self) -> int | None:
        mask = self.recipe.dflash.dflash_mask_token_id
        stated = self.config.mask_token_id if self.config is not None else None
        if mask is not None:
            if stated is not None and stated != mask:
                self.emit(
                    CHECKPOINT_MASK_DIFFERS,
                    MASK_PATH,
                    f"dflash_mask_token_id {mask} differs from the init checkpoint's {stated}; the "
                    "warm start loads, but the drafter learned to read token "
                    f"{stated} as the mask, so it starts degraded",
                    f"set dflash_mask_token_id: {stated} (or delete it to take the checkpoint's), "
                    "unless the change is intended",
                )
            return mask
        previous = self.previous_plan.draft.mask_token_id if self.previous_plan else None
        if self.resume is not None and previous is not None:
            self.emit(
                MASK_FROM_PREVIOUS_RUN,
                MASK_PATH,
                f"dflash_mask_token_id not set: using {previous}, the mask id of the run being "
                "resumed (its plan.json)",
                f"set dflash_mask_token_id: {previous} to pin it in the recipe",
            )
            return previous
        if stated is not None:
            self.emit(
                MASK_FROM_CHECKPOINT,
                MASK_PATH,
                f"dflash_mask_token_id not set: using the init checkpoint's {stated} "
                "(its config.json)",
                f"set dflash_mask_token_id: {stated} to pin it in the recipe",
            )
            return stated
        if self.checkpoint_broken:
            return None
        if self.resume is not None:
            source = "the run being resumed has no plan.json stating one"
        elif self.recipe.dflash.dflash_init_checkpoint is not None:
            source = "the init checkpoint's config.json does not state one"
        else:
            source = "there is no init checkpoint to take it from"
        vocab = f" below the target's vocab_size {self.facts.vocab_size}" if self.facts else ""
        self.emit(
            MASK_TOKEN_MISSING,
            MASK_PATH,
            f"dflash_mask_token_id is not set and {source}; the mask id is never guessed",
            f"set dflash.dflash_mask_token_id to an embedding row{vocab} that the tokenizer "
            "never produces; for Qwen3 use 151669, the first unused embedding row (the Qwen3 "
            "tokenizer has no mask token)",
        )
        return None

    def resolve_layer_types(self) -> tuple[tuple[str, ...] | None, int | None]:
        """The plan's (layer_types, sliding_window): recipe, else resumed run, else checkpoint."""
        types, window = self.arch.layer_types, self.arch.sliding_window
        config = self.config if self.config is not None and self.config.readable else None
        stated_types = config.layer_types if config is not None else None
        stated_window = config.sliding_window if config is not None else None
        if stated_types is None or "sliding_attention" not in stated_types:
            stated_window = None  # a window without sliding layers means nothing
        previous = self.previous_plan.draft.architecture if self.previous_plan else None
        taken: list[str] = []
        origin = ""
        if types is None and window is None and self.resume is not None and previous:
            types, window = previous.layer_types, previous.sliding_window
            if types is not None:
                self.emit(
                    LAYER_TYPES_FROM_PREVIOUS_RUN,
                    f"{ARCH_PATH}.layer_types",
                    f"layer_types not set: using [{', '.join(types)}]"
                    + (f" with sliding_window {window}" if window is not None else "")
                    + ", the attention kinds of the run being resumed (its plan.json)",
                    "set layer_types (and sliding_window) to pin them in the recipe",
                )
            origin = " (from the resumed run's plan)"
        else:
            if types is None and stated_types and "sliding_attention" in stated_types:
                # only a checkpoint with sliding layers says more than the default
                types, origin = stated_types, " (from the init checkpoint)"
                taken.append(f"layer_types [{', '.join(stated_types)}]")
            if window is None and stated_window is not None:
                window = stated_window
                taken.append(f"sliding_window {stated_window}")
            if taken:
                self.emit(
                    LAYER_TYPES_FROM_CHECKPOINT,
                    f"{ARCH_PATH}.layer_types",
                    f"{' and '.join(taken)} not set in the recipe: using the init checkpoint's "
                    "(its config.json)",
                    "set "
                    + " and ".join(t.replace(" ", ": ", 1) for t in taken)
                    + " to pin them in the recipe",
                )
            self.compare_layer_types(types, window, stated_types, stated_window)
        layers = self.arch.num_hidden_layers
        if origin and not self.check_layer_types_length(types, origin):
            return None, None
        if types is not None and layers is not None and len(types) != layers:
            return None, None  # reported by check_schema
        sliding = types is not None and "sliding_attention" in types
        if sliding and window is None:
            self.emit(
                SLIDING_WINDOW_MISSING,
                f"{ARCH_PATH}.sliding_window",
                f"layer_types{origin} has sliding_attention layers, but no sliding_window says "
                "how many keys they see",
                "set dflash_architecture_config.sliding_window (a positive number of keys, the "
                "query itself included, e.g. 2048), or make every layer full_attention",
            )
            return None, None
        if not sliding and window is not None:
            if self.arch.sliding_window is not None:
                self.emit(
                    SLIDING_WINDOW_UNUSED,
                    f"{ARCH_PATH}.sliding_window",
                    f"sliding_window {window} is set, but no layer is sliding_attention, so it "
                    "changes nothing",
                    "delete sliding_window, or set some layer_types entries to sliding_attention",
                )
            window = None
        return types, window

    def compare_layer_types(
        self,
        types: tuple[str, ...] | None,
        window: int | None,
        stated_types: tuple[str, ...] | None,
        stated_window: int | None,
    ) -> None:
        if self.config is None or not self.config.readable:
            return
        layers = self.arch.num_hidden_layers
        full = ("full_attention",) * layers if layers is not None else None
        mine = types if types is not None else full
        theirs = stated_types if stated_types is not None else full
        if mine is None or theirs is None:
            return  # the default needs num_hidden_layers, whose absence is arch-dim-missing
        if mine == theirs and (stated_window is None or window == stated_window):
            return
        said = f"[{', '.join(theirs)}]" + (
            f" with sliding_window {stated_window}" if stated_window is not None else ""
        )
        got = f"[{', '.join(mine)}]" + (f" with sliding_window {window}" if window else "")
        fix = f"set layer_types: [{', '.join(theirs)}]" + (
            f" and sliding_window: {stated_window}" if stated_window is not None else ""
        )
        self.emit(
            CHECKPOINT_LAYER_TYPES_DIFFER,
            f"{ARCH_PATH}.layer_types",
            f"the recipe's attention kinds {got} differ from the init checkpoint's {said}; the "
            "warm start loads, but its layers learned to attend over other keys, so it starts "
            "degraded",
            f"{fix} (or delete the fields to take the checkpoint's), unless the change is intended",
        )


__all__ = ["DEFAULT_RMS_NORM_EPS", "DraftIdChecks"]
