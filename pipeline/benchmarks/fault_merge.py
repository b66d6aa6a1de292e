"""``sluice bench faults-merge``: fold the ``faults.json`` of one ``sluice bench faults`` invocation into a record
of many, such as ``benchmarks/results/faults.json``.

Twenty trials of each kind take hours on a small machine, so the campaign runs as several invocations with
different first seeds. The record keeps every trial with the invocation it came from and an ``era`` (trials measured
before a fix that changed what a kind costs are kept apart as ``before``; new ones are ``after``), and its summaries
are recomputed from the trials, never added up by hand. A trial of the same kind, seed and era as one already in the
record replaces it: a seed is one draw of the kill's moment, and counting it twice would weigh it twice.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from pipeline.benchmarks.faults import KINDS, TrialResult, summarize
from pipeline.errors import ConfigError

_TRIAL_FIELDS = {f.name for f in fields(TrialResult)}


def _as_result(trial: dict[str, Any]) -> TrialResult:
    return TrialResult(**{k: v for k, v in trial.items() if k in _TRIAL_FIELDS})


def summaries(trials: list[dict[str, Any]], era: str) -> list[dict[str, Any]]:
    """One summary per kind (in the harness's order) over the record's trials of ``era``."""
    out = []
    for kind in KINDS:
        mine = sorted((t for t in trials if t["kind"] == kind and t.get("era") == era), key=lambda t: t["seed"])
        if mine:
            s = summarize(kind, [_as_result(t) for t in mine])
            out.append({**s, "seeds": [t["seed"] for t in mine], "wasted_per_trial": [t["wasted"] for t in mine]})
    return out


def merge(record: dict[str, Any], run: dict[str, Any], invocation: str) -> dict[str, Any]:
    """``record`` with ``run``'s trials and baselines added as era ``after`` under ``invocation``."""
    if "trials" not in run or not isinstance(run["trials"], dict):
        raise ConfigError("the run to merge is not the faults.json of a `sluice bench faults` invocation "
                          "(it needs a 'trials' mapping of kind to trials); pass the file its --out folder holds")
    new = [{**t, "era": "after", "invocation": invocation} for kind_trials in run["trials"].values()
           for t in kind_trials]
    keys = {(t["kind"], t["seed"], "after") for t in new}
    trials = [t for t in record.get("trials", []) if (t["kind"], t["seed"], t.get("era")) not in keys] + new
    seeds = {b["seed"] for b in run.get("baselines", [])}
    baselines = [b for b in record.get("baselines", []) if b["seed"] not in seeds] + list(run.get("baselines", []))
    merged = {**record, "trials": sorted(trials, key=lambda t: (t.get("era", ""), t["kind"], t["seed"])),
              "baselines": sorted(baselines, key=lambda b: b["seed"])}
    merged["summary_after"] = summaries(merged["trials"], "after")
    merged["summary_before"] = summaries(merged["trials"], "before")
    return merged


def markdown_table(summary: list[dict[str, Any]]) -> str:
    """The record's summaries as the table in docs/faults.md."""
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    lines = ["| kind | trials | landed | finished | recovered by the launcher | resumes | lost | duplicated | other "
             "problems | wasted per trial (samples) | recover s, median / max | restart s, median / max |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        wasted = ", ".join("-" if w is None else str(w) for w in s["wasted_per_trial"])
        lines.append(f"| `{s['kind']}` | {s['trials']} | {s['landed']} | {s['finished']} | {s['recoveries']} | "
                     f"{s['resumes']} | {s['lost']} | {s['duplicated']} | {s['other_problems']} | {wasted} | "
                     f"{f(s['recover_s']['median'])} / {f(s['recover_s']['max'])} | "
                     f"{f(s['restart_s']['median'])} / {f(s['restart_s']['max'])} |")
    return "\n".join(lines)


def cmd(args: Any) -> int:
    """``sluice bench faults-merge RUN_JSON... --into RECORD``."""
    into = Path(args.into)
    record: dict[str, Any] = json.loads(into.read_text()) if into.exists() else {}
    for path in args.runs:
        run_path = Path(path)
        if run_path.is_dir():
            run_path = run_path / "faults.json"
        if not run_path.exists():
            raise ConfigError(f"{run_path} does not exist; pass a `sluice bench faults` --out folder or its "
                              "faults.json")
        record = merge(record, json.loads(run_path.read_text()), invocation=run_path.parent.name)
    into.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(markdown_table(record["summary_after"]))
    return 0
