"""The policy tuner: `python -m tuner +hw=NAME` measures policies on this machine (Optuna; one
`python -m hybrid mode=bench bench=slo` subprocess per trial), records everything in MLflow, and writes the best
policy to conf/policy/<hw>.yaml, which `+hw=<hw>` then uses."""
