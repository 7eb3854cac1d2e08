"""Training inputs: conversations tokenized once into a memory-mapped cache and batched,
captured hidden states, and the capture command."""
