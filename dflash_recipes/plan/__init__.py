"""The contract with the executor: the run plan, its value checks and the drafter view resolved from
it (no torch)."""
