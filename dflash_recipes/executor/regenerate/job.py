"""`dflash-recipe regenerate`: training conversations answered by the target itself.

The user, system and tool turns of each input conversation are kept; every assistant turn is
replaced by the target's answer to the conversation up to that point, turn by turn, so later
turns see the target's own earlier answers (their tool calls and reasoning too) and the
original tool results. The row's ``tools`` go with every request and into the output row; the
target's tool calls are kept as it returns them (see
:mod:`~dflash_recipes.executor.regenerate.types` for a target that calls other tools than the
row answers). ``regenerate.thinking`` sends ``chat_template_kwargs.enable_thinking`` (on, off,
or both: two output rows per conversation, marked ``"thinking": true/false``). A conversation
that ends with a user turn gets an answer appended (a file of prompts works too). With
``first_turn_only`` the conversation is cut after its first assistant turn.

Two backends: an OpenAI-compatible server (``regenerate.base_url``: vLLM, SGLang; see
:mod:`dflash_recipes.executor.regenerate.server`) or local transformers generation with the
plan's base model (tiny targets, the demo and tests; :mod:`~.regenerate_local`).

Never losing work: every finished conversation is appended at once, as one whole line in one
``write``, to the journal ``OUTPUT.parts/journal.jsonl``; every ``SHARD_SIZE`` conversations
the journal is sealed into an immutable ``part-NNNNN.jsonl`` written atomically. A crash or
``kill -9`` loses only the requests in flight (a torn journal line is ignored). A rerun with
the same output skips every conversation already answered: it is keyed by a content hash of
its prompt turns (:func:`~dflash_recipes.files.regenerate_output.prompt_key`), so a reordered
input
resumes too. At the end ``OUTPUT`` is assembled atomically from the shards (each conversation
of this input once, in the order they were answered) and the summary goes to
``OUTPUT.summary.json``. The folder ``OUTPUT.parts`` is locked for the whole run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs

from dflash_recipes.data.conversations import openai_messages, read_conversations, summarize
from dflash_recipes.errors import DataError, RegenerateError
from dflash_recipes.executor.regenerate.types import (
    Answer,
    Job,
    Outcome,
    TurnFailed,
    apply_reasoning,
    build_jobs,
    finished_outcome,
)
from dflash_recipes.files.crashsafe import atomic_replace, write_text_atomic
from dflash_recipes.files.locking import hold_directory_lock
from dflash_recipes.files.regenerate_output import parts_dir, summary_path
from dflash_recipes.plan.regenerate_settings import default_regenerate_plan, output_problem
from dflash_recipes.plan.run_plan import RegeneratePlan, RunPlan

logger = logging.getLogger(__name__)

Echo = Callable[[str], None]

#: Conversations per sealed shard.
SHARD_SIZE = 1000
JOURNAL = "journal.jsonl"
_PART = re.compile(r"part-(\d{5,})\.jsonl")
#: At most this many failures are listed one by one in the summary.
_FAILURES_LISTED = 200


# ---------------------------------------------------------------------------------------------
# jobs: what to regenerate
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# answers
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# the shard store
# ---------------------------------------------------------------------------------------------


class ShardStore:
    """Finished conversations of one output, in ``OUTPUT.parts/`` (module docstring)."""

    def __init__(self, folder: Path, *, shard_size: int = SHARD_SIZE) -> None:
        self.folder = folder
        self.shard_size = shard_size
        self.keys: set[str] = set()
        self._pending: list[str] = []
        self._next_part = 0
        self._fd: int | None = None

    # -- reading -------------------------------------------------------------------------------

    def _parts(self) -> list[Path]:
        found = []
        for path in self.folder.iterdir():
            match = _PART.fullmatch(path.name)
            if match:
                found.append((int(match.group(1)), path))
        return [path for _, path in sorted(found)]

    @staticmethod
    def _records(path: Path) -> Iterator[dict[str, object]]:
        """The whole, valid records of a shard; a torn or foreign line is passed over."""
        with path.open("rb") as handle:
            for raw in handle:
                if not raw.endswith(b"\n"):
                    return  # the line being written when the process died
                try:
                    record = json.loads(raw)
                except (ValueError, UnicodeDecodeError):
                    continue
                if isinstance(record, dict) and isinstance(record.get("key"), str):
                    yield record

    def records(self) -> Iterator[dict[str, object]]:
        """Every stored record once (first copy of a key wins), parts first, then the journal."""
        seen: set[str] = set()
        sources = self._parts()
        journal = self.folder / JOURNAL
        if journal.is_file():
            sources.append(journal)
        for path in sources:
            for record in self._records(path):
                key = str(record["key"])
                if key not in seen:
                    seen.add(key)
                    yield record

    # -- writing -------------------------------------------------------------------------------

    def open(self) -> None:
        """Load the keys already answered; seal what a killed run left in the journal."""
        self.folder.mkdir(parents=True, exist_ok=True)
        parts = self._parts()
        if parts:
            match = _PART.fullmatch(parts[-1].name)
            assert match is not None
            self._next_part = int(match.group(1)) + 1
        in_parts: set[str] = set()
        for path in parts:
            in_parts.update(str(r["key"]) for r in self._records(path))
        self.keys = set(in_parts)
        journal = self.folder / JOURNAL
        leftover: list[str] = []
        if journal.is_file():
            for record in self._records(journal):
                key = str(record["key"])
                if key not in self.keys:
                    self.keys.add(key)
                    leftover.append(json.dumps(record, ensure_ascii=False) + "\n")
        if leftover:
            self._write_part(leftover)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        self._fd = os.open(journal, flags, 0o644)

    def add(self, key: str, record: dict[str, object]) -> None:
        """Persist one finished conversation now (one whole line, one write)."""
        assert self._fd is not None, "open() the store first"
        line = json.dumps({"key": key, **record}, ensure_ascii=False) + "\n"
        data = line.encode("utf-8")
        written = os.write(self._fd, data)
        while written < len(data):  # a short write (full disk, signals) is finished, not torn
            written += os.write(self._fd, data[written:])
        self.keys.add(key)
        self._pending.append(line)
        if len(self._pending) >= self.shard_size:
            self.seal()

    def seal(self) -> None:
        """Turn the journal's records into an atomically written part and empty the journal."""
        if not self._pending:
            return
        self._write_part(self._pending)
        self._pending = []
        assert self._fd is not None
        os.ftruncate(self._fd, 0)

    def _write_part(self, lines: Sequence[str]) -> None:
        path = self.folder / f"part-{self._next_part:05d}.jsonl"
        write_text_atomic(path, "".join(lines))
        self._next_part += 1

    def close(self) -> None:
        """Seal the journal and close it."""
        if self._fd is None:
            return
        try:
            self.seal()
        finally:
            os.close(self._fd)
            self._fd = None


# ---------------------------------------------------------------------------------------------
# the summary
# ---------------------------------------------------------------------------------------------


@attrs.define
class RegenerateSummary:
    """What a regenerate did; written to ``OUTPUT.summary.json`` and printed."""

    output: str
    input: str
    backend: str
    model: str
    #: Usable conversations in the input.
    conversations: int = 0
    #: Conversations answered by this run.
    answered: int = 0
    #: Conversations already answered by an earlier run (not sent again).
    skipped: int = 0
    failed: int = 0
    #: [{"line": n, "reason": "..."}] for the first failures.
    failures: list[dict[str, object]] = attrs.field(factory=list)
    #: Failure reasons and how often each occurred.
    failure_reasons: dict[str, int] = attrs.field(factory=dict)
    #: Input lines that could not be used: [{"line": n, "kind": "...", "reason": "..."}].
    bad_lines: list[dict[str, object]] = attrs.field(factory=list)
    #: Conversations that ended early: the target's tool calls did not match the row's results.
    diverged: int = 0
    #: Answered turns, and how many stopped at max_new_tokens or came back empty.
    turns: int = 0
    truncated: int = 0
    empty: int = 0
    tokens_generated: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    #: Conversations in the final output file.
    written: int = 0
    interrupted: bool = False

    def record(self, outcome: Outcome) -> None:
        if outcome.failure is not None:
            self.failed += 1
            reason = outcome.failure
            self.failure_reasons[_reason_kind(reason)] = (
                self.failure_reasons.get(_reason_kind(reason), 0) + 1
            )
            if len(self.failures) < _FAILURES_LISTED:
                self.failures.append({"line": outcome.job.line, "reason": reason})
            return
        self.answered += 1
        self.turns += sum(1 for m in outcome.messages if m.role == "assistant")
        self.diverged += outcome.diverged
        self.truncated += outcome.truncated
        self.empty += outcome.empty
        self.tokens_generated += outcome.tokens

    def to_dict(self) -> dict[str, object]:
        data = attrs.asdict(self)
        assert isinstance(data, dict)
        return data

    def text(self) -> str:
        lines = [
            f"regenerated {self.answered} conversation(s) ({self.turns} turns), skipped "
            f"{self.skipped} already answered, failed {self.failed}",
            f"  {self.tokens_generated} tokens in {self.seconds:.1f}s "
            f"({self.tokens_per_s:.1f} tokens/s); {self.truncated} answer(s) cut at "
            f"max_new_tokens, {self.empty} empty",
        ]
        if self.diverged:
            lines.append(
                f"  {self.diverged} conversation(s) end early: the target's tool calls did not "
                "match the row's tool results"
            )
        if self.failure_reasons:
            reasons = ", ".join(f"{n} {kind}" for kind, n in self.failure_reasons.items())
            lines.append(f"  failures: {reasons} (rerun the same command to retry them)")
        if self.bad_lines:
            lines.append(f"  input lines not used: {len(self.bad_lines)} (see the summary file)")
        lines.append(f"  wrote {self.written} conversation(s) to {self.output}")
        return "\n".join(lines)


def _reason_kind(reason: str) -> str:
    return reason.split(":", 1)[0]


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------


def _record_for(outcome: Outcome) -> dict[str, object]:
    job = outcome.job
    record: dict[str, object] = {
        "line": job.line,
        "messages": openai_messages(outcome.messages),
    }
    if job.tools is not None:
        record["tools"] = json.loads(job.tools)
    if job.tag is not None:
        record["tag"] = job.tag
    if job.thinking is not None:
        record["thinking"] = job.thinking
    return record


#: The keys of a stored record the final JSONL keeps (besides messages, when present).
_ROW_KEYS = ("tools", "tag", "thinking")


def resolve_paths(
    plan: RunPlan, input_path: Path | None, output_path: Path | None
) -> tuple[Path, Path]:
    """(input, output), absolute, from the command line or else the plan; RegenerateError."""
    settings = plan.regenerate or default_regenerate_plan(plan.training.training_seq_len)
    if input_path is None:
        if plan.data.data_path is None:
            msg = (
                "no input: set data.data_path in the recipe, or pass --input FILE (JSONL "
                "conversations, as training reads them)"
            )
            raise RegenerateError(msg)
        input_path = Path(plan.data.data_path)
    if output_path is None:
        if settings.output_path is None:
            msg = (
                "no output: set regenerate.output_path in the recipe, or pass --output FILE "
                "(the regenerated JSONL; its shards go to FILE.parts/)"
            )
            raise RegenerateError(msg)
        output_path = Path(settings.output_path)
    source = Path(os.path.abspath(input_path))
    output = Path(os.path.abspath(output_path))
    problem = output_problem(output, source)
    if problem is not None:
        _code, message, hint = problem
        msg = f"{message}; {hint}"
        raise RegenerateError(msg)
    return source, output


def run_regenerate(
    plan: RunPlan,
    *,
    input_path: Path | None = None,
    output_path: Path | None = None,
    progress: bool = True,
    echo: Echo = print,
    backoff_base_s: float = 0.5,
) -> RegenerateSummary:
    """Regenerate the plan's data (or `input_path`) into `output_path` (module docstring).

    Raises DataError for an input without a usable conversation, RegenerateError when the
    server or the output cannot be used (before any conversation is sent), and
    DirectoryLockedError when another process writes the same output.
    """
    settings = plan.regenerate or default_regenerate_plan(plan.training.training_seq_len)
    source, output = resolve_paths(plan, input_path, output_path)
    file = read_conversations(source, answer_only_loss=False, setting="--input (or data.data_path)")
    jobs, unusable = build_jobs(
        file.conversations,
        first_turn_only=settings.first_turn_only,
        thinking=settings.thinking,
    )
    bad = sorted([*file.skipped, *unusable], key=lambda s: s.line)
    if bad:
        echo(f"{source}: {summarize(len(jobs), bad)}")
    if not jobs:
        msg = f"no conversation in {source} can be regenerated ({summarize(0, bad)})"
        raise DataError(msg)
    backend = settings.base_url if settings.base_url is not None else "local transformers"
    summary = RegenerateSummary(
        output=str(output),
        input=str(source),
        backend=backend,
        model=settings.model or plan.base_model.path,
        conversations=len(jobs),
        bad_lines=[{"line": s.line, "kind": s.kind, "reason": s.reason} for s in bad],
    )
    with hold_directory_lock(parts_dir(output), purpose="regenerate"):
        store = ShardStore(parts_dir(output))
        try:
            store.open()
        except OSError as exc:
            msg = (
                f"cannot use {store.folder} for the output's shards: {exc.strerror or exc}; "
                "fix its permissions or choose another --output"
            )
            raise RegenerateError(msg) from exc
        todo = [job for job in jobs if job.key not in store.keys]
        summary.skipped = len(jobs) - len(todo)
        if summary.skipped:
            echo(f"resuming: {summary.skipped} conversation(s) already answered in {output}.parts")
        started = time.perf_counter()
        try:
            if todo:
                _generate(plan, settings, todo, store, summary, progress, backoff_base_s)
        except KeyboardInterrupt:
            summary.interrupted = True
            raise
        finally:
            store.close()
            summary.seconds = time.perf_counter() - started
            summary.tokens_per_s = summary.tokens_generated / max(summary.seconds, 1e-9)
            if not summary.interrupted and summary.failed + summary.answered == len(todo):
                summary.written = _assemble(store, {job.key for job in jobs}, output)
            if summary.answered or summary.failed or summary.interrupted or not todo:
                # (a run stopped by its first request has nothing to summarise)
                write_text_atomic(
                    summary_path(output), json.dumps(summary.to_dict(), indent=2, sort_keys=True)
                )
    echo(summary.text())
    return summary


def _generate(
    plan: RunPlan,
    settings: RegeneratePlan,
    todo: Sequence[Job],
    store: ShardStore,
    summary: RegenerateSummary,
    progress: bool,
    backoff_base_s: float,
) -> None:
    from tqdm.auto import tqdm

    started = time.perf_counter()
    bar = tqdm(total=len(todo), unit="conv", disable=not progress, desc="regenerate")

    def done(outcome: Outcome) -> None:
        if outcome.failure is None:
            try:
                store.add(outcome.job.key, _record_for(outcome))
            except OSError as exc:
                msg = (
                    f"cannot write to {store.folder}: {exc.strerror or exc}; free space or fix "
                    "the permissions and rerun the same command (what is answered is kept)"
                )
                raise RegenerateError(msg) from exc
        else:
            logger.warning("line %d failed: %s", outcome.job.line, outcome.failure)
        summary.record(outcome)
        elapsed = max(time.perf_counter() - started, 1e-9)
        bar.update(1)
        bar.set_postfix(
            {"tok/s": f"{summary.tokens_generated / elapsed:.0f}", "failed": summary.failed},
            refresh=False,
        )

    try:
        if settings.base_url is not None:
            from dflash_recipes.executor.regenerate.server import regenerate_with_server

            summary.model = regenerate_with_server(
                settings, todo, done, backoff_base_s=backoff_base_s
            )
        else:
            from dflash_recipes.executor.regenerate.local import regenerate_locally

            regenerate_locally(plan, settings, todo, done)
    finally:
        bar.close()


def _assemble(store: ShardStore, wanted: set[str], output: Path) -> int:
    """Write the final JSONL (the conversations of this input, once each) atomically."""
    count = 0
    with atomic_replace(output) as tmp, tmp.open("w", encoding="utf-8") as handle:
        for record in store.records():
            if record["key"] not in wanted:
                continue
            row = {"messages": record["messages"]}
            row.update({k: record[k] for k in _ROW_KEYS if k in record})
            handle.write(json.dumps(row, ensure_ascii=False))
            handle.write("\n")
            count += 1
    return count


__all__ = [
    "SHARD_SIZE",
    "Answer",
    "Job",
    "Outcome",
    "RegenerateSummary",
    "ShardStore",
    "TurnFailed",
    "apply_reasoning",
    "build_jobs",
    "finished_outcome",
    "resolve_paths",
    "run_regenerate",
]
