"""Measured acceptance: block speculative decoding verified by the target, and the `eval`
command."""
