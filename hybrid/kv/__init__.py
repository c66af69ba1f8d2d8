"""The paged KV cache's bookkeeping and the prefix cache (blocks, host tier, the engine's manager)."""
