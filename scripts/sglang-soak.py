"""Soak sluice against a real SGLang 0.5.23 server on this CPU: N short ``sluice run``s, one after another.

    .venv/bin/python scripts/sglang-soak.py --runs 2 --steps 12 --mode async [--managed] [--timeout 300]

Needs the environment ``bash scripts/sglang-cpu.sh`` builds (``SLUICE_SGLANG_ENV``, default
``~/.cache/sluice/sglang-cpu-0.5.23``). Without ``--managed`` one server is started on a tiny Qwen3-MoE and every run
trains that model folder against it (``engine.urls``); the server keeps each run's last weights, so every run after
the first also exercises the start-up adoption that reloads the folder from disk. With ``--managed`` each run starts
its own server (``engine.launch = true``, ``engine.python`` = the environment's ``sglang-cpu-python``).

Each run has a wall-clock limit; a run past it is a hang: it is stopped (SIGTERM, a second SIGTERM, then SIGKILL to
what is left of the run) with its logs kept, and the soak goes on. Reported per run: seconds, weight pushes landed
against steps, the audit's lost and duplicated samples, hang or not; per step every mismatch/agreement metric the
trainer logs (``mismatch_k3``, ``r3/...``), with medians; the trainer's running totals of refused cache flushes and
stalled pushes. The table is printed and everything is written as JSON (``OUT/soak.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the shared server and run helpers (tests/helpers/sglang_server.py)

from tests.helpers import sglang_server as sg  # noqa: E402

# Trainer metrics reported per step: log-prob mismatch and routing agreement, whatever of them the trainer logs.
PER_STEP = ("mismatch", "agree")
# Running totals the trainer logs (the push's trouble so far): the last value is the run's count.
TOTALS = ("flush", "stall")
# Where each step's time went around the push.
TIMING = ("time/push_s", "time/push_wait_s", "time/step_s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="sluice runs, one after another")
    parser.add_argument("--steps", type=int, default=12, help="trainer steps (weight pushes) per run")
    parser.add_argument("--mode", choices=("async", "sync"), default="async")
    parser.add_argument("--managed", action="store_true",
                        help="each run starts its own server (engine.launch) instead of sharing one")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a run may take before it counts as a hang (default 300)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the model, the runs, the logs and soak.json (default runs/sglang-soak/TIME)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="further recipe overrides for every run (repeatable)")
    args = parser.parse_args(argv)

    python = sg.sglang_python()
    if python is None:
        print(f"sglang-soak: {sg.missing_reason()}", file=sys.stderr)
        return 2
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = (args.out or REPO / "runs" / "sglang-soak" / f"{stamp}-{args.mode}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = sg.write_model(out / "model")
    base = [
        "engine.type=sglang", f"model.path={json.dumps(str(model))}", f"mode={args.mode}",
        "warmstart.enabled=false", "eval.heldout.enabled=false",
        "trainer.batch_groups=4", "filters.zero_variance=false", "trainer.checkpoint_every=4",
        "producer.concurrency=4",
    ]
    report: dict[str, Any] = {
        "started": stamp, "runs_asked": args.runs, "steps": args.steps, "mode": args.mode, "managed": args.managed,
        "timeout_s": args.timeout, "sglang_python": str(python), "out": str(out), "overrides": args.overrides,
        "server": None, "runs": [],
    }
    server: sg.SGLangServer | None = None
    servers: list[dict[str, Any]] = []
    try:
        for i in range(args.runs):
            overrides = list(base)
            if args.managed:
                overrides += ["engine.launch=true", f"engine.python={json.dumps(str(python))}",
                              f"engine.launch_args={json.dumps(list(sg.CPU_FLAGS))}"]
            else:
                server = _healthy_server(server, model, out / "logs", python, servers)
                overrides.append(f'engine.urls=["{server.url}"]')
            overrides += args.overrides
            run_dir = out / f"run-{i}"
            print(f"sglang-soak: run {i + 1}/{args.runs} ({args.mode}, {args.steps} steps) in {run_dir}", flush=True)
            before = None if server is None else sg.weight_version(server.url)
            result = sg.sluice_run(run_dir, overrides, steps=args.steps, timeout=args.timeout,
                                   log=out / f"run-{i}.launcher.log")
            entry = _summarise(i, result, server, before)
            report["runs"].append(entry)
            print("  " + _row(entry), flush=True)
            _write(out, report, servers)
    finally:
        if server is not None:
            server.stop()
            servers[-1]["stopped"] = True
    report["summary"] = _totals(report["runs"])
    _write(out, report, servers)
    print()
    print(_table(report))
    print(f"\nsglang-soak: wrote {out / 'soak.json'}")
    return 0 if report["summary"]["all_ok"] else 1


def _healthy_server(server: sg.SGLangServer | None, model: Path, logs: Path, python: Path,
                    servers: list[dict[str, Any]]) -> sg.SGLangServer:
    """The shared server, started (again) when it is not there or no longer answers /health (a hung run may have left
    it paused past SGLang's own watchdog, which kills it)."""
    if server is not None and server.alive() and sg.health(server.url, timeout=10):
        return server
    if server is not None:
        print(f"sglang-soak: the server at {server.url} no longer answers; starting another (log {server.log})",
              flush=True)
        server.stop()
        servers[-1]["stopped"] = True
        servers[-1]["replaced"] = True
    server = sg.start_server(model, logs, python=python)
    servers.append({"url": server.url, "log": str(server.log), "healthy_after_s": round(server.started_s, 1)})
    print(f"sglang-soak: SGLang at {server.url}, healthy after {server.started_s:.1f} s", flush=True)
    return server


def _adoption(log: Path, before: str | None) -> str:
    """What the launcher's start-up adoption found on the shared server and did (pipeline.sync.lifecycle): the
    version the server reported before the run, and the action its log shows (a reload and a hold are logged as
    warnings; a label and a keep are not)."""
    if before is None:
        return "managed"
    try:
        text = log.read_text(errors="replace")
    except OSError:
        text = ""
    if "holds generation" in text:
        return f"{before}: held"
    if "reloaded" in text:
        return f"{before}: loaded"
    return f"{before}: " + {"default": "labelled", "0": "kept"}.get(before, "not logged")


def _summarise(index: int, r: sg.RunResult, server: sg.SGLangServer | None, before: str | None) -> dict[str, Any]:
    per_step = []
    for m in r.metrics:
        row: dict[str, Any] = {"step": m.get("step")}
        row.update({k: v for k, v in m.items() if any(p in k for p in PER_STEP) and isinstance(v, (int, float))})
        row.update({k: m[k] for k in TIMING if isinstance(m.get(k), (int, float))})
        per_step.append(row)
    keys = sorted({k for row in per_step for k in row if k != "step"})
    medians = {k: statistics.median([row[k] for row in per_step if k in row]) for k in keys}
    totals = {}
    for m in r.metrics:
        totals.update({k: v for k, v in m.items() if any(p in k for p in TOTALS) and isinstance(v, (int, float))})
    versions = [int(e.get("version", -1)) for e in r.pushes]
    return {
        "run": index,
        "run_dir": str(r.run_dir),
        "launcher_log": str(r.log),
        "seconds": round(r.seconds, 1),
        "hang": r.hung,
        "returncode": r.returncode,
        "steps": r.steps,
        "steps_done": len(r.metrics),
        "pushes_landed": r.pushes_landed,
        "push_versions_in_order": versions == list(range(1, len(versions) + 1)),
        "lost": r.lost,
        "duplicated": r.duplicated,
        "committed_step": r.ledger.get("committed_step"),
        "trained": r.ledger.get("trained"),
        "audit_error": r.audit_error,
        "left_behind": r.left_behind,
        "server_version_before": before,
        "adoption": _adoption(r.log, before),
        "server_alive_after": None if server is None else server.alive() and sg.health(server.url, timeout=10),
        "running_totals": totals,
        "medians": medians,
        "per_step": per_step,
        "ok": (not r.hung and r.returncode == 0 and r.pushes_landed == r.steps and r.lost == 0
               and r.duplicated == 0 and not r.left_behind),
    }


def _totals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "runs": len(runs),
        "ok": sum(r["ok"] for r in runs),
        "hangs": sum(r["hang"] for r in runs),
        "failed_exit": sum(1 for r in runs if not r["hang"] and r["returncode"] != 0),
        "median_seconds": statistics.median([r["seconds"] for r in runs]) if runs else None,
        "flush_refused": sum(int(v) for r in runs for k, v in r["running_totals"].items() if "flush" in k),
        "stalls": sum(int(v) for r in runs for k, v in r["running_totals"].items() if "stall" in k),
        "all_ok": bool(runs) and all(r["ok"] for r in runs),
    }


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _row(e: dict[str, Any]) -> str:
    totals = e["running_totals"]
    flush = sum(int(v) for k, v in totals.items() if "flush" in k) if any("flush" in k for k in totals) else None
    stalls = sum(int(v) for k, v in totals.items() if "stall" in k) if any("stall" in k for k in totals) else None
    return (f"{e['run']:>3}  {_fmt(e['seconds']):>7}  {str(e['steps_done']) + '/' + str(e['steps']):>7}  "
            f"{str(e['pushes_landed']) + '/' + str(e['steps']):>7}  {_fmt(e['lost']):>4}  {_fmt(e['duplicated']):>4}  "
            f"{'YES' if e['hang'] else 'no':>4}  {_fmt(e['returncode']):>3}  {_fmt(flush):>5}  {_fmt(stalls):>6}  "
            f"{_fmt(e['medians'].get('mismatch_k3')):>9}  {e['adoption']}")


def _table(report: dict[str, Any]) -> str:
    lines = [f"sluice against SGLang 0.5.23 on CPU: {report['mode']}, {report['steps']} steps a run, "
             f"{'managed servers' if report['managed'] else 'one shared server'}, limit {report['timeout_s']:.0f} s",
             f"{'run':>3}  {'seconds':>7}  {'steps':>7}  {'pushes':>7}  {'lost':>4}  {'dup':>4}  {'hang':>4}  "
             f"{'rc':>3}  {'flush':>5}  {'stalls':>6}  {'k3 median':>9}  adoption (version found: action)"]
    lines += [_row(e) for e in report["runs"]]
    keys = sorted({k for e in report["runs"] for k in e["medians"]})
    if keys:
        lines.append("")
        lines.append("medians per run of the per-step metrics (" + ", ".join(keys) + "):")
        for e in report["runs"]:
            lines.append(f"  run {e['run']}: " + ", ".join(f"{k} {_fmt(e['medians'][k])}" for k in keys
                                                        if k in e["medians"]))
    for e in report["runs"]:
        if e["hang"] or e["returncode"] != 0 or e["audit_error"] or e["left_behind"]:
            lines.append(f"  run {e['run']}: logs in {e['launcher_log']} and {e['run_dir']}/logs"
                         + (f"; audit: {e['audit_error']}" if e["audit_error"] else "")
                         + (f"; processes left (killed): {e['left_behind']}" if e["left_behind"] else ""))
    s = report["summary"]
    lines.append(f"summary: {s['ok']}/{s['runs']} runs clean, {s['hangs']} hung, {s['failed_exit']} failed, "
                 f"median {_fmt(s['median_seconds'])} s a run, {s['flush_refused']} refused flushes, "
                 f"{s['stalls']} stalled pushes")
    return "\n".join(lines)


def _write(out: Path, report: dict[str, Any], servers: list[dict[str, Any]]) -> None:
    report["server"] = servers
    report["written"] = time.time()
    partial = out / "soak.json.tmp"
    partial.write_text(json.dumps(report, indent=1, default=str))
    partial.rename(out / "soak.json")


if __name__ == "__main__":
    sys.exit(main())
