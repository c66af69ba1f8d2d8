"""The serving engine: the Engine (requests, steps), its scheduler, the resolved plan and memory ledger, and the
passes that place the model (routed experts on the CPU kernels, the rest on the compute device)."""
