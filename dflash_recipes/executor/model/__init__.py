"""The drafter as torch modules: the draft model and its masks, conversion, warm start,
weights, export."""
