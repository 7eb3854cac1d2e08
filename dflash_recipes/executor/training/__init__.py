"""Training: ``fit.py`` (the loop, one screen) over the builders of ``setup/``, the micro-step,
objectives, anchors, metrics, the eval and save policies, checkpoints and trackers."""
