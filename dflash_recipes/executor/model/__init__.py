"""The drafter as torch modules: the draft model and its masks, heads, conversion, warm start,
weights, export."""
