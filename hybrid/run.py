"""run(cfg): what `python -m hybrid` does, and what the tuner calls: check the machine against the hardware
profile, build the engine from the configs, run the mode, print and return the report."""
from __future__ import annotations

import json
import sys
from dataclasses import replace

import torch
from omegaconf import DictConfig

from hybrid import tracking
from hybrid.bench import plot_bench, run_bench
from hybrid.bench.records import save, table
from hybrid.config.compose import RUNS_DIR, settings_of
from hybrid.config.schema import HwConfig, HybridConfig, Mode, OutputFormat
from hybrid.engine.build import build
from hybrid.engine.sampler import Sampling
from hybrid.hw.check import resolve
from hybrid.hw.detect import detect
from hybrid.kernels import thread_pool
from hybrid.kernels.dispatch import selected
from hybrid.kernels.gemm import set_tile_min_tokens


def run(cfg: DictConfig) -> dict:
    s = settings_of(cfg)
    machine = detect()
    hw, notes = resolve(s.hw, s.policy, machine)
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    threads = s.policy.cpu_threads or machine.physical_cores
    torch.set_num_threads(threads)
    thread_pool.set_threads(threads)
    set_tile_min_tokens(s.policy.cpu_gemm_tile_tokens)
    if s.mode == Mode.bench:
        report = bench(replace(s, hw=hw), hw.name, machine)  # the resolved profile: the bench builds the engine
    else:
        report = generate(s, hw)
    tracking.log_run(s, cfg, report, hw, threads)  # MLflow, after the measured work (tracking.enabled)
    return report


def bench(s: HybridConfig, hw_name: str, machine) -> dict:
    records = run_bench(s)
    context = {"hw": hw_name, "machine": machine.summary(), "threads": thread_pool.threads(),
               "kernel": selected(s.policy.cpu_kernel)}
    path = save(records, RUNS_DIR / "bench", s.bench.name, context)
    png = plot_bench(s.bench.name, records, path)
    report = {"bench": s.bench.name, **context, "records": [r.as_json() for r in records], "path": str(path),
              **({"plot": str(png)} if png else {})}
    if s.output == OutputFormat.json:  # one line: what the tuner reads
        print(json.dumps(report), flush=True)
    else:
        print(table(records))
        print(f"\n{len(records)} records -> {path}")
    return report


def generate(s: HybridConfig, hw: HwConfig) -> dict:
    text_out, hw_name = s.output == OutputFormat.text, hw.name
    engine = build(s, hw, progress=text_out and sys.stderr.isatty())
    tok, gen = engine.tokenizer, engine.generator
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": s.prompt}]) if s.chat else tok.encode(s.prompt)
    stream = _TextStream(tok) if text_out else None
    if stream:
        print(s.prompt, end="", flush=True)
    res = gen.generate([prompt_ids], s.max_new_tokens, Sampling(s.temperature, s.top_p, s.top_k, s.seed),
                       on_token=stream)
    t = res.timings
    report = {
        "model": s.model.name, "hw": hw_name, "prompt_ids": prompt_ids, "output_ids": res.output_ids[0],
        "text": tok.decode(res.output_ids[0]), "prompt_tokens": t.prompt_tokens, "new_tokens": t.new_tokens,
        "ttft_s": t.ttft_s, "tpot_s": t.tpot_s, "prefill_tok_s": t.prefill_tok_s, "decode_tok_s": t.decode_tok_s,
    }
    if text_out:
        print(f"\n\n[{s.model.name} on {hw_name}] prompt {t.prompt_tokens} tokens, generated {t.new_tokens} | "
              f"TTFT {t.ttft_s * 1e3:.1f} ms | TPOT {t.tpot_s * 1e3:.1f} ms | "
              f"prefill {t.prefill_tok_s:.1f} tok/s | decode {t.decode_tok_s:.1f} tok/s")
    else:
        print(json.dumps(report))
    return report


class _TextStream:
    """Prints the decoded text as tokens arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self, tok):
        self.tok, self.ids, self.shown = tok, [], 0

    def __call__(self, _seq: int, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if not text.endswith("\ufffd"):
            print(text[self.shown:], end="", flush=True)
            self.shown = len(text)
