"""Schema-level checks: cross-field rules on the recipe alone, no file read (what `lint` runs)."""

from __future__ import annotations

from dflash_recipes.checkpoint.tensor_layout import (
    ARCHITECTURE_FIELDS,
    HEAD_FIELD_MEANING,
    HEAD_FIELD_OWNERS,
    HEAD_FIELDS,
)
from dflash_recipes.compiler.codes import (
    ARCH_DIM_MISSING,
    EVAL_DATA_UNSET,
    EVAL_GATE_UNMEASURED,
    HEAD_FIELD_MISSING,
    HEAD_FIELD_UNUSED,
    KV_HEADS_NOT_DIVISOR,
    PURE_DRAFT_PREFIX_RANGE,
    TAPS_DUPLICATE,
)
from dflash_recipes.compiler.state import (
    ARCH_PATH,
    TAPS_PATH,
    CompileState,
    format_ids,
)


class SchemaChecks(CompileState):
    """Dims set, grouped-query heads, head fields per projector, distinct taps, eval data and
    the acceptance gate's measurement."""

    def check_schema(self) -> None:
        self.check_attention()
        self.check_head_fields()
        self.check_prefix_range()
        self.check_taps_unique()
        self.check_layer_types_length(self.arch.layer_types, "")
        training, data = self.recipe.training, self.recipe.data
        if training.eval_steps is not None and data.eval_data_path is None:
            self.emit(
                EVAL_DATA_UNSET,
                "training.eval_steps",
                f"training.eval_steps is {training.eval_steps} but data.eval_data_path is not "
                "set, so there is nothing to evaluate on",
                "set data.eval_data_path to a JSONL file of held-out conversations, or set "
                "training.eval_steps: null",
            )
        self.check_eval_gate()

    def check_eval_gate(self) -> None:
        """An acceptance gate needs a held-out measurement: eval_steps and eval data."""
        training, data = self.recipe.training, self.recipe.data
        if training.eval_min_tau is None:
            return
        missing = [
            name
            for name, value in (
                ("training.eval_steps", training.eval_steps),
                ("data.eval_data_path", data.eval_data_path),
            )
            if value is None
        ]
        if missing:
            self.emit(
                EVAL_GATE_UNMEASURED,
                "training.eval_min_tau",
                f"training.eval_min_tau is {training.eval_min_tau} but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set, so the run measures no "
                "held-out tau and would always fail the gate",
                "set training.eval_steps (e.g. to max_steps, to measure the final weights) and "
                "data.eval_data_path, or set training.eval_min_tau: null",
            )

    def check_dims_set(self) -> None:
        for name in ARCHITECTURE_FIELDS:
            if getattr(self.arch, name) is not None:
                continue
            message = (
                f"dflash_architecture_config.{name} is not set; dims never inherit: set "
                f"dflash_architecture_config.{name} (the base model's value is not used)"
            )
            if name in self.dims.values:
                hint = self.dims.fix(name)
            elif self.recipe.dflash.dflash_init_checkpoint is not None and self.resume is None:
                hint = (
                    f"set dflash_architecture_config.{name} to the init checkpoint's value "
                    "(`dflash-recipe init --base-model DIR --init-checkpoint DIR` writes them all)"
                )
            else:
                hint = (
                    f"set dflash_architecture_config.{name} to the drafter's own value "
                    "(`dflash-recipe init --base-model DIR` writes a from-scratch starting point)"
                )
            self.emit(ARCH_DIM_MISSING, f"{ARCH_PATH}.{name}", message, hint)

    def check_attention(self) -> None:
        heads, kv = self.arch.num_attention_heads, self.arch.num_key_value_heads
        if heads is None or kv is None or heads % kv == 0:
            return
        divisors = [d for d in range(1, heads + 1) if heads % d == 0 and d <= kv]
        self.emit(
            KV_HEADS_NOT_DIVISOR,
            f"{ARCH_PATH}.num_key_value_heads",
            f"num_key_value_heads {kv} does not divide num_attention_heads {heads}; grouped-query "
            "attention shares each key/value head among a whole number of query heads",
            f"set dflash_architecture_config.num_key_value_heads to a divisor of {heads}, "
            f"e.g. {divisors[-1]}",
        )

    def check_head_fields(self) -> None:
        projector = self.arch.projector_type
        for name in HEAD_FIELDS[projector]:
            if getattr(self.arch, name) is not None:
                continue
            found = self.dims.values.get(name)
            if found is not None:
                hint = self.dims.fix(name)
            else:
                hint = f"set dflash_architecture_config.{name} ({HEAD_FIELD_MEANING[name]})"
            self.emit(
                HEAD_FIELD_MISSING,
                f"{ARCH_PATH}.{name}",
                f"projector_type {projector} needs dflash_architecture_config.{name} "
                f"({HEAD_FIELD_MEANING[name]}), which is not set",
                hint,
            )
        owners = HEAD_FIELD_OWNERS
        unused = [n for n, owner in owners.items() if owner != projector and getattr(self.arch, n)]
        if self.arch.use_confidence_head and projector != "dspark":
            unused.append("use_confidence_head")
        for name in unused:
            owner = owners.get(name, "dspark")
            self.emit(
                HEAD_FIELD_UNUSED,
                f"{ARCH_PATH}.{name}",
                f"dflash_architecture_config.{name} belongs to projector_type {owner} and is "
                f"ignored with projector_type {projector}",
                f"delete {name}, or set dflash_architecture_config.projector_type: {owner}",
            )

    def check_prefix_range(self) -> None:
        """Domino's uncorrected prefix must leave the block at least one corrected position."""
        prefix, block = self.arch.pure_draft_prefix_len, self.recipe.dflash.dflash_block_size
        if self.arch.projector_type != "domino" or prefix <= block - 1:
            return
        self.emit(
            PURE_DRAFT_PREFIX_RANGE,
            f"{ARCH_PATH}.pure_draft_prefix_len",
            f"pure_draft_prefix_len {prefix} leaves no block position for Domino's head to "
            f"correct: it must lie in [0, {block - 1}] (dflash_block_size {block} minus 1)",
            "set dflash_architecture_config.pure_draft_prefix_len: 1 (ModelOpt's default, the "
            f"only value SGLang serves), or any value up to {block - 1}",
        )

    def check_taps_unique(self) -> None:
        taps = self.arch.target_layer_ids
        if taps is None or len(set(taps)) == len(taps):
            return
        repeated = sorted({t for t in taps if taps.count(t) > 1})
        unique = list(dict.fromkeys(taps))
        self.emit(
            TAPS_DUPLICATE,
            TAPS_PATH,
            f"target_layer_ids {format_ids(taps)} list layer(s) {format_ids(repeated)} more than "
            "once; each tap must be a different target layer",
            f"list each layer once, e.g. target_layer_ids: {format_ids(unique)}",
        )


__all__ = ["SchemaChecks"]
