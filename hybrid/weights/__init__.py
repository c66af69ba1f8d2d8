"""Checkpoints: the safetensors format, FP8 block tensors, reading, validating and generating checkpoints."""
