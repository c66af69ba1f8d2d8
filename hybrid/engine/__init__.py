"""The engine: the generation loop over the model, its KV cache and the sampler."""
