"""What a resume with a changed plan does to the run: the fields that differ between the plan
that saved a checkpoint and the plan resuming it, each with its verdict.

The policy is one table, :data:`RULES` (docs/dflash.md, "Resuming with a changed plan"): a
change of the drafter's architecture, its taps, its mask token or the target cannot be
continued honestly (the checkpoint's weights were trained as another network, or on another
model's states) and is refused; a change of the schedule, the data, the objective, the
numerics or the bookkeeping is continued with a warning that says what it does; what a resume
is expected to change (the plan's own resume point, its overrides, the init checkpoint it no
longer reads) or what never reaches training (the cache folder, the model card) is ignored.
A field no rule names is warned about, never ignored: a new plan field is classified here.
"""

from __future__ import annotations

import json
from typing import Literal

import attrs

from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.records import Record

Verdict = Literal["refuse", "warn", "ignore"]


@attrs.frozen(repr=False, eq=False, slots=False)
class Rule(Record):
    """The verdict for the plan fields at `prefix` (a dotted path or a folder of them)."""

    prefix: str
    verdict: Verdict
    #: What the change does to the run (a noun phrase, then what follows from it).
    effect: str


ARCHITECTURE = (
    "the drafter's architecture: the checkpoint's weights were trained as another network"
)
TAPS = "the taps: the drafter's fc layer was trained on other target layers' states"
MASK = "the mask token: the drafter was trained to read another token as the block's mask"
TARGET = "the target: the drafter was trained on another model's states"
TARGET_FOLDER = (
    "the target's folder: its config.json states the same model; its weights are trusted to be "
    "the same too"
)
SCHEDULE = (
    "the learning-rate schedule and the optimiser: the remaining steps follow the new values "
    "from the checkpoint's step on (Adam's moments are kept)"
)
DATA = (
    "the data and its order: the checkpoint's position (epoch and index) is applied to the new "
    "data and order, so the remaining steps do not continue the old pass over the data"
)
OBJECTIVE = "the objective: the remaining steps optimise another loss than the first ones did"
NUMERICS = "the numerics: the remaining steps run at another precision"
BOOKKEEPING = (
    "checkpoints, logging, evaluation or the device: the weights take the same path as before"
)
RESUME = "what a resume changes by itself"
NOT_TRAINING = "nothing the training reads"

#: The policy, first matching prefix wins (docs/dflash.md, "Resuming with a changed plan").
RULES: tuple[Rule, ...] = (
    Rule("draft.architecture", "refuse", ARCHITECTURE),
    Rule("draft.target_layer_ids", "refuse", TAPS),
    Rule("draft.mask_token_id", "refuse", MASK),
    Rule("base_model.facts", "refuse", TARGET),
    Rule("base_model.path", "warn", TARGET_FOLDER),
    Rule("base_model.dtype", "warn", NUMERICS),
    Rule("base_model.trust_remote_code", "warn", BOOKKEEPING),
    Rule("draft.block_size", "warn", OBJECTIVE),
    Rule("draft.objective", "warn", OBJECTIVE),
    Rule("training.learning_rate", "warn", SCHEDULE),
    Rule("training.max_steps", "warn", SCHEDULE),
    Rule("training.num_train_epochs", "warn", SCHEDULE),
    Rule("training.warmup_ratio", "warn", SCHEDULE),
    Rule("training.lr_scheduler_type", "warn", SCHEDULE),
    Rule("training.weight_decay", "warn", SCHEDULE),
    Rule("training.max_grad_norm", "warn", SCHEDULE),
    Rule("training.gradient_accumulation_steps", "warn", SCHEDULE),
    Rule("training.per_device_train_batch_size", "warn", DATA),
    Rule("training.seed", "warn", DATA),
    Rule("training.training_seq_len", "warn", DATA),
    Rule("data.cache_dir", "ignore", NOT_TRAINING),
    Rule("data.num_proc", "ignore", NOT_TRAINING),
    Rule("data", "warn", DATA),
    Rule("training.drafter_master_dtype", "warn", NUMERICS),
    Rule("training.tf32", "warn", NUMERICS),
    Rule("training.output_dir", "ignore", RESUME),
    Rule("training", "warn", BOOKKEEPING),
    Rule("resume", "ignore", RESUME),
    Rule("overrides", "ignore", RESUME),
    Rule("recipe_file", "ignore", RESUME),
    Rule("init_checkpoint", "ignore", RESUME),
    Rule("resolved", "ignore", RESUME),
    Rule("format_version", "ignore", RESUME),
    Rule("fingerprint", "ignore", RESUME),
    Rule("regenerate", "ignore", NOT_TRAINING),
    Rule("card", "ignore", NOT_TRAINING),
    Rule("target_server", "ignore", BOOKKEEPING),
)

#: A field no rule names: warned about, never ignored.
UNCLASSIFIED = Rule("", "warn", "a field this version does not classify")


@attrs.frozen(repr=False, eq=False, slots=False)
class PlanChange(Record):
    """One plan field that differs between the checkpoint's plan and the resuming one."""

    #: The dotted path in plan.json (``training.max_steps``).
    path: str
    #: The checkpoint's plan's value and the new one, as JSON text ("absent": not in the plan).
    before: str
    after: str
    rule: Rule

    def describe(self) -> str:
        """``training.max_steps 4 -> 6``."""
        return f"{self.path} {self.before} -> {self.after}"


def rule_for(path: str) -> Rule:
    """The rule whose prefix is `path` or a folder above it; :data:`UNCLASSIFIED` for none."""
    for rule in RULES:
        if path == rule.prefix or path.startswith(rule.prefix + "."):
            return rule
    return UNCLASSIFIED


def plan_changes(saved: RunPlan, new: RunPlan) -> tuple[PlanChange, ...]:
    """Every field of `new` that differs from `saved` and is not ignored, in path order."""
    before, after = _leaves(saved.to_dict()), _leaves(new.to_dict())
    changes = []
    for path in sorted(before.keys() | after.keys()):
        old, now = before.get(path, "absent"), after.get(path, "absent")
        rule = rule_for(path)
        if old != now and rule.verdict != "ignore":
            changes.append(PlanChange(path=path, before=old, after=now, rule=rule))
    return tuple(changes)


def _leaves(value: object, prefix: str = "") -> dict[str, str]:
    """Dotted path -> JSON text of each leaf (a list is one leaf: taps change as a whole)."""
    if isinstance(value, dict) and value:
        leaves: dict[str, str] = {}
        for key, item in value.items():
            leaves.update(_leaves(item, f"{prefix}.{key}" if prefix else str(key)))
        return leaves
    return {prefix: _json_text(value)}


def _json_text(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def grouped(changes: tuple[PlanChange, ...]) -> list[tuple[str, list[PlanChange]]]:
    """`changes` grouped by effect, in the order each effect first appears in :data:`RULES`."""
    order = {rule.effect: index for index, rule in enumerate(RULES)}
    groups: dict[str, list[PlanChange]] = {}
    for change in changes:
        groups.setdefault(change.rule.effect, []).append(change)
    return sorted(groups.items(), key=lambda item: order.get(item[0], len(order)))


__all__ = [
    "RULES",
    "UNCLASSIFIED",
    "PlanChange",
    "Rule",
    "Verdict",
    "grouped",
    "plan_changes",
    "rule_for",
]
