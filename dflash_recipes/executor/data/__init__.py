"""Training inputs: conversations tokenized once into a cache read in place and batched,
captured hidden states, and the capture command."""
