"""Torch-free readers of model directories: config.json, safetensors header, weight index, field
inventory, tensor layout."""
