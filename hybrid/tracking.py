"""Run tracking with MLflow: every `python -m hybrid` run (and every tuner study and trial) is recorded.

Where: `tracking.uri` ("" = sqlite under runs/: runs/mlflow.db, artifacts under runs/mlartifacts/, or a server such
as http://host:5000, which several machines share); one experiment per model (`hybrid-<model>`, created with an
explicit artifact location unless a server places artifacts). A fresh sqlite store is created under a file lock, so
processes starting together create it once; a server that does not answer /health is one line naming tracking.uri.
What: params = the resolved hw, model and policy, flattened (`policy.cpu.threads`, `hw.cpu.cores`, ...), plus the
plan they resolved to (`plan.cpu.threads`, `plan.cpu.kernel`, ...); metrics = the SLO report card (TTFT, TPOT, prefill
and decode tokens/s) or the bench's records, with achieved ÷ bound where a record has a bound; artifacts = the
resolved config (config.yaml), the report (report.json) and plots (plots/*.png).

mlflow is imported inside the functions here, once a run's measured work is over: never on the engine's hot path
(`import mlflow` costs ~1.5 s). Tracking failures are reported on stderr and never fail the run.

`python -m hybrid.tracking ui [--port 5000]` (what `make ui` runs): the MLflow UI on 127.0.0.1, in its own process
group, stopped with that whole group on Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Any, Mapping, Optional

from hybrid.config.compose import RUNS_DIR
from hybrid.config.schema import TrackingConfig
from hybrid.errors import ConfigError
from hybrid.locking import locked, sqlite_file
from hybrid.process import stop_group

RUN_ID_ENV = "HYBRID_MLFLOW_RUN_ID"  # log into this existing run (the tuner's trial child runs) instead of a new one
SLO_METRICS = ("ttft_s", "tpot_s", "prefill_tok_s", "decode_tok_s")


# ------------------------------------------------------------------------------------------- where and which

def tracking_uri(t: TrackingConfig) -> str:
    if t.uri:
        return t.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{(RUNS_DIR / 'mlflow.db').resolve()}"


def artifact_root(t: TrackingConfig) -> Path:
    return Path(t.artifact_root or RUNS_DIR / "mlartifacts").resolve()


def experiment_name(t: TrackingConfig, model_name: str) -> str:
    return t.experiment or f"hybrid-{model_name}"


def is_server(uri: str) -> bool:
    """An MLflow tracking server (it places artifacts itself); else a store this process writes (sqlite, a
    database, a folder), whose experiments get artifact_root."""
    return uri.startswith(("http://", "https://", "databricks"))


def client(t: TrackingConfig):
    """A client of the store. A sqlite store is created (tables, migrations) under its file's lock: processes
    starting together on a fresh runs/ create it once. A server that does not answer is a ConfigError naming
    tracking.uri."""
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(t)
    path = sqlite_file(uri)
    if path is None:
        check_server(uri)
        return MlflowClient(tracking_uri=uri)
    with locked(path, f"creating the MLflow store {path}"):
        return MlflowClient(tracking_uri=uri)  # opens the store: creates or migrates its tables


def check_server(uri: str, timeout_s: float = 10.0) -> None:
    """An http(s) tracking URI answers MLflow's /health, else a ConfigError naming tracking.uri (MLflow's own
    client would retry for minutes first)."""
    import urllib.error
    import urllib.request

    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as r:
            if r.status == 200:
                return
            why = f"/health answered {r.status}"
    except urllib.error.HTTPError as e:
        why = f"/health answered {e.code}"
    except (OSError, ValueError) as e:
        why = str(getattr(e, "reason", e))
    raise ConfigError(f"tracking.uri: no MLflow server answers at {uri} ({why}); start one (`mlflow server "
                      "--host 0.0.0.0 --port 5000 ...`) or set tracking.enabled=false")


def ensure_experiment(c, t: TrackingConfig, name: str) -> str:
    """The experiment's id, created on first use: under artifact_root unless a server places its artifacts."""
    from mlflow.exceptions import MlflowException

    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if not is_server(tracking_uri(t)) or t.artifact_root:
        location = (artifact_root(t) / name).as_uri()
    try:
        return c.create_experiment(name, artifact_location=location)
    except MlflowException:  # another process created it meanwhile
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


# ------------------------------------------------------------------------------------------------ what

def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """Nested dataclasses / dicts as {"a.b.c": "value"}; lists stay one value."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        out: dict[str, str] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(obj, Enum):
        obj = obj.value
    if isinstance(obj, (list, tuple)):
        obj = [x.value if isinstance(x, Enum) else (dataclasses.asdict(x) if dataclasses.is_dataclass(x) else x)
               for x in obj]
    return {prefix.rstrip("."): str(obj)[:6000]}


def params_of(s, hw, plan) -> dict[str, str]:
    """The run's params: the configs as given, and the plan they resolved to (`plan.*`)."""
    params = {**flatten(hw, "hw."), **flatten(s.model, "model."), **flatten(s.policy, "policy."),
              "mode": s.mode.value, **{f"plan.{k}": str(v) for k, v in plan.params().items()}}
    if s.mode.value == "bench":
        params.update({k: v for k, v in flatten(s.bench, "bench.").items()})
    return params


def metrics_of(report: Mapping[str, Any]) -> dict[str, float]:
    """Numeric figures of a run's report: a bench's records (name, `.m<M>` when several share a name, and
    `.of_bound` = achieved ÷ bound), or generate's SLO figures."""
    out: dict[str, float] = {}
    if "records" in report:
        for r in report["records"]:
            key = r["name"] + (f".m{r['m']}" if r.get("m") is not None else "")
            base, i = key, 1
            while key in out:
                i += 1
                key = f"{base}.{i}"
            out[key] = float(r["value"])
            if r.get("fraction_of_bound") is not None:
                out[f"{key}.of_bound"] = float(r["fraction_of_bound"])
                out[f"{key}.bound"] = float(r["bound"])
    else:
        for k, v in report.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = float(v)
    return {k: v for k, v in out.items() if math.isfinite(v)}


def _safe_key(key: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "_-. /" else "_" for ch in key)


# ------------------------------------------------------------------------------------------------- logging

def log_run(s, cfg, report: Mapping[str, Any], hw, plan) -> Optional[str]:
    """Record one run (s: HybridConfig, cfg: the composed DictConfig, hw: the resolved HwConfig); returns the run id.
    With HYBRID_MLFLOW_RUN_ID set (a tuner trial), logs into that run and leaves ending it to its owner."""
    if not s.tracking.enabled:
        return None
    try:
        return _log_run(s, cfg, report, hw, plan)
    except Exception as e:  # noqa: BLE001 - tracking never fails a run
        print(f"warning: tracking: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def _log_run(s, cfg, report, hw, plan) -> str:
    import time

    from mlflow.entities import Metric, Param, RunTag
    from omegaconf import OmegaConf

    t = s.tracking
    c = client(t)
    run_id = os.environ.get(RUN_ID_ENV)
    owned = not run_id
    if owned:
        exp = ensure_experiment(c, t, experiment_name(t, s.model.name))
        what = f"bench-{s.bench.name}" if s.mode.value == "bench" else s.mode.value
        run_id = c.create_run(exp, run_name=f"{what}-{hw.name}", tags={
            "mode": s.mode.value, "hw": hw.name, "model": s.model.name,
            **({"bench": s.bench.name} if s.mode.value == "bench" else {})}).info.run_id
    try:
        now = int(time.time() * 1000)
        given = {f"plan.{k}": str(v)[:6000] for k, v in report.get("plan", {}).items()}  # the engine's: with its ledger
        params = [Param(_safe_key(k), v) for k, v in {**params_of(s, hw, plan), **given}.items()]
        metrics = [Metric(_safe_key(k), v, now, 0) for k, v in metrics_of(report).items()]
        for i in range(0, max(len(params), len(metrics)), 100):
            c.log_batch(run_id, metrics=metrics[i:i + 100], params=params[i:i + 100])
        if not owned:
            c.log_batch(run_id, tags=[RunTag("hw", hw.name), RunTag("model", s.model.name)])
        c.log_text(run_id, OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
        c.log_text(run_id, json.dumps(report, indent=1, default=str), "report.json")
        label = f"bench={s.bench.name}" if s.mode.value == "bench" else s.mode.value
        figures = plots(report, f"{label}: {s.model.name} on {hw.name}")
        import matplotlib.pyplot as plt

        for name, fig in figures.items():
            c.log_figure(run_id, fig, f"plots/{name}.png")
            plt.close(fig)
    except Exception:
        if owned:
            c.set_terminated(run_id, "FAILED")
        raise
    if owned:
        c.set_terminated(run_id, "FINISHED")
        print(f"tracked: MLflow run {run_id} in {tracking_uri(t)}", file=sys.stderr)
    return run_id


def plots(report: Mapping[str, Any], title: str = "") -> dict[str, Any]:
    """The report card as figures: SLO figures (latencies in ms, throughputs with their bound), and achieved ÷
    bound for every record that has a bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    recs = report.get("records")
    if recs is None:
        recs = [{"name": k, "value": report[k], "unit": "s" if k.endswith("_s") and "tok" not in k else "tok/s"}
                for k in SLO_METRICS if isinstance(report.get(k), (int, float))]
    slo = {r["name"]: r for r in recs if r["name"] in SLO_METRICS}
    if slo:
        fig, (lat, thr) = plt.subplots(1, 2, figsize=(9, 3.5))
        names = [n for n in ("ttft_s", "tpot_s") if n in slo]
        lat.bar(names, [slo[n]["value"] * 1e3 for n in names], color="tab:blue")
        if "tpot_s" in slo and "p90_ms" in slo["tpot_s"]:
            lat.errorbar(["tpot_s"], [slo["tpot_s"]["p50_ms"]], fmt="k_", ms=18, label="p50 / p90 / max step")
            lat.plot(["tpot_s", "tpot_s"], [slo["tpot_s"]["p90_ms"], slo["tpot_s"]["max_ms"]], "k_", ms=18)
            lat.legend(fontsize=7)
        lat.set_ylabel("ms")
        lat.set_title("latency")
        names = [n for n in ("prefill_tok_s", "decode_tok_s") if n in slo]
        thr.bar(names, [slo[n]["value"] for n in names], color="tab:green", label="achieved")
        for n in names:
            if slo[n].get("bound"):
                thr.bar([n], [slo[n]["bound"]], fill=False, hatch="//", edgecolor="gray", label="bound")
                thr.set_yscale("log")
        thr.set_ylabel("tok/s")
        thr.set_title("throughput")
        if any(slo[n].get("bound") for n in names):
            thr.legend(fontsize=7)
        fig.suptitle(title or f"{report.get('model', '')} on {report.get('hw', '')}", fontsize=9)
        fig.tight_layout()
        out["report_card"] = fig
    bounded = [r for r in recs if r.get("fraction_of_bound") is not None]
    if bounded:
        fig, ax = plt.subplots(figsize=(8, 0.3 * len(bounded) + 1.2))
        labels = [r["name"] + (f" m={r['m']}" if r.get("m") is not None else "") for r in bounded]
        ax.barh(labels, [r["fraction_of_bound"] for r in bounded], color="tab:orange")
        ax.axvline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("achieved ÷ bound")
        ax.invert_yaxis()
        fig.tight_layout()
        out["of_bound"] = fig
    return out


# ---------------------------------------------------------------------------------------------------- UI

def ui(port: int = 5000, uri: str = "", artifacts: str = "") -> int:
    """The MLflow UI on 127.0.0.1:port until Ctrl-C / SIGTERM; it runs in its own session (mlflow ui spawns
    workers), so stopping means stopping that whole process group."""
    import signal
    import subprocess

    t = TrackingConfig(uri=uri, artifact_root=artifacts)
    store = tracking_uri(t)
    if sqlite_file(store) is not None:
        client(t)  # the store created under its lock, not by the UI racing a run that creates it too
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store,
           "--default-artifact-root", artifact_root(t).as_uri(), "--host", "127.0.0.1", "--port", str(port)]
    print(f"MLflow UI for {store} on http://127.0.0.1:{port} (Ctrl-C stops it)", flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True)
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        while proc.poll() is None and stop["signal"] is None:
            try:
                proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
    finally:
        stop_group(proc)
    return 0 if stop["signal"] is not None else (proc.returncode or 0)


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m hybrid.tracking", description="MLflow tools for hybrid's runs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("ui", help="the MLflow UI on 127.0.0.1 (Ctrl-C stops it and its workers)")
    u.add_argument("--port", type=int, default=int(os.environ.get("PORT", 5000)))
    u.add_argument("--uri", default="", help="tracking store (default: sqlite under runs/)")
    u.add_argument("--artifacts", default="", help="artifact root (default: runs/mlartifacts)")
    a = ap.parse_args(argv)
    return ui(a.port, a.uri, a.artifacts)


if __name__ == "__main__":
    sys.exit(main())
