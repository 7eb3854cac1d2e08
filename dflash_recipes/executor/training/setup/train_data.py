"""The data builder: the plan's training data, the endless stream of batches, the captured rows.

:func:`build_train_data` returns a :class:`TrainData`: the tokenized dataset (online, from
``data.data_path``) or the samples of a capture (offline, ``data.hidden_states_path``), this
rank's stream of batches from any resume position (:meth:`TrainData.stream`, epoch after
epoch), and, offline, the captured target states of a batch's rows
(:meth:`TrainData.captured_states`: which samples this rank's rows are, in the epoch's seeded
order). Data problems stop the run here, before anything is written to ``output_dir``.

With ``data.eval_holdout``, the dataset's seeded held-out slice is left out of the stream, and
rank 0 (which runs the held-out measurement) keeps the held-out conversations
(:attr:`TrainData.held_out`; :mod:`~dflash_recipes.executor.data.holdout`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import attrs
from transformers import PreTrainedTokenizerBase

from dflash_recipes.data.conversations import Conversation
from dflash_recipes.errors import DataError, TargetServerUnavailable
from dflash_recipes.executor.data.holdout import held_out_conversations, split_dataset
from dflash_recipes.executor.data.offline import CaptureReader, capture_dataset, open_capture
from dflash_recipes.executor.data.packing import (
    PackingPlan,
    example_lengths,
    pack_epoch,
    packed_batches,
    packed_rows_per_epoch,
)
from dflash_recipes.executor.data.train_dataset import (
    Batch,
    TrainDataset,
    batches,
    batches_per_epoch,
    build_dataset,
    epoch_order,
)
from dflash_recipes.executor.dist_env import DistEnv, is_main
from dflash_recipes.executor.model.convert import CapturedStates
from dflash_recipes.executor.target_server.batch_states import (
    ServedBatchStates,
    client_settings,
    kept_states,
)
from dflash_recipes.executor.target_server.client import TargetServerClient
from dflash_recipes.executor.training.anchors import batch_positions
from dflash_recipes.plan.run_plan import RunPlan

logger = logging.getLogger("dflash_recipes.train")


@attrs.define(eq=False)
class TrainData:
    """This rank's training data: the dataset, its batches, and (offline) the captured states."""

    dataset: TrainDataset
    #: The capture offline training reads (data.hidden_states_path), else None.
    capture: CaptureReader | None
    batch_size: int
    seed: int
    env: DistEnv
    #: The conversations data.eval_holdout holds out of training, on the ranks that measure on
    #: them (rank 0; every rank under training.fsdp), else empty.
    held_out: tuple[Conversation, ...] = ()
    #: data.packing: the row length (training_seq_len) whole conversations are packed into;
    #: None: one conversation per row, padded.
    packed_seq_len: int | None = None
    #: Packed: the examples' token counts (read once), and the last epoch's packing plan.
    _lengths: list[int] | None = None
    _packing: tuple[int, PackingPlan] | None = None
    #: The epoch whose order :meth:`captured_states` last looked up, and that order.
    _order_key: tuple[int, int] | None = None
    _order: list[int] = attrs.Factory(list)
    #: A served target (``target_server``): what asks the servers for a batch's states.
    served: ServedBatchStates | None = None

    @property
    def offline(self) -> bool:
        """True when the target's states come from a capture or from the servers (no decoder
        forward in this process)."""
        return self.capture is not None or self.served is not None

    def close(self) -> None:
        """Stop the servers' client (its requests, threads and leftover files), if any."""
        if self.served is not None:
            self.served.client.close()

    @property
    def batches_per_epoch(self) -> int:
        """How many batches this rank draws per epoch (packed: in epoch 0's packing plan; the
        rows of later epochs' plans differ by a few at most)."""
        if self.packed_seq_len is not None:
            return packed_rows_per_epoch(
                self.packing_plan(0), batch_size=self.batch_size, world_size=self.env.world_size
            )
        return batches_per_epoch(
            len(self.dataset), batch_size=self.batch_size, world_size=self.env.world_size
        )

    def packing_plan(self, epoch: int) -> PackingPlan:
        """Packed: the rows of `epoch` (:func:`~dflash_recipes.executor.data.packing.
        pack_epoch`, from the cache's lengths; the same on every rank)."""
        assert self.packed_seq_len is not None, "packing_plan needs data.packing"
        if self._packing is None or self._packing[0] != epoch:
            if self._lengths is None:
                self._lengths = example_lengths(self.dataset.examples)
            plan = pack_epoch(
                self._lengths, seq_len=self.packed_seq_len, seed=self.seed, epoch=epoch
            )
            self._packing = (epoch, plan)
        return self._packing[1]

    def _epoch_batches(self, epoch: int, start: int) -> Iterator[Batch]:
        env = self.env
        if self.packed_seq_len is not None:
            return packed_batches(
                self.dataset,
                self.packing_plan(epoch),
                batch_size=self.batch_size,
                epoch=epoch,
                start_index=start,
                rank=env.rank,
                world_size=env.world_size,
            )
        return batches(
            self.dataset,
            batch_size=self.batch_size,
            seed=self.seed,
            epoch=epoch,
            start_index=start,
            rank=env.rank,
            world_size=env.world_size,
        )

    def stream(self, epoch: int, start: int) -> Iterator[Batch]:
        """This rank's batches from index `start` of `epoch`'s order (packed: row `start` of its
        packing plan) on, epoch after epoch.

        DataError when the data holds fewer conversations (packed: rows) than one global batch.
        """
        env = self.env
        while True:
            produced = False
            for batch in self._epoch_batches(epoch, start):
                produced = True
                yield batch
            if not produced and start == 0 and self.packed_seq_len is not None:
                rows = len(self.packing_plan(epoch).rows)
                msg = (
                    f"the data packs into {rows} row(s) of {self.packed_seq_len} tokens, fewer "
                    f"than one global batch ({self.batch_size} x {env.world_size} processes); "
                    "add data, lower per_device_train_batch_size or training_seq_len, or set "
                    "data.packing: false"
                )
                raise DataError(msg)
            if not produced and start == 0:
                msg = (
                    f"the data has {len(self.dataset)} usable conversations, fewer than one "
                    f"global batch ({self.batch_size} x {env.world_size} processes); add data "
                    "or lower per_device_train_batch_size"
                )
                raise DataError(msg)
            epoch, start = epoch + 1, 0

    def captured_states(self, batch: Batch) -> CapturedStates | None:
        """Offline: the captured target states of this rank's rows of `batch`, in host memory
        (read on the prefetch thread); a served target: the servers' states of its
        conversations; online: None."""
        if self.served is not None:
            return self.served(batch, self.conversation_indices(batch))
        if self.capture is None:
            return None
        if batch.document_ids is not None:
            msg = "packed rows have no captured states; compile refuses data.packing offline"
            raise DataError(msg)
        return self.capture.states(self._row_examples(batch), int(batch.input_ids.shape[1]))

    def _row_examples(self, batch: Batch) -> list[int]:
        """The example (dataset index) of each of this rank's rows of an unpacked `batch`."""
        examples = self.capture.manifest.num_samples if self.capture else len(self.dataset)
        key = (batch.epoch, examples)
        if self._order_key != key:
            self._order = epoch_order(key[1], seed=self.seed, epoch=batch.epoch)
            self._order_key = key
        return [self._order[p] for p in batch_positions(batch, self.env)]

    def conversation_indices(self, batch: Batch) -> list[int]:
        """The example (dataset index) of every conversation of `batch`, row by row and, in a
        packed row, document by document: what messages about one conversation call it."""
        if batch.document_ids is None:
            return self._row_examples(batch)
        plan = self.packing_plan(batch.epoch)
        rows = batch_positions(batch, self.env)
        return [index for row in rows for index, _ in plan.rows[row].documents]


def build_train_data(
    plan: RunPlan, tokenizer: PreTrainedTokenizerBase, env: DistEnv, *, verify_capture: bool
) -> TrainData:
    """The plan's training data for this rank; `verify_capture` hashes every capture shard now
    (otherwise each is checked on the first read of its states)."""
    capture: CaptureReader | None = None
    if plan.data.hidden_states_path is not None:
        capture, manifest = open_capture(plan)
        if verify_capture:
            capture.verify_all()
        else:  # ahead of the reads, off the loop and the prefetch thread
            capture.verify_in_background()
        dataset = capture_dataset(capture, manifest, tokenizer)
    elif plan.data.data_path is None:
        msg = "the plan has no data.data_path; set it in the recipe and recompile"
        raise DataError(msg)
    else:
        dataset = build_dataset(plan, tokenizer, env=env)
    if is_main(env):
        logger.info("data: %s", dataset.summary)
    whole = dataset
    dataset, indices = split_dataset(plan, whole)
    held_out: tuple[Conversation, ...] = ()
    # Rank 0 measures on them; under training.fsdp every rank measures with it, in step.
    measures = is_main(env) or plan.training.fsdp
    if indices and measures and plan.data.data_path is not None:
        held_out = tuple(
            held_out_conversations(
                plan.data.data_path,
                whole.stats,
                indices,
                answer_only_loss=plan.data.answer_only_loss,
            )
        )
    if indices and is_main(env):
        logger.info(
            "data: %d conversation(s) held out for the held-out measurement "
            "(data.eval_holdout, seed %d); training on %d",
            len(indices),
            plan.training.seed,
            len(dataset),
        )
    training = plan.training
    if plan.data.packing and capture is not None:
        msg = (
            "data.packing does not work with offline training (data.hidden_states_path): the "
            "capture holds one conversation per row; set data.packing: false or train online"
        )
        raise DataError(msg)
    served = _served_states(plan, env) if plan.target_server is not None else None
    return TrainData(
        dataset=dataset,
        capture=capture,
        served=served,
        held_out=held_out,
        batch_size=training.per_device_train_batch_size,
        seed=training.seed,
        env=env,
        packed_seq_len=training.training_seq_len if plan.data.packing else None,
    )


def _served_states(plan: RunPlan, env: DistEnv) -> ServedBatchStates:
    """What asks the servers for a batch's states, once a server answers; with kept states
    (``keep_files: capture``) a run may start with none answering: what was kept trains, and
    the first conversation not kept stops the run as a server failure does."""
    assert plan.target_server is not None
    kept = kept_states(plan)
    client = TargetServerClient(client_settings(plan, kept))
    answering: tuple[str, ...] = ()
    try:
        answering = client.probe()  # a server must answer before anything trains
    except TargetServerUnavailable as exc:
        if kept is None or not len(kept):
            client.close()
            raise
        if is_main(env):
            logger.warning(
                "%s; training from the %d conversation(s) kept in %s: the first conversation "
                "not kept there stops the run (a checkpoint of the last finished step is saved)",
                exc,
                len(kept),
                kept.folder,
            )
    except BaseException:
        client.close()
        raise
    if is_main(env):
        if answering:
            logger.info(
                "target: served by %s (%s; vLLM layer ids %s)",
                ", ".join(answering),
                plan.target_server.served_model_name,
                list(plan.target_server.vllm_layer_ids or ()),
            )
        if kept is not None:
            logger.info(
                "target: %d conversation(s) kept in %s are read there, not asked again",
                len(kept),
                kept.folder,
            )
    return ServedBatchStates(client, plan, kept)


__all__ = ["TrainData", "build_train_data"]
