"""run(cfg): what `python -m hybrid` does, and what the tuner calls: check the machine against the hardware
profile, build the engine from the configs, run the mode (generate, bench, serve, replicas), print and return the
report."""
from __future__ import annotations

import json
import sys
from dataclasses import replace

from omegaconf import DictConfig

from hybrid import tracking
from hybrid.bench import plot_bench, run_bench
from hybrid.bench.records import save, table
from hybrid.config.compose import RUNS_DIR, settings_of
from hybrid.errors import ConfigError
from hybrid.config.schema import HwConfig, HybridConfig, Mode, OutputFormat
from hybrid.engine.build import build, configure_cpu, plan_for
from hybrid.engine.requests import SamplingParams
from hybrid.hw.check import resolve
from hybrid.hw.detect import detect
from hybrid.kernels import thread_pool


def run(cfg: DictConfig) -> dict:
    s = settings_of(cfg)
    machine = detect()
    hw, notes = resolve(s.hw, s.policy, machine)
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    params = generate_params(s) if s.mode == Mode.generate else None  # refused before anything is built
    plan = plan_for(s, hw)  # the policy's errors, before anything is built
    if s.mode == Mode.bench:
        configure_cpu(plan.cpu)  # benchmarks of the kernels alone build no engine to set them
    if s.mode == Mode.serve:
        return serve(s, hw)  # runs until SIGTERM/Ctrl-C; a server's life is not one tracked run
    if s.mode == Mode.replicas:
        from hybrid.serve.replicas import run as run_replicas

        return run_replicas(s)  # servers of this config behind a gateway, until SIGTERM/Ctrl-C
    if s.mode == Mode.bench:
        report = bench(replace(s, hw=hw), hw.name, machine, plan.cpu.kernel)  # the bench builds the engine
    else:
        report = generate(s, hw, params)
    tracking.log_run(s, cfg, report, hw, plan)  # MLflow, after the measured work (tracking.enabled)
    return report


def bench(s: HybridConfig, hw_name: str, machine, kernel: str) -> dict:
    records = run_bench(s)
    context = {"hw": hw_name, "machine": machine.summary(), "threads": thread_pool.threads(),
               "kernel": kernel, **getattr(records, "context", {})}
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


def serve(s: HybridConfig, hw: HwConfig) -> dict:
    """The OpenAI-compatible server: it answers /health with 503 while the engine builds, then serves."""
    from hybrid.serve import serve as serve_http

    name = s.server.model_name or s.model.name
    print(f"serving {name} on http://{s.server.host}:{s.server.port}/v1 once loaded (GET /health)", file=sys.stderr)
    serve_http(lambda: build(s, hw, progress=False), s.server, name)
    return {"mode": "serve", "model": name}


def generate_params(s: HybridConfig) -> SamplingParams:
    """generate mode's sampling settings as a request's; a bad one is a ConfigError naming it."""
    try:
        return SamplingParams(max_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                              seed=s.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def generate(s: HybridConfig, hw: HwConfig, params: SamplingParams) -> dict:
    text_out, hw_name = s.output == OutputFormat.text, hw.name
    engine = build(s, hw, progress=text_out and sys.stderr.isatty())
    tok = engine.tokenizer
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": s.prompt}]) if s.chat else tok.encode(s.prompt)
    if text_out:
        print(s.prompt, end="", flush=True)
    show = (lambda _i, out: print(out.text_delta, end="", flush=True)) if text_out else None
    done = engine.generate([prompt_ids], params, on_output=show)[0]
    if done.error:
        raise RuntimeError(f"generation failed: {done.error}")
    n = len(done.output_ids)
    report = {
        "model": s.model.name, "hw": hw_name, "prompt_ids": prompt_ids, "output_ids": done.output_ids,
        "text": done.text, "finish_reason": done.finish_reason.value, "plan": engine.plan.params(),
        "prompt_tokens": len(prompt_ids),
        "new_tokens": n, "ttft_s": done.ttft_s, "tpot_s": done.tpot_s,
        "prefill_tok_s": len(prompt_ids) / done.ttft_s if done.ttft_s else 0.0,
        "decode_tok_s": 1 / done.tpot_s if done.tpot_s else 0.0,
    }
    if text_out:
        print(f"\n\n[{s.model.name} on {hw_name}] prompt {len(prompt_ids)} tokens, generated {n} | "
              f"TTFT {done.ttft_s * 1e3:.1f} ms | TPOT {done.tpot_s * 1e3:.1f} ms | "
              f"prefill {report['prefill_tok_s']:.1f} tok/s | decode {report['decode_tok_s']:.1f} tok/s")
    else:
        print(json.dumps(report))
    return report
