"""Prefill over several devices, one process each: context parallelism for attention (cp.py), SmallEP and EP for the
routed experts (smallep.py), the prefill driver (prefill.py), the process group (group.py), one shared copy of the
experts' host weights (shared.py)."""
