"""The plan (hybrid/plan/plan.py) and the one place it is decided (hybrid/plan/resolve.py)."""
