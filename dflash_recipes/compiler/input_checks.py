"""The compile's inputs on disk: base model directory (and what its config.json says of its
layers: packing, attention implementation), data files, captured hidden states, and the output
directory (a usable one, and a resume when it holds a complete checkpoint).

The reading phase's :func:`resolve_base_model` and :func:`resolve_output` return what they read
(the base model's facts, the output directory's resume); :func:`check_capture` needs the taps the
id checks resolved, so it runs after them.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from dflash_recipes.checkpoint.hfconfig import TargetConfig, read_target_config
from dflash_recipes.checkpoint.model_paths import inspect_model_dir
from dflash_recipes.checkpoint.target_facts import TargetFacts
from dflash_recipes.checkpoint.target_layers import (
    ATTENTION_LAYER_TYPES,
    KNOWN_ATTENTION_IMPLEMENTATIONS,
)
from dflash_recipes.compiler.codes import (
    DATA_COLUMNS_MISSING,
    DATA_FILE_MISSING,
    DATA_HUB_ID,
    DATA_PATH_UNSET,
    DATA_UNREADABLE,
    INIT_CHECKPOINT_IGNORED,
    OUTPUT_DIR_UNUSABLE,
    PACKING_OFFLINE,
    PACKING_RECURRENT_LAYERS,
    RESUME_FROM_CHECKPOINT,
    TARGET_ATTN_IMPLEMENTATION,
    TARGET_LAYER_TYPE_UNKNOWN,
    TRACKER_LIBRARY_MISSING,
)
from dflash_recipes.compiler.state import (
    INIT_PATH,
    MODEL_PATH,
    CompileInputs,
    OutputDir,
    Report,
)
from dflash_recipes.data.sources import hub_id_hint
from dflash_recipes.diagnostics import Severity, register_code
from dflash_recipes.errors import DataError, DFlashRecipeError
from dflash_recipes.files.jsonio import FileReadProblem, clip, file_kind, read_regular_file
from dflash_recipes.files.run_dir import PLAN_FILE, latest_complete_checkpoint
from dflash_recipes.plan.parts import ResumePlan
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.recipe.choices import SUPERVISED_PARTS, TRACKER_LIBRARIES

DATA_SUPERVISE_UNUSED = register_code(
    "data-supervise-unused",
    Severity.WARNING,
    "data.supervise leaves parts out, but without data.answer_only_loss every token is supervised",
)


def resolve_base_model(inputs: CompileInputs, report: Report) -> TargetFacts | None:
    """The base model's facts from its config.json, or None (reported) when the directory or
    the file cannot be used."""
    value = inputs.recipe.model.model_name_or_path
    problem = inspect_model_dir(value, base_dir=inputs.base_dir)
    if problem is not None:
        report.emit(
            f"base-model-{problem.kind}", MODEL_PATH, problem.message, inputs.folder_fix(problem)
        )
        return None
    read = read_target_config(inputs.absolute(value))
    for item in read.problems:
        report.emit_problem(item, MODEL_PATH, f"base model {read.path}")
    check_target_layers(inputs, read, report)
    return read.facts


# The target's layers: a packed row's conversations are kept apart by per-document attention
# masks; a layer that carries a state across tokens (linear attention, state-space layers)
# cannot be, so packing is refused for such a target (the family and the layer type named). A
# layer type this project does not know is a warning (the run's start-up isolation check
# decides for it); an attention implementation in config.json that cannot load offline (a hub
# kernel, or a name transformers does not have) is an error: the target would not load at `run`.
def check_target_layers(inputs: CompileInputs, read: TargetConfig, report: Report) -> None:
    """Refuse packing for a recurrent target and an attention implementation that cannot load;
    warn about layer types this project does not know."""
    layers = read.layers
    family = layers.model_type or "this target"
    data = inputs.recipe.data
    blockers = layers.packing_blockers()
    if data.packing and data.hidden_states_path is None and blockers:
        report.emit(
            PACKING_RECURRENT_LAYERS,
            "data.packing",
            f"data.packing is true, but the target ({family}, {read.path}) has "
            f"{' and '.join(blockers)}: their state runs from one token to the next across "
            "a packed row's document boundary, so every conversation after the first would be "
            "trained on states the target never produces when it serves",
            "set data.packing=false (one conversation per row, padded)",
        )
    unknown = layers.unknown_layer_types()
    if unknown:
        report.emit(
            TARGET_LAYER_TYPE_UNKNOWN,
            MODEL_PATH,
            f"the target's config.json ({read.path}) declares layer types "
            f"{', '.join(map(repr, unknown))} in `{layers.where}`; dflash-recipes knows "
            f"{', '.join(ATTENTION_LAYER_TYPES)} and the recurrent kinds",
            "a packed run checks at start-up that each conversation gets the states it gets "
            "alone and stops if not; data.packing=false needs no check",
        )
    implementation = layers.attn_implementation
    if implementation is not None and implementation not in KNOWN_ATTENTION_IMPLEMENTATIONS:
        report.emit(
            TARGET_ATTN_IMPLEMENTATION,
            MODEL_PATH,
            f"the target's config.json ({read.path}) asks for attention implementation "
            f"{implementation!r}, a kernel fetched from the Hub or a name transformers does "
            "not have; dflash-recipes never downloads code, so the target cannot load",
            "delete `attn_implementation` from the target's config.json: transformers then "
            f"runs the family's default ({', '.join(KNOWN_ATTENTION_IMPLEMENTATIONS)} load "
            "as named)",
        )


def check_data(inputs: CompileInputs, report: Report) -> None:
    """data.data_path, data.chat_template and data.eval_data_path exist (and the conversation
    files have a conversation column); an unset data.data_path is said once."""
    data = inputs.recipe.data
    if data.data_path is None and data.hidden_states_path is None:
        report.emit(
            DATA_PATH_UNSET,
            "data.data_path",
            "data.data_path is not set; the plan compiles, but `dflash-recipe run` needs a "
            "JSONL file of training conversations",
            "set data.data_path: /path/to/train.jsonl (one conversation per line)",
        )
    if data.packing and data.hidden_states_path is not None:
        report.emit(
            PACKING_OFFLINE,
            "data.packing",
            "data.packing is true with offline training (data.hidden_states_path): a capture "
            "holds one conversation per row and its states were computed without the packed "
            "row's per-document mask, so packed rows cannot be read from it",
            "set data.packing: false for offline training, or drop data.hidden_states_path "
            "to train online (the target runs per packed row)",
        )
    if not data.answer_only_loss and tuple(data.supervise) != SUPERVISED_PARTS:
        report.emit(
            DATA_SUPERVISE_UNUSED,
            "data.supervise",
            f"data.supervise is {list(data.supervise)}, but data.answer_only_loss is false: "
            "every token is supervised, so no part is left out of the loss",
            "set data.answer_only_loss: true to supervise only those assistant parts, or drop "
            "data.supervise",
        )
    fields = (
        ("data_path", data.data_path, "a JSONL file of training conversations"),
        ("chat_template", data.chat_template, "a .jinja chat template file"),
        ("eval_data_path", data.eval_data_path, "a JSONL file of held-out conversations"),
    )
    for name, value, what in fields:
        if value is None:
            continue
        path = inputs.absolute(value)
        try:
            exists, is_file = path.exists(), path.is_file()
        except OSError:
            exists, is_file = False, False
        conversations = name != "chat_template"
        if conversations and exists:
            _check_columns(f"data.{name}", path, report)
            continue
        if is_file:
            continue
        hint = hub_id_hint(value, f"data.{name}") if conversations else None
        if hint is not None:
            report.emit(
                DATA_HUB_ID,
                f"data.{name}",
                f"data.{name} {value!r} is not a local file or folder; it looks like a "
                "Hugging Face Hub dataset id, and runs never download data",
                hint,
            )
            continue
        problem = "is a directory, not a file" if exists else "does not exist"
        base = "the recipe's folder" if inputs.base_dir is not None else "the working directory"
        report.emit(
            DATA_FILE_MISSING,
            f"data.{name}",
            f"data.{name} {path} {problem} ({what} expected)",
            f"point data.{name} at {what} (a relative path is resolved against {base})",
        )


def _check_columns(field: str, path: Path, report: Report) -> None:
    """The input's columns from its schema alone (never its rows)."""
    from dflash_recipes.data.sources import (
        CONVERSATION_COLUMNS,
        describe_columns,
        resolve_source,
        source_columns,
    )

    try:
        source = resolve_source(path, setting=field)
        columns = source_columns(source)
    except DataError as exc:
        report.emit(
            DATA_UNREADABLE,
            field,
            str(exc),
            f"point {field} at a readable JSONL, Parquet or Arrow file, or a folder of them",
        )
        return
    if columns is None or any(c in columns for c in CONVERSATION_COLUMNS):
        return
    first = source.files[0][0]
    report.emit(
        DATA_COLUMNS_MISSING,
        field,
        f"{first} has no 'messages' (OpenAI) or 'conversations' (ShareGPT) column; its "
        f"columns: {describe_columns(columns)}",
        "rename the column that holds the turns to 'messages' (role/content) or "
        "'conversations' (from/value), or point "
        f"{field} at another input",
    )


def check_capture(
    inputs: CompileInputs,
    facts: TargetFacts | None,
    taps: Sequence[int] | None,
    report: Report,
) -> None:
    """data.hidden_states_path against the plan: manifest and shard headers only."""
    recipe = inputs.recipe
    data = recipe.data
    if data.hidden_states_path is None or taps is None or facts is None:
        return
    # Imported here: only an offline recipe pays for the capture checks at start-up.
    from dflash_recipes.checkpoint.kinds.protocol import ObjectiveTerms
    from dflash_recipes.checkpoint.kinds.registry import needs_teacher
    from dflash_recipes.compiler import capture_checks
    from dflash_recipes.files.capture_manifest import (
        base_config_sha256,
        chat_template_sha256,
        tokenizer_sha256,
    )

    objective = recipe.dflash
    base = inputs.absolute(recipe.model.model_name_or_path)
    template = inputs.absolute(data.chat_template) if data.chat_template else None
    expect = capture_checks.CaptureExpectation(
        target_layer_ids=tuple(taps),
        hidden_size=facts.hidden_size,
        dtype=recipe.model.dtype,
        training_seq_len=recipe.training.training_seq_len,
        answer_only_loss=data.answer_only_loss,
        supervise=tuple(data.supervise),
        needs_last_hidden=needs_teacher(
            inputs.arch.projector_type,
            ObjectiveTerms(
                self_logit_distillation=objective.dflash_self_logit_distillation,
                dspark_tv_weight=float(objective.dflash_dspark_tv_weight),
            ),
        ),
        base_config_sha256=base_config_sha256(base),
        tokenizer_sha256=tokenizer_sha256(base),
        chat_template_sha256=chat_template_sha256(str(template) if template else None, base),
        data_sha256=_data_sha256(inputs.absolute(data.data_path)) if data.data_path else None,
        block_size=objective.dflash_block_size,
    )
    directory = inputs.absolute(data.hidden_states_path)
    for finding in capture_checks.check_capture(directory, expect):
        report.emit(finding.code, "data.hidden_states_path", finding.message, finding.hint)


def resolve_output(inputs: CompileInputs, report: Report) -> OutputDir:
    """training.output_dir is usable; a complete checkpoint in it is the run's resume (with the
    plan the resumed run was started with), and makes dflash_init_checkpoint unused."""
    output_dir = inputs.absolute(inputs.recipe.training.output_dir)
    unusable = output_dir_problem(output_dir)
    if unusable is not None:
        report.emit(
            OUTPUT_DIR_UNUSABLE,
            "training.output_dir",
            f"training.output_dir {clip(str(output_dir))} {unusable}; checkpoints, "
            "metrics and the export are written into a directory",
            "point training.output_dir at a new or existing directory",
        )
        return OutputDir()
    try:  # output_dir_problem refused a file here already
        latest = latest_complete_checkpoint(output_dir)
    except OSError as exc:
        report.emit(
            OUTPUT_DIR_UNUSABLE,
            "training.output_dir",
            f"training.output_dir {output_dir} cannot be listed: {exc.strerror or exc}",
            "make it readable and writable by this user, or choose another directory",
        )
        return OutputDir()
    if latest is None:
        return OutputDir()
    step, checkpoint = latest
    resume = ResumePlan(checkpoint_dir=str(checkpoint), step=step)
    report.emit(
        RESUME_FROM_CHECKPOINT,
        "training.output_dir",
        f"training.output_dir holds a complete training checkpoint at step {step} "
        f"({checkpoint}); the run resumes from it",
        "to start a new run instead, point training.output_dir at another directory",
    )
    previous_plan = _read_previous_plan(output_dir / PLAN_FILE)
    if inputs.recipe.dflash.dflash_init_checkpoint is not None:
        report.emit(
            INIT_CHECKPOINT_IGNORED,
            INIT_PATH,
            f"dflash_init_checkpoint is ignored because the run resumes from {checkpoint}; "
            "it is not read and need not exist any more",
            "nothing to do; to warm-start a new run from it, change training.output_dir",
        )
    return OutputDir(resume=resume, previous_plan=previous_plan)


def output_dir_problem(path: Path) -> str | None:
    """Why `run` could not create or use `path` as its output directory, or None.

    Checked without creating anything: a NUL byte, a folder (or the path itself) that is a
    file or another non-directory, or a path the file system refuses (e.g. a name too long).
    """
    text = os.fspath(path)
    if "\0" in text:
        return "contains a NUL byte, which no file system accepts"
    probe = path
    while True:
        try:
            info = os.stat(probe)
        except FileNotFoundError:
            if probe.parent == probe:
                return None
            probe = probe.parent
            continue
        except NotADirectoryError:
            probe = probe.parent
            continue
        except OSError as exc:
            return f"cannot be used: {exc.strerror or exc}"
        if stat.S_ISDIR(info.st_mode):
            return None
        if probe == path:
            return f"exists and is {file_kind(info.st_mode)}, not a directory"
        return f"lies below {probe}, which is {file_kind(info.st_mode)}, not a directory"


def check_tracker_libraries(inputs: CompileInputs, report: Report) -> None:
    """training.report_to: each tracker's package must be installed where this compiles (looked
    for, never imported: compile stays fast). `run` checks again at start, importing it."""
    import importlib.util

    for name in inputs.recipe.training.report_to:
        library = TRACKER_LIBRARIES[name]
        try:
            found = importlib.util.find_spec(library) is not None
        except (ImportError, ValueError):  # ValueError: blocked as sys.modules[name] = None
            found = False
        if found:
            continue
        report.emit(
            TRACKER_LIBRARY_MISSING,
            "training.report_to",
            f"training.report_to names {name}, but the {library} package is not installed in "
            f"this Python ({clip(sys.executable)}): the run would train without tracking",
            f"pip install 'dflash-recipes[{name}]', or remove {name} from training.report_to",
        )


def _data_sha256(path: Path) -> str | None:
    from dflash_recipes.data.sources import input_sha256

    return input_sha256(path)  # None: data-file-missing or data-unreadable reports it


def _read_previous_plan(path: Path) -> RunPlan | None:
    """The plan a resumed run was started with, or None when absent or unreadable."""
    try:
        return RunPlan.from_json(read_regular_file(path, max_bytes=16 * 2**20))
    except (FileReadProblem, DFlashRecipeError):
        return None


__all__ = [
    "check_capture",
    "check_data",
    "check_target_layers",
    "check_tracker_libraries",
    "output_dir_problem",
    "resolve_base_model",
    "resolve_output",
]
