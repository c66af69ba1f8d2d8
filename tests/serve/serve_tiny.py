"""`python -m tests.serve.serve_tiny CHECKPOINT PORT GRACE_S`: serve() in the foreground over the tiny checkpoint, as
a deployment runs it (for the shutdown test). The engine is built by a loader, and each step takes >= 50 ms, so the
test can tell requests that finish within the grace period from those that cannot."""
from __future__ import annotations

import sys
import time

import torch

from hybrid.engine.engine import Engine
from hybrid.engine.probe import local_plan
from hybrid.serve import ServerConfig, serve
from hybrid.tokenizer import Tokenizer
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model

STEP_S = 0.05


def main() -> None:
    path, port, grace = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])

    def loader() -> Engine:
        engine = Engine(load_model(Checkpoint(path), torch.float32, progress=False),
                        local_plan({"kv.max_batch": 4, "kv.max_context": 128, "decode.batch_cap": 4}), Tokenizer(path))
        step = engine.step

        def slow_step():
            time.sleep(STEP_S)
            return step()
        engine.step = slow_step
        return engine
    serve(loader, ServerConfig(port=port, shutdown_grace_s=grace), "tiny", log_level="warning")


if __name__ == "__main__":
    main()
