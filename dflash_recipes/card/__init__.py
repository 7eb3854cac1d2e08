"""The model card (README.md) of an export, and the acceptance gate: torch-free."""
