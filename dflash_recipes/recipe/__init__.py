"""What a user writes: the recipe sections, every enumeration once, loading, YAML, JSON Schema, the
`init` starter (no torch)."""
