"""Experiment trackers: metrics.jsonl, TensorBoard, MLflow and W&B behind one protocol.

The trainer knows only :class:`~.fanout.TrackerSet` (rows in, one destination) and the
protocol :class:`~.protocol.MetricLogger` (log the config, log a row, close). One module per tracker
(``jsonl``, ``tensorboard``, ``mlflow``, ``wandb``), registered in
:data:`~dflash_recipes.executor.training.trackers.registry.TRACKER_MODULES`; each imports its
library only when opened, and only on rank 0.
"""
