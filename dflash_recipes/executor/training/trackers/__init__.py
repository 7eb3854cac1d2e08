"""Experiment trackers: metrics.jsonl, TensorBoard, MLflow and W&B behind one protocol.

The trainer knows only :class:`~.fanout.TrackerSet` (rows in, one destination): it writes
metrics.jsonl and hands each row's line to the tracker process (:mod:`.process`, which runs
:mod:`.worker`), where the protocol :class:`~.protocol.MetricLogger` (log the config, log a
row, close) has one module per tracker (``tensorboard``, ``mlflow``, ``wandb``), registered in
:data:`~dflash_recipes.executor.training.trackers.registry.TRACKER_MODULES`; each imports its
library only when opened, and only on rank 0.
"""
