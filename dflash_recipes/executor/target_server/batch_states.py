"""A training batch's target states from the servers: what `run` and `capture` read when the
plan's target is served by vLLM (``target_server``).

:func:`client_settings` turns the plan's :class:`~dflash_recipes.plan.parts.TargetServerPlan`
into the client's settings (the API key read from its environment variable here, never from
the plan). :class:`ServedBatchStates` asks the servers for every conversation of a batch (each
document of a packed row alone: the server computes each conversation by itself, so a packed
row's states are those of its conversations alone) and lays the answers out like the batch,
as :class:`~dflash_recipes.executor.model.convert.CapturedStates`: the taps in
``target_layer_ids`` order (each tap's row of the file, vLLM id ``k + 1`` for tap ``k``) and,
when the objective has a teacher, the last decoder layer's output before the final norm
(vLLM id ``num_hidden_layers``), which is the input of the final norm the trainer's teacher
logits are computed from. It runs on the prefetch thread, ahead of the step. With
``keep_files: capture`` (:func:`kept_states`) a conversation answered once is read back from
its kept file in later epochs, on a resume and in a rerun, without a request
(:mod:`~dflash_recipes.executor.target_server.kept_states`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from dflash_recipes.errors import PlanError
from dflash_recipes.executor.data.train_dataset import Batch
from dflash_recipes.executor.model.convert import CapturedStates
from dflash_recipes.executor.target_server.client import TargetServerClient
from dflash_recipes.executor.target_server.kept_states import (
    KeptStates,
    ServedConversations,
    kept_folder,
)
from dflash_recipes.executor.target_server.settings import TargetServerSettings
from dflash_recipes.executor.target_server.states_file import ExpectedStates, ServedStates
from dflash_recipes.plan.parts import TargetServerPlan
from dflash_recipes.plan.run_plan import RunPlan


def served_target(plan: RunPlan) -> TargetServerPlan:
    """The plan's resolved ``target_server`` (PlanError when it has none or is unresolved)."""
    served = plan.target_server
    if served is None or served.vllm_layer_ids is None or served.tap_rows is None:
        msg = "the plan has no resolved target_server section; compile the recipe again"
        raise PlanError(msg)
    return served


def kept_states(plan: RunPlan) -> KeptStates | None:
    """The folder of kept states of the plan (``keep_files: capture``; created), else None."""
    served = served_target(plan)
    facts = plan.base_model.facts
    if served.keep_files != "capture" or served.capture_dir is None or facts is None:
        return None
    assert served.vllm_layer_ids is not None
    expected = ExpectedStates(served.vllm_layer_ids, facts.hidden_size, served.dtype)
    folder = kept_folder(
        Path(served.capture_dir),
        base_model=Path(plan.base_model.path),
        served_model_name=served.served_model_name,
        expected=expected,
    )
    return KeptStates(folder, expected)


def client_settings(plan: RunPlan, kept: KeptStates | None = None) -> TargetServerSettings:
    """The client's settings from the plan (PlanError for an unresolved plan); checked files
    are moved into `kept`'s folder (None: deleted once read)."""
    served = served_target(plan)
    facts = plan.base_model.facts
    if facts is None:
        msg = "the plan has no target facts (hidden size); compile the recipe again"
        raise PlanError(msg)
    assert served.vllm_layer_ids is not None
    api_key = os.environ.get(served.api_key_env) if served.api_key_env else None
    return TargetServerSettings(
        urls=served.urls,
        storage_dir=Path(served.storage_dir),
        served_model_name=served.served_model_name,
        layer_ids=served.vllm_layer_ids,
        hidden_size=facts.hidden_size,
        dtype=served.dtype,
        max_in_flight=served.max_in_flight,
        timeout_s=served.timeout_s,
        retries=served.retries,
        backoff_s=served.backoff_s,
        lock_timeout_s=served.lock_timeout_s,
        keep_dir=None if kept is None else kept.folder,
        api_key=api_key,
    )


def batch_conversations(batch: Batch) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every conversation of `batch`: each row's tokens up to its
    padding, or each document of a packed row (document ids >= 0)."""
    spans: list[tuple[int, int, int]] = []
    if batch.document_ids is None:
        lengths = batch.attention_mask.sum(dim=1).tolist()
        return [(row, 0, int(n)) for row, n in enumerate(lengths) if n > 0]
    for row, docs in enumerate(batch.document_ids.tolist()):
        start = 0
        for position in range(1, len(docs) + 1):
            if position == len(docs) or docs[position] != docs[start]:
                if docs[start] >= 0:
                    spans.append((row, start, position))
                start = position
    return spans


def split_rows(
    states: Tensor, tap_rows: Sequence[int], final_row: int | None
) -> tuple[Tensor, Tensor | None]:
    """A served file's ``[T, n_layers, H]`` states as ``([T, n_taps, H]`` taps in
    ``target_layer_ids`` order, ``[T, H]`` last layer before the final norm or None)."""
    taps = states[:, list(tap_rows)]
    return taps, None if final_row is None else states[:, final_row]


class ServedBatchStates:
    """Each batch's states from the servers, laid out like the batch (see the module
    docstring); `names` (optional) say what the messages call each conversation."""

    def __init__(
        self, client: TargetServerClient, plan: RunPlan, kept: KeptStates | None = None
    ) -> None:
        served = served_target(plan)
        assert served.tap_rows is not None
        self.client = client
        #: The conversations' states: read back from `kept`, or asked of the servers.
        self.conversations = ServedConversations(client, kept)
        self.tap_rows = served.tap_rows
        self.final_row = served.final_row

    def __call__(self, batch: Batch, names: Sequence[int] | None = None) -> CapturedStates:
        spans = batch_conversations(batch)
        ids = batch.input_ids
        answers = self.conversations(
            [ids[row, start:end].tolist() for row, start, end in spans], names
        )
        return self.layout(batch, spans, answers)

    def layout(
        self,
        batch: Batch,
        spans: Sequence[tuple[int, int, int]],
        answers: Sequence[ServedStates],
    ) -> CapturedStates:
        """The answers placed at their conversations' rows and positions, zeros elsewhere."""
        rows, length = batch.input_ids.shape
        first = answers[0].hidden_states
        hidden, dtype = int(first.shape[-1]), first.dtype
        tapped = torch.zeros(rows, length, len(self.tap_rows) * hidden, dtype=dtype)
        last: Tensor | None = None
        if self.final_row is not None:
            last = torch.zeros(rows, length, hidden, dtype=dtype)
        for (row, start, end), answer in zip(spans, answers, strict=True):
            taps, final = split_rows(answer.hidden_states, self.tap_rows, self.final_row)
            tapped[row, start:end] = taps.reshape(end - start, -1)
            if last is not None and final is not None:
                last[row, start:end] = final
        return CapturedStates(tapped, last, documents_alone=True)


__all__ = [
    "ServedBatchStates",
    "batch_conversations",
    "client_settings",
    "kept_states",
    "served_target",
    "split_rows",
]
