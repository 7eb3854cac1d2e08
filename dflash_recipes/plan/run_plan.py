"""The run plan: a frozen, fingerprinted, JSON-serialisable description of one run.

The compiler writes it, the executor reads only it. Everything the executor needs is here,
resolved: absolute paths, defaults, taps, the mask id, RoPE settings taken from the target and
the facts of the init checkpoint. Canonical JSON bytes are identical across processes and hash
seeds; the fingerprint is the sha256 of the canonical JSON of the plan without its fingerprint.

The parts of a plan are defined in :mod:`~dflash_recipes.plan.parts` (and the target's facts in
:mod:`~dflash_recipes.checkpoint.target_facts`); this module puts them together, reads and
writes plan files, and re-exports them, so ``from dflash_recipes.plan.run_plan import
DraftPlan`` keeps working.
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attr
import attrs

from dflash_recipes.checkpoint.target_facts import RopePlan, RopeValue, TargetFacts
from dflash_recipes.errors import PlanError
from dflash_recipes.files.jsonio import JsonProblem, parse_json, shorten
from dflash_recipes.plan.parts import (
    ArchitecturePlan,
    BaseModelPlan,
    CardPlan,
    DataPlan,
    DraftPlan,
    InitCheckpointPlan,
    ObjectivePlan,
    RegeneratePlan,
    ResumePlan,
    TargetServerPlan,
    TrainingPlan,
)
from dflash_recipes.records import Record

if TYPE_CHECKING:
    import cattrs

    from dflash_recipes.plan.draft_spec import ResolvedDraft


def _sha256_hex(data: bytes) -> str:
    """SHA-256 of `data` as hex."""
    digest: str = _sha256_constructor()(data).hexdigest()
    return digest


@functools.cache
def _sha256_constructor() -> Callable[[bytes], Any]:
    """CPython's built-in SHA-256 when there is one, else hashlib's; chosen once per process.

    ``import hashlib`` loads OpenSSL's libcrypto first (2-4 ms per process); CPython's built-in
    SHA-256 module (``_sha2`` from 3.12, ``_sha256`` before) gives the same digest for a
    fingerprint of a few kilobytes. The stdlib's `random` module imports its SHA-512 the same way.
    """
    for name in ("_sha2", "_sha256"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        constructor: Callable[[bytes], Any] = module.sha256
        return constructor
    import hashlib  # another interpreter: the portable module

    return hashlib.sha256


#: Version of the plan schema. 2: the draft's `layer_types`/`sliding_window`, the data's
#: `hidden_states_path` and the `regenerate` section (a version-1 plan is refused with the
#: hint to recompile, not as an edited file). 3: the training's `report_to`, `run_name` and
#: `logging_dir` (experiment trackers). 4: the draft's `shift_label`, `pure_draft_prefix_len`
#: and `markov_head_type` (Domino and DSpark as ModelOpt computes them). 5: the data's
#: `cache_dir` and `num_proc` (the tokenized-data cache). 6: the training's `eval_min_tau` and
#: the `card` section (the export's model card). 7: the training's `eval_num_prompts` and
#: `eval_max_new_tokens` (`eval_steps` resolved: every `save_steps` when there is eval data).
#: 8: the data's `packing`. 9: the data's `eval_holdout`; the training's `tf32` and
#: `drafter_master_dtype` (precision). 10: the draft's DFlash 2 fields (`conv_kernel_size`,
#: `conv_group_size`, `selector_rank`, `selector_top_k`, ...) and the objective's selector
#: loss settings. Still 10: `target_server` (the target served by vLLM), which a plan without
#: one leaves out of its JSON, so those plans, their bytes and fingerprints, are unchanged (a
#: reader that does not know the key refuses a plan that has it, as an unknown key). 11: the
#: training's `max_nonfinite_steps` (skipped non-finite steps), `distributed_timeout_s` and
#: `activation_checkpointing`. 12: the data's `supervise` and `unrenderable_rows` (tool calls
#: and reasoning in training rows) and the regenerate settings' `thinking`.
PLAN_FORMAT_VERSION = 12
#: The plan key left out of the JSON when it is None (a reader takes its default, None).
_OPTIONAL_KEY = "target_server"
#: What to do about a plan that is refused.
RECOMPILE_HINT = "recompile it with `dflash-recipe compile RECIPE -o plan.json`"
#: Integers in a plan file are read up to this many digits, so an absurd value reaches the
#: validators (which name its dotted path) instead of failing Python's int conversion.
_PLAN_INT_DIGITS = 4000


@attrs.frozen(repr=False, eq=False, slots=False)
class RunPlan(Record):
    """Everything the executor needs for one run, resolved and fingerprinted."""

    base_model: BaseModelPlan
    data: DataPlan
    training: TrainingPlan
    draft: DraftPlan
    init_checkpoint: InitCheckpointPlan | None = None
    resume: ResumePlan | None = None
    #: The recipe file this plan came from (absolute), or None for a Python-built recipe.
    recipe_file: str | None = None
    #: Command-line overrides applied, in order.
    overrides: tuple[str, ...] = ()
    #: The recipe's `regenerate:` section; None when the recipe left it at its defaults.
    regenerate: RegeneratePlan | None = None
    #: The recipe's `card:` section; None when the recipe left it at its defaults.
    card: CardPlan | None = None
    #: The target served by vLLM; None (and absent from the JSON): the target runs in the
    #: trainer.
    target_server: TargetServerPlan | None = None
    #: True when the compiler read config.json/headers (not just the schema).
    resolved: bool = False
    format_version: int = PLAN_FORMAT_VERSION

    # -- serialisation ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-compatible dict including `fingerprint`."""
        data = self._plain()
        data["fingerprint"] = _sha256_hex(_canonical(data))
        return data

    def _plain(self) -> dict[str, object]:
        # attrs' reflective asdict, not a cattrs unstructure hook: the plan holds only attrs
        # classes, tuples and JSON scalars, and cattrs would generate (compile) one function
        # per plan class in every process, a third of `compile`'s own time.
        data = attr.asdict(self, retain_collection_types=False)
        if data[_OPTIONAL_KEY] is None:
            # Left out, not null: a plan without a served target is byte for byte (and so
            # fingerprint for fingerprint) the plan this version wrote before the key existed.
            del data[_OPTIONAL_KEY]
        return data

    def canonical_json(self) -> bytes:
        """Canonical bytes (sorted keys, no whitespace) of the plan without the fingerprint."""
        return _canonical(self._plain())

    @property
    def fingerprint(self) -> str:
        """sha256 of :meth:`canonical_json`, hex."""
        return _sha256_hex(self.canonical_json())

    def to_json(self) -> str:
        """Pretty JSON for humans and files; keys sorted, fingerprint included."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> RunPlan:
        """Parse a plan written by :meth:`to_json`; see :meth:`from_dict` for what is checked."""
        try:
            data = parse_json(text, max_int_digits=_PLAN_INT_DIGITS)
        except JsonProblem as exc:
            msg = f"run plan is not valid JSON ({exc.reason}); {RECOMPILE_HINT}"
            raise PlanError(msg) from None
        if not isinstance(data, dict):
            msg = f"run plan must be a JSON object; {RECOMPILE_HINT}"
            raise PlanError(msg)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> RunPlan:
        """Structure a plan dict, checked rather than trusted.

        Refused with PlanError: another format version, a missing fingerprint, a fingerprint
        that does not match the content (the file was edited), values of the wrong type, and
        values the recipe's validators reject (bounds included), each by its dotted path.
        The fingerprint proves integrity, not authorship: whoever can write the file can
        recompute it.
        """
        payload = dict(data)
        stated = payload.pop("fingerprint", None)
        version = payload.get("format_version")
        if version != PLAN_FORMAT_VERSION:
            msg = (
                f"run plan format_version is {shorten(version)}, this dflash-recipes reads "
                f"{PLAN_FORMAT_VERSION}; {RECOMPILE_HINT}"
            )
            raise PlanError(msg)
        if stated is None:
            msg = f"run plan has no fingerprint, so it cannot be checked; {RECOMPILE_HINT}"
            raise PlanError(msg)
        try:
            plan = _plan_converter().structure(payload, cls)
        except Exception as exc:  # cattrs raises ExceptionGroups of many kinds
            msg = f"run plan does not match the plan schema: {_flatten(exc)}; {RECOMPILE_HINT}"
            raise PlanError(msg) from exc
        if stated != plan.fingerprint:
            msg = (
                "run plan fingerprint does not match its content (the file was edited by hand); "
                f"{RECOMPILE_HINT} instead of editing the plan"
            )
            raise PlanError(msg)
        from dflash_recipes.plan.value_checks import plan_value_problems

        problems = plan_value_problems(
            plan.base_model,
            plan.data,
            plan.training,
            plan.draft,
            init_checkpoint=plan.init_checkpoint,
            regenerate=plan.regenerate,
            resume=plan.resume,
            card=plan.card,
            target_server=plan.target_server,
        )
        if problems:
            listed = "\n".join(f"  {problem}" for problem in problems)
            msg = f"run plan has values no recipe can produce; {RECOMPILE_HINT}:\n{listed}"
            raise PlanError(msg)
        return plan

    # -- what the executor asks for ---------------------------------------------------------

    def resolved_draft(self) -> ResolvedDraft:
        """Every value needed to build the drafter, or PlanError naming what is unresolved."""
        from dflash_recipes.plan.draft_spec import resolve_draft

        return resolve_draft(self.draft, self.base_model.facts)


# ---------------------------------------------------------------------------------------------
# JSON policy for plans (plans are machine-written: strict, no coercion, no extra keys)
# ---------------------------------------------------------------------------------------------


@functools.cache
def _plan_converter() -> cattrs.Converter:
    """The strict converter that structures plan JSON (built on the first plan read)."""
    import cattrs  # only where a plan is read: `compile` and `lint` never import it

    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)

    def structure_scalar(value: object, _type: object) -> RopeValue:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        msg = f"expected a JSON scalar, got {type(value).__name__}"
        raise TypeError(msg)

    conv.register_structure_hook(RopeValue, structure_scalar)

    def structure_strict(kind: type) -> Callable[[object, object], object]:
        def hook(value: object, _type: object) -> object:
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                return float(value)
            if type(value) is not kind:
                msg = f"expected {kind.__name__}, got {type(value).__name__} {shorten(value)}"
                raise TypeError(msg)
            return value

        return hook

    for kind in (int, float, str, bool):
        conv.register_structure_hook(kind, structure_strict(kind))
    return conv


def _flatten(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        notes = []
        for sub in exc.exceptions:
            notes.append(_flatten(sub))
        return "; ".join(notes)
    where = " ".join(getattr(exc, "__notes__", []))
    return f"{exc} ({where})" if where else str(exc)


def _canonical(data: object) -> bytes:
    # Encoding policy (docs/dflash.md, "Text that is not Unicode"): paths are str as os.fsdecode
    # gives them, so an undecodable byte is a lone surrogate; surrogatepass hashes any str
    # deterministically, and text without lone surrogates hashes exactly as plain UTF-8.
    return json.dumps(
        data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8", errors="surrogatepass")


__all__ = [
    "PLAN_FORMAT_VERSION",
    "RECOMPILE_HINT",
    "ArchitecturePlan",
    "BaseModelPlan",
    "CardPlan",
    "DataPlan",
    "DraftPlan",
    "InitCheckpointPlan",
    "ObjectivePlan",
    "RegeneratePlan",
    "ResumePlan",
    "RopePlan",
    "RopeValue",
    "RunPlan",
    "TargetFacts",
    "TargetServerPlan",
    "TrainingPlan",
]
