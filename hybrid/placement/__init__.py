"""Placement: the passes that put a device-agnostic model on the machine (routed experts on the CPU kernels, the rest
on the compute device, hot experts on the GPU), the host memory they live in (pinned, shared), the CPU experts'
staging buffers, and the GPU memory ledger."""
