"""Prefill: short prompts through the hybrid layer loop (CPU experts), long ones by stream-loading the routed
experts through the GPU (SLP)."""
