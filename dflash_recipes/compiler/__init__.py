"""Recipe -> plan: the compilation, its state and codes, and one module per family of checks (no
torch)."""
