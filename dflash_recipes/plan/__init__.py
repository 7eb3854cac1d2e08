"""The contract between compiler and executor: the run plan and its parts, its value checks, the
drafter view resolved from it, what it costs and the regenerate settings both sides read (no
torch)."""
