"""Training inputs: conversations tokenized into batches, captured hidden states, and the capture
command."""
