"""``sluice queue stats|tail|export|audit``: look into a run's queue."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pipeline.cli.common import add_run_args, open_run_of, show


def cmd_queue_stats(args: argparse.Namespace) -> int:
    from pipeline.queue.inspect import stats

    handle = open_run_of(args)
    try:
        st = stats(handle.queue)
    finally:
        handle.close(stop_server=True)
    st["archive"] = archive_summary(st["groups"])

    def human(st: dict[str, Any]) -> None:
        from rich.console import Console
        from rich.table import Table

        console = Console()
        console.print(f"run [bold]{st['run']}[/]  length {st['length']}  produced {st['produced']}  "
                      f"dead-letter {st['deadletter']}  policy_version {st['policy_version']}")
        t = Table("group", "consumers", "pending", "lag", "last delivered")
        for g in st["groups"]:
            t.add_row(g["name"], str(g["consumers"]), str(g["pending"]), str(g["lag"]), g["last_delivered_id"])
        console.print(t)
        a = st["archive"]
        if a is not None and a["processes"] > 1:
            console.print(f"archive: {a['processes']} archivers ({', '.join(a['groups'])}); pending {a['pending']}, "
                          f"lag of the slowest {a['lag']}")

    show(args, st, human)
    return 0


def archive_summary(groups: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The archive as a whole from its archivers' groups (``archive``, or ``archive-i-of-M`` when split): its
    pending entries are theirs summed; its lag, the entries not yet delivered to the slowest. None without one."""
    from pipeline.queue.archive_parts import group_part

    mine = [(group_part(g["name"]), g) for g in groups]
    mine = [(p, g) for p, g in mine if p is not None]
    if not mine:
        return None
    lags = [g["lag"] for _, g in mine if g["lag"] is not None]
    return {"processes": max(p.processes for p, _ in mine), "groups": [g["name"] for _, g in mine],
            "pending": sum(g["pending"] for _, g in mine), "lag": max(lags) if lags else None}


def cmd_queue_tail(args: argparse.Namespace) -> int:
    from pipeline.queue.inspect import tail

    handle = open_run_of(args)
    try:
        for rec in tail(handle.queue, count=args.count, follow=args.follow):
            if not args.json:
                rec = {k: v for k, v in rec.items() if k not in ("prompt_ids", "rollout_logprobs", "token_versions",
                                                                  "loss_mask")}
            print(json.dumps(rec, default=str), flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        handle.close(stop_server=True)
    return 0


def cmd_queue_export(args: argparse.Namespace) -> int:
    from pipeline.queue.inspect import export

    handle = open_run_of(args)
    start, _, end = (args.range or "-:+").partition(":")
    try:
        segs = export(handle.queue, args.to, start or "-", end or "+")
    finally:
        handle.close(stop_server=True)
    out = {"folder": args.to, "segments": len(segs), "samples": sum(s.samples for s in segs),
           "entries": sum(s.entries for s in segs)}
    show(args, out, lambda o: print(f"wrote {o['samples']} samples ({o['entries']} entries) in "
                                      f"{o['segments']} segments to {o['folder']}"))
    return 0


def cmd_queue_audit(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from pipeline.queue.inspect import audit
    from pipeline.rundir import ledger_dir

    handle = open_run_of(args)
    try:
        rep = asdict(audit(handle.queue, with_samples=args.samples))
        if handle.run_dir is not None and ledger_dir(handle.run_dir).is_dir():
            from pipeline.consumers.trainer.audit import audit_trainer

            rep["trainer_ledger"] = asdict(audit_trainer(handle.queue, handle.run_dir))
    finally:
        handle.close(stop_server=True)

    def human(r: dict[str, Any]) -> None:
        print(f"run {r['run']}: produced {r['entries_produced']} entries; in stream {r['entries_in_stream']} "
              f"({r['samples_in_stream']} samples), trimmed {r['entries_trimmed']}, undecodable "
              f"{r['undecodable_in_stream']}, dead-lettered {r['deadlettered']}, duplicate sample ids "
              f"{r['duplicate_sample_ids']}")
        for g, c in r["groups"].items():
            print(f"  {g}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
        from pipeline.queue.archive_parts import group_part

        if any((part := group_part(g)) is not None and not part.alone for g in r["groups"]):
            print("  (the archive is split: each archive-i-of-M group acks every entry, archiving only those it "
                  "owns; an entry is archived once all of them acked it)")
        t = r.get("trainer_ledger")
        if t:
            print(f"  trainer ledger (committed step {t['committed_step']}): trained {t['trained']}, stale "
                  f"{t['stale']}, invalid {t['invalid']}, pending {t['pending']}, undelivered {t['undelivered']}, "
                  f"duplicates {t['duplicates']}, lost {t['lost']}")

    show(args, rep, human)
    return 0


def register(sub: Any) -> None:
    """Add this group's commands to the ``sluice`` parser's subcommands."""
    queue = sub.add_parser("queue", help="look into a run's queue").add_subparsers(dest="queue_cmd", required=True)
    p = queue.add_parser("stats", help="length, groups with pending and lag, dead letters, policy version")
    add_run_args(p)
    p.set_defaults(func=cmd_queue_stats)
    p = queue.add_parser("tail", help="the newest samples as JSON lines")
    add_run_args(p)
    p.add_argument("-n", "--count", type=int, default=10)
    p.add_argument("-f", "--follow", action="store_true")
    p.set_defaults(func=cmd_queue_tail)
    p = queue.add_parser("export", help="write the stream as Parquet segments")
    add_run_args(p)
    p.add_argument("--to", required=True, help="output folder")
    p.add_argument("--range", help="stream ids A:B (inclusive; either side may be empty)")
    p.set_defaults(func=cmd_queue_export)
    p = queue.add_parser("audit", help="every sample's fate per consumer group")
    add_run_args(p)
    p.add_argument("--samples", action="store_true", help="include one record per sample")
    p.set_defaults(func=cmd_queue_audit)
