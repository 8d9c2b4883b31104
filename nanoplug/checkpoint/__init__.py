"""Checkpoints on disk: finding a model, reading safetensors and GGUF files, loading weights, the default model."""
