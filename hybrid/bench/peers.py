"""Side by side with llama.cpp on the CPU (docs/perf/cpu-only.md has the recipe; docs/perf/cpu-attention.md the figures
at depth): the same generated checkpoint, batch 1, decode tokens/s at several depths (`--depths`, as llama-bench's
-d: DECODE_TOKENS greedy steps after that many cached positions) and prefill tokens/s (a 512-token prompt), rounds
interleaved, one process per side and round (the two sides' weights do not fit in the page cache of a 24 GB machine
together). Each side first runs an untimed 512-token prompt, so that every expert's weights are in memory before
anything is timed. llama.cpp fills its cache to the depth with its own untimed prefill; ours decodes at the depth
over a cache not prefilled (as bench=decode: attention reads every cached position whatever the values, so a step
costs what it costs after a real prompt). Prefill is not the same work on both sides: llama.cpp's graph keeps
only the rows whose logits are asked for after the last layer's attention, so that layer's MoE (and lm_head) run
for the last prompt token alone, where ours runs every prompt row through every layer.

    python -m hybrid.bench.peers convert --converter .../vendor/llama.cpp/convert_hf_to_gguf.py --out slice.gguf
    python -m hybrid.bench.peers run --gguf slice.gguf [--rounds 3] [--lm-head bf16 fp8]
    python -m hybrid.bench.peers lm-head      # the FP8 lm_head's effect on the logits (policy.cpu.lm_head=fp8)

`convert` runs llama.cpp's own converter (Q8_0) on the checkpoint of `model=` (dsv3_slice by default), patched
in its process in three ways: generated checkpoints carry a byte-level tokenizer the converter does not know, so it
is written with the `default` pre-tokenizer and one placeholder merge (the benchmark feeds token ids: the tokenizer
plays no part); and each MoE layer's experts are merged one expert at a time as they are written (the converter
stacks a layer's 256 dequantised experts in FP32, 15 GB, which a 24 GB machine cannot hold). `run` prints one JSON
line per side and round, then the medians; llama.cpp's side needs llama-cpp-python in this environment.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

DECODE_TOKENS = 16
PROMPT_TOKENS = 512
CONTEXT = 1024
DEPTHS = (512, 4096, 16384)
PREFILL_NOTE = "llama.cpp runs the last layer's MoE and lm_head for the last prompt token only; ours for every row"

_CONVERT = """
import runpy, sys
from pathlib import Path
converter = sys.argv[1]
sys.path.insert(0, str(Path(converter).parent))
import numpy as np, torch, gguf
import conversion.base as base, conversion.deepseek as deepseek
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
add_to_gguf = gguf.SpecialVocab.add_to_gguf

def add_merges(self, gw, quiet=False):  # llama.cpp refuses a BPE vocabulary without merges: one placeholder
    self.merges = self.merges or ["\u0120 \u0120"]
    add_to_gguf(self, gw, quiet)
gguf.SpecialVocab.add_to_gguf = add_merges

def stack(datas, dim=0):  # the experts merged lazily: one expert's rows at a time, never the whole layer in FP32
    holders, shape = [[d] for d in datas], (len(datas), *datas[0].shape)
    datas.clear()
    def loader(h):
        return lambda: base.LazyTorchTensor.to_eager(h.pop()).to(torch.float32).contiguous().numpy()
    return gguf.LazyChunkedTensor([loader(h) for h in holders], shape=shape, dtype=np.float32)

class Torch:
    def __getattr__(self, name):
        return stack if name == "stack" else getattr(torch, name)
deepseek.torch = Torch()
sys.argv = sys.argv[1:]
runpy.run_path(converter, run_name="__main__")
"""


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    import torch

    return torch.randint(300, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def checkpoint_dir(model: str) -> Path:
    from hybrid.config.compose import compose, to_settings
    from hybrid.models import open_source

    return Path(open_source(to_settings(compose([f"model={model}"])).model)[1])


def convert(args) -> None:
    ck = checkpoint_dir(args.model)
    subprocess.run([sys.executable, "-c", _CONVERT, args.converter, str(ck), "--outtype", "q8_0", "--outfile",
                    args.out], check=True)


def _context(depths) -> int:
    return max(CONTEXT, max(depths) + DECODE_TOKENS + 16)


def _ours_at(engine, depth: int) -> float:
    """Seconds per greedy step of one sequence at positions depth, depth + 1, ... (the engine's decode step)."""
    import torch

    step, slots = engine.decoder("off"), torch.zeros(1, dtype=torch.long)
    tok = torch.tensor([_tokens(1, engine.model.args.vocab_size, 5)])
    for i in range(DECODE_TOKENS + 2):  # two untimed
        if i == 2:
            t0 = time.perf_counter()
        tok = step(tok, torch.tensor([[depth + i]]), slots, depth + i + 1).argmax(-1).view(1, 1)
        tok.tolist()
    return (time.perf_counter() - t0) / DECODE_TOKENS


def ours(model: str, lm_head: str, threads: int, depths=DEPTHS) -> dict:
    """Our engine on the CPU: prefill of a 512-token prompt (its first token), then greedy decode steps at each
    depth."""
    from hybrid.config.compose import compose, to_settings
    from hybrid.engine.build import build
    from hybrid.engine.requests import SamplingParams

    over = [f"model={model}", "+hw=cpu_only", "tracking.enabled=false", f"policy.cpu.lm_head={lm_head}",
            f"policy.kv.max_context={_context(depths)}", "policy.kv.max_batch=1", "policy.decode.batch_cap=1",
            f"policy.prefill.chunk_tokens={PROMPT_TOKENS}"]
    if threads:
        over.append(f"policy.cpu.threads={threads}")
    s = to_settings(compose(over))
    engine = build(s, s.hw, progress=False)
    vocab = engine.model.args.vocab_size

    def run(prompt: list[int], new: int) -> list[float]:
        """Seconds from the start to each new token."""
        t0, stamps = time.perf_counter(), []
        engine.add_request(prompt, SamplingParams(max_tokens=new, temperature=0.0))
        while engine.has_work():
            for out in engine.step():
                stamps += [time.perf_counter() - t0] * len(out.new_token_ids)
        return stamps
    run(_tokens(PROMPT_TOKENS, vocab, 1), 2)  # warm-up: every expert's pages read once
    prefill_s = run(_tokens(PROMPT_TOKENS, vocab, 2), 1)[0]
    return {"side": f"hybrid (lm_head {lm_head})", "prefill_tok_s": PROMPT_TOKENS / prefill_s,
            **{f"decode_tok_s_d{d}": 1 / _ours_at(engine, d) for d in depths}, "threads": engine.plan.cpu.threads}


def llama(gguf: str, threads: int, depths=DEPTHS) -> dict:
    """llama.cpp (llama-cpp-python) on the same CPU: the 512-token prompt in one batch, then at each depth the
    cache filled by an untimed prompt of that many tokens and greedy eval steps."""
    from llama_cpp import Llama

    threads = threads or len(__import__("os").sched_getaffinity(0))
    llm = Llama(model_path=gguf, n_ctx=_context(depths), n_threads=threads, n_threads_batch=threads,
                n_batch=PROMPT_TOKENS, n_ubatch=PROMPT_TOKENS, verbose=False)
    vocab = llm.n_vocab()
    llm.eval(_tokens(PROMPT_TOKENS, vocab, 1))  # warm-up: every expert's pages read once (mmap)
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(_tokens(PROMPT_TOKENS, vocab, 2))
    prefill_s = time.perf_counter() - t0
    return {"side": "llama.cpp Q8_0", "prefill_tok_s": PROMPT_TOKENS / prefill_s, "prefill_note": PREFILL_NOTE,
            **{f"decode_tok_s_d{d}": 1 / _llama_at(llm, d) for d in depths}, "threads": threads}


def _llama_at(llm, depth: int) -> float:
    """Seconds per greedy eval step after an untimed prompt of `depth` tokens (llama-bench -d)."""
    import numpy as np

    def greedy() -> int:  # the last row's logits (llama-cpp-python keeps none in `scores` without logits_all)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    llm.reset()
    llm.eval(_tokens(depth, llm.n_vocab(), 3))
    tok = greedy()
    t0 = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        llm.eval([tok])
        tok = greedy()
    return (time.perf_counter() - t0) / DECODE_TOKENS


def lm_head_effect(args) -> None:
    """The FP8 lm_head's effect on the logits: one prompt through the model (every position's logits), with the
    published BF16 lm_head and again with it quantised as policy.cpu.lm_head=fp8 does."""
    import torch

    from hybrid.config.compose import compose, to_settings
    from hybrid.engine.build import build
    from hybrid.placement.passes import lm_head_to_fp8

    s = to_settings(compose([f"model={args.model}", "+hw=cpu_only", "tracking.enabled=false",
                             "policy.kv.max_batch=1", "policy.decode.batch_cap=1",
                             f"policy.kv.max_context={CONTEXT}"]))
    model = build(s, s.hw, progress=False).model
    tokens = torch.tensor([_tokens(args.tokens, model.args.vocab_size, 4)])
    pos = torch.arange(args.tokens)[None]
    ref = model(tokens, pos)[0]
    lm_head_to_fp8(model.lm_head)
    q8 = model(tokens, pos)[0]
    cos = torch.nn.functional.cosine_similarity(ref, q8, dim=-1)
    print(json.dumps({"positions": args.tokens, "max_abs_diff": float((ref - q8).abs().max()),
                      "logit_rms": float(ref.pow(2).mean().sqrt()), "cosine_min": float(cos.min()),
                      "cosine_mean": float(cos.mean()),
                      "top1_agreement": float((ref.argmax(-1) == q8.argmax(-1)).float().mean())}), flush=True)


def run(args) -> None:
    sides = [["--llama", args.gguf]] + [["--ours", h] for h in args.lm_head]
    results: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:  # alternate the order between rounds
            cmd = [sys.executable, "-m", "hybrid.bench.peers", "one", *side, "--model", args.model,
                   "--threads", str(args.threads), "--depths", *map(str, args.depths)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            rec = {"round": r, **json.loads(out)}
            print(json.dumps(rec), flush=True)
            results.setdefault(rec["side"], []).append(rec)
    for side, recs in results.items():
        med = {k: statistics.median(x[k] for x in recs) for k in recs[0] if k.endswith("tok_s") or "tok_s_d" in k}
        print(json.dumps({"side": side, "median_of": len(recs), **med}), flush=True)


def one(args) -> None:
    depths = tuple(args.depths)
    rec = llama(args.llama, args.threads, depths) if args.llama else ours(args.model, args.ours, args.threads, depths)
    print(json.dumps(rec), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m hybrid.bench.peers", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="the checkpoint as a Q8_0 GGUF, by llama.cpp's converter")
    c.add_argument("--converter", required=True, help="convert_hf_to_gguf.py of the llama.cpp source")
    c.add_argument("--out", required=True)
    r = sub.add_parser("run", help="interleaved rounds of both sides")
    r.add_argument("--gguf", required=True)
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--lm-head", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    o = sub.add_parser("one", help="one side, one round (what `run` starts)")
    o.add_argument("--llama")
    o.add_argument("--ours", choices=["bf16", "fp8"])
    for q in (r, o):
        q.add_argument("--depths", type=int, nargs="+", default=list(DEPTHS), help="cached positions to decode at")
    for q in (c, r, o):
        q.add_argument("--model", default="dsv3_slice")
        q.add_argument("--threads", type=int, default=0, help="0: the plan's (ours) / every CPU (llama.cpp)")
    e = sub.add_parser("lm-head", help="the FP8 lm_head's effect on the logits")
    e.add_argument("--model", default="dsv3_slice")
    e.add_argument("--tokens", type=int, default=128)
    args = p.parse_args(argv)
    {"convert": convert, "run": run, "one": one, "lm-head": lm_head_effect}[args.cmd](args)


if __name__ == "__main__":
    main()
