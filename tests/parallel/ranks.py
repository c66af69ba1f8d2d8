"""What each rank runs in the two-process tests (module-level, so spawned processes can import it), and the
single-process references they are compared with."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from hybrid.placement.passes import experts_to_cpu_kernels
from hybrid.parallel.group import Dist
from hybrid.parallel.prefill import Streaming, parallel_prefill
from hybrid.parallel.shared import attach_experts, pin_shared
from hybrid.prefill.ring import overwritten_before_off
from hybrid.prefill.slp import StreamLoader
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model

SLOT, SLOTS = 1, 2  # the prompt goes into slot 1 of 2: a slot other than the first
DECODE_STEPS = 6


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def load(ck: Path, device: torch.device = torch.device("cpu"), streamed: bool = False):
    model = load_model(Checkpoint(ck), torch.float32, progress=False)
    if streamed:
        experts_to_cpu_kernels(model)
    return model.to(device)


def greedy(model, cache, first: int, at: int, steps: int = DECODE_STEPS) -> list[int]:
    """Greedy decode from token `first` at position `at`, reading and extending the cache's slot."""
    dev = cache.layers[0].kv.device
    out, token = [], first
    for p in range(at, at + steps):
        logits = model(torch.tensor([[token]], device=dev), torch.tensor([[p]], device=dev), cache,
                       torch.tensor([SLOT], device=dev))
        token = int(logits[0, -1].argmax())
        out.append(token)
    return out


def reference(ck: Path, n: int, seed: int, context: int) -> dict:
    """The single-process prefill: every token's logits, the slot's cache, greedy decode after it."""
    model = load(ck)
    tokens = prompt(n, seed, model.args.vocab_size)
    cache = model.new_cache(SLOTS, context)
    logits = model(torch.tensor([tokens]), torch.arange(n)[None], cache, torch.tensor([SLOT]))[0]
    return {"logits": logits, "cache": _cache_rows(cache, n),
            "decode": greedy(model, cache, int(logits[-1].argmax()), n)}


def _cache_rows(cache, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(t.cpu() for t in layer.rows(SLOT, n)) for layer in cache.layers]


def two_process_case(d: Dist, ck: Path, n: int, seed: int, context: int, mode: str, cut: int = 0,
                     arenas: Optional[list] = None) -> dict:
    """The same prompt prefilled over the ranks (in two calls when `cut`: positions 0..cut-1, then the rest);
    experts streamed from the shared `arenas` when given, else the plain torch experts."""
    model = load(ck, d.device, streamed=arenas is not None)
    streaming = loader = None
    if arenas is not None:
        attach_experts(model, arenas)
        loader = StreamLoader()
        streaming = Streaming(ring_len=3, budget_bytes=1e12, loader=loader)
    tokens = prompt(n, seed, model.args.vocab_size)
    cache = model.new_cache(SLOTS, context, d.device)
    parts = []
    for lo, hi in ((0, cut), (cut, n)) if cut else ((0, n),):
        parts.append(parallel_prefill(model, d, tokens[lo:hi], cache, SLOT, start=lo, mode=mode,
                                      streaming=streaming, last_only=False))
    logits = torch.cat(parts).cpu()
    return {"logits": logits, "cache": _cache_rows(cache, n),
            "decode": greedy(model, cache, int(logits[-1].argmax()), n),
            "shared": None if arenas is None else [a.is_shared() for a in arenas],
            "ring": None if loader is None else _ring(loader.kept.log)}


def _ring(log) -> dict:
    """What the last prefill's ring saw: the (layer, expert) tags written, whether a slot was overwritten early."""
    return {"written": sorted(tag for event, _, tag in log if event == "write"),
            "overwritten": overwritten_before_off(log)}


def run_cases(d: Dist, cases: list[dict], arenas: Optional[list] = None, bench: Optional[dict] = None) -> dict:
    """Every case; then, with `bench` (ck, lengths), the two-GPU prefill benchmark's measurement on these ranks."""
    if arenas is not None and d.device.type == "cuda":
        pin_shared(arenas)
    out = {"cases": [two_process_case(d, arenas=arenas if c.get("streamed") else None,
                                      **{k: v for k, v in c.items() if k != "streamed"}) for c in cases]}
    if bench is not None:
        out["bench"] = bench_runs(d, arenas, **bench)
    return out


def bench_runs(d: Dist, arenas: list, ck: Path, lengths: list[int]) -> list[dict]:
    from hybrid.bench.prefill_dual import _measure
    from hybrid.parallel.peer_commands import Knobs

    model = load(ck, d.device, streamed=True)
    attach_experts(model, arenas)
    cache = model.new_cache(1, max(lengths), d.device)
    loader = StreamLoader()
    return [_measure(d, model, cache, loader, n, mode, Knobs()) for n in lengths for mode in ("smallep", "ep")]
