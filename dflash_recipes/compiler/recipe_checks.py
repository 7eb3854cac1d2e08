"""Schema-level checks: cross-field rules on the recipe alone, no file read (what `lint` runs)."""

from __future__ import annotations

from dflash_recipes.checkpoint.kinds.registry import (
    HEAD_FIELD_MEANING,
    KIND_FIELD_OWNERS,
    kind_facts,
)
from dflash_recipes.checkpoint.tensor_layout import ARCHITECTURE_FIELDS
from dflash_recipes.compiler.codes import (
    ARCH_DIM_MISSING,
    EVAL_DATA_UNSET,
    HEAD_FIELD_MISSING,
    HEAD_FIELD_UNUSED,
    KV_HEADS_NOT_DIVISOR,
    TAPS_DUPLICATE,
)
from dflash_recipes.compiler.state import (
    ARCH_PATH,
    TAPS_PATH,
    CompileState,
    format_ids,
)


class SchemaChecks(CompileState):
    """Dims set, grouped-query heads, head fields per projector, distinct taps, eval data."""

    def check_schema(self) -> None:
        self.check_attention()
        self.check_head_fields()
        self.check_kind_rules()
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
        for name in kind_facts(projector).head_fields:
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
        # Head sizes and switches (use_confidence_head) another kind owns.
        owners = KIND_FIELD_OWNERS
        unused = [n for n, owner in owners.items() if owner != projector and getattr(self.arch, n)]
        for name in unused:
            owner = owners[name]
            self.emit(
                HEAD_FIELD_UNUSED,
                f"{ARCH_PATH}.{name}",
                f"dflash_architecture_config.{name} belongs to projector_type {owner} and is "
                f"ignored with projector_type {projector}",
                f"delete {name}, or set dflash_architecture_config.projector_type: {owner}",
            )

    def check_kind_rules(self) -> None:
        """The projector type's own rules (Domino: the uncorrected prefix leaves the block at
        least one corrected position)."""
        block = self.recipe.dflash.dflash_block_size
        for finding in kind_facts(self.arch.projector_type).recipe_findings(self.arch, block):
            self.emit(finding.code, f"{ARCH_PATH}.{finding.field}", finding.message, finding.hint)

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
