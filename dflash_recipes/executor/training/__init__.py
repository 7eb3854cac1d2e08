"""The trainer: the loop, the micro-step, objectives, anchors, optimiser, metrics, resume and
checkpoints."""
