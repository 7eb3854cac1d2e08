"""Torch-free reading of training conversations: input formats, columns, content hash."""
