"""The policy tuner: `python -m tuner +hw=NAME` measures policies on this machine (Optuna; a
long-lived trial worker keeps the model loaded and measures trial after trial), records everything in MLflow, and
writes the best policy to conf/policy/<hw>.yaml, which `+hw=<hw>` then uses."""
