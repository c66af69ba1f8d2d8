"""hybrid: serve huge FP8 Mixture-of-Experts LLMs on one workstation (experts on the CPU, the rest on the GPU)."""
__version__ = "0.1.0"
