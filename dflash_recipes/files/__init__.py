"""What lives in a run directory: names, locks, crash-safe writes, JSON reading, metrics rows,
manifests (no torch)."""
