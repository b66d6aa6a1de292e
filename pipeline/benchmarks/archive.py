"""``sluice bench archive``: how far the archive lags behind a producer with one archiver process and with two
(``queue.archive.processes``), in the same run against the same Redis.

Per round and per archiver count M, a fresh run's queue gets ``groups`` prompt groups of the payload shape
``pipeline.benchmarks.payload_spread.synthetic_group`` builds (GRPO groups, 48 layers x top-8 of 128 experts, compact
routing), put one group a call back to back, as a producer puts a group the moment it is generated, while M archiver
processes (``Archiver``, each its own ``archive-i-of-M`` group) run. Generating routing costs seconds a group, so
``templates`` distinct groups are made up front and each put sends one of them under a fresh group id (which decides
the owning archiver, so the split is the real one).

At the moment the last put returns, the **archive lag** is taken twice: the entries not yet in a committed segment
(acked by their owner), and the seconds until every entry is (the time the trim bound holds the stream). The ratio
M = 2 / M = 1 of the seconds is the figure the goal (<= 0.5) is about: a producer outruns one archiver by far, so
nearly every entry is still waiting at the last put in both cases, while the time to drain them halves when two
archivers share the work. Rounds alternate which M goes first; medians are reported.

``python -m pipeline.benchmarks.archive worker URL RUN FOLDER INDEX PROCESSES SEGMENT_SAMPLES READY`` is one archiver
process of the harness.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GOAL = 0.5


@dataclass
class ArchiveBenchParams:
    """What ``sluice bench archive`` puts and how."""

    groups: int = 1024
    group_size: int = 8
    prompt_tokens: int = 256
    response_tokens: int = 2048
    layers: int = 48
    topk: int = 8
    num_experts: int = 128
    templates: int = 8
    processes: str = "1,2"
    segment_samples: int = 256
    rounds: int = 1
    timeout_s: float = 3600.0
    redis_url: str = ""
    out: str = "benchmarks/results/archive.json"


def _template_groups(p: ArchiveBenchParams) -> list[list[Any]]:
    import numpy as np

    from pipeline.benchmarks.payload_spread import synthetic_group

    rng = np.random.default_rng(0)
    return [synthetic_group(rng, f"template-{i}", size=p.group_size, prompt=p.prompt_tokens,
                            response=p.response_tokens, layers=p.layers, topk=p.topk, experts=p.num_experts)
            for i in range(p.templates)]


def _as_group(template: list[Any], group_id: str) -> list[Any]:
    import dataclasses

    return [dataclasses.replace(s, group_id=group_id, sample_id=f"{group_id}-{s.index}") for s in template]


def _archived_entries(folder: Path) -> tuple[int, dict[int, int]]:
    """Entries in committed segments, in all and per archiver."""
    from pipeline.queue.archive import load_index

    per: dict[int, int] = {}
    if folder.is_dir():
        for seg in load_index(folder):
            per[seg.part] = per.get(seg.part, 0) + seg.entries
    return sum(per.values()), per


def _phase(p: ArchiveBenchParams, client: Any, templates: list[list[Any]], processes: int, folder: Path,
           round_no: int) -> dict[str, Any]:
    """One fresh queue, ``processes`` archiver processes, ``groups`` puts; the lag at the last put."""
    import os
    import signal
    import subprocess
    import time
    import uuid

    from pipeline.queue.archive_parts import archive_parts
    from pipeline.queue.redis_streams import SampleQueue

    run = f"bench-archive-{uuid.uuid4().hex[:8]}"
    queue = SampleQueue(client, run, capacity=p.groups + 1)
    for part in archive_parts(processes):
        queue.create_group(part.group, "0")
    ready = [folder / f".ready-{i}" for i in range(processes)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    workers = [subprocess.Popen([sys.executable, "-m", "pipeline.benchmarks.archive", "worker", p.redis_url, run,
                                 str(folder), str(i), str(processes), str(p.segment_samples), str(ready[i])],
                                env=env) for i in range(processes)]
    try:
        deadline = time.monotonic() + 120
        while not all(r.exists() for r in ready):
            if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                raise RuntimeError(f"the archiver processes of M = {processes} did not start")
            time.sleep(0.05)
        start = time.monotonic()
        for i in range(p.groups):
            queue.put(_as_group(templates[i % len(templates)], f"{run}-r{round_no}-{i}"))
        last_put = time.monotonic()
        at_last, _ = _archived_entries(folder)
        done, per = at_last, {}
        while done < p.groups:
            if time.monotonic() - last_put > p.timeout_s or any(w.poll() is not None for w in workers):
                raise RuntimeError(f"the archive of M = {processes} did not catch up ({done}/{p.groups} entries)")
            time.sleep(0.05)
            done, per = _archived_entries(folder)
        caught_up = time.monotonic()
        _, per = _archived_entries(folder)
    finally:
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                w.wait(timeout=60)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
    queue.trim()  # every group has acked: headers and payloads go, so the next phase starts on an empty server
    for key in list(client.scan_iter(match=f"sluice:{{{run}}}*")):
        client.delete(key)
    return {"processes": processes, "put_s": last_put - start, "lag_entries": p.groups - at_last,
            "catch_up_s": caught_up - last_put, "entries_per_archiver": {str(k): v for k, v in sorted(per.items())}}


def run_archive_bench(p: ArchiveBenchParams) -> dict[str, Any]:
    """Every M of ``p.processes`` each round, alternating which goes first; medians and the M = 2 / M = 1 ratios."""
    import os
    import tempfile

    from pipeline.queue.connection import connect
    from pipeline.queue.redis_server import EmbeddedRedis

    counts = [int(x) for x in p.processes.split(",") if x.strip()]
    templates = _template_groups(p)
    payload_bytes = statistics.mean(len(_payload(t)) for t in templates)
    with tempfile.TemporaryDirectory(prefix="sluice-bench-archive-") as tmp:
        server = None
        if not p.redis_url:
            server = EmbeddedRedis(Path(tmp) / "redis", appendfsync="everysec").start()
            p.redis_url = server.url
        client = connect(p.redis_url)
        try:
            runs: dict[str, list[dict[str, Any]]] = {str(m): [] for m in counts}
            for r in range(p.rounds):
                for m in counts if r % 2 == 0 else counts[::-1]:
                    folder = Path(tmp) / f"archive-{m}-{r}"
                    folder.mkdir()
                    runs[str(m)].append(_phase(p, client, templates, m, folder, r))
            version = client.info("server").get("redis_version", "?")
        finally:
            client.close()
            if server is not None:
                server.stop()
                p.redis_url = ""
    med = {m: {k: statistics.median(x[k] for x in rs) for k in ("put_s", "lag_entries", "catch_up_s")}
           for m, rs in runs.items()}
    res: dict[str, Any] = {"params": asdict(p), "redis_version": version, "cpu_count": os.cpu_count(),
                           "payload_bytes_per_group": payload_bytes, "runs": runs, "median": med, "goal": GOAL}
    if "1" in med and "2" in med:
        res["ratio_catch_up_s"] = med["2"]["catch_up_s"] / max(med["1"]["catch_up_s"], 1e-9)
        res["ratio_lag_entries"] = med["2"]["lag_entries"] / max(med["1"]["lag_entries"], 1)
    if p.out:
        import json

        Path(p.out).parent.mkdir(parents=True, exist_ok=True)
        Path(p.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


def _payload(group: list[Any]) -> bytes:
    from pipeline.queue.redis_streams import encode_entry

    return encode_entry(group)[1]


def summary_lines(r: dict[str, Any]) -> list[str]:
    p = r["params"]
    out = [f"{p['groups']} groups of {p['group_size']} x ({p['prompt_tokens']} + {p['response_tokens']} tokens, "
           f"{p['layers']} layers x top-{p['topk']}), {r['payload_bytes_per_group'] / 1e6:.2f} MB a group; redis "
           f"{r['redis_version']}, {r['cpu_count']} CPUs"]
    for m, med in r["median"].items():
        split = ", ".join(f"{x['entries_per_archiver']}" for x in r["runs"][m][:1])
        out.append(f"  M = {m}: puts took {med['put_s']:.1f} s; at the last put {med['lag_entries']:.0f} entries not "
                   f"archived, caught up {med['catch_up_s']:.1f} s later (entries per archiver {split})")
    if "ratio_catch_up_s" in r:
        out.append(f"  M = 2 / M = 1: catch-up seconds {r['ratio_catch_up_s']:.3f} (goal <= {r['goal']}), entries "
                   f"{r['ratio_lag_entries']:.3f}")
    return out


def _worker(argv: list[str]) -> None:
    """One archiver process of the harness, until SIGTERM."""
    import signal
    import threading

    from pipeline.queue.archive import Archiver
    from pipeline.queue.archive_parts import ArchivePart
    from pipeline.queue.connection import connect
    from pipeline.queue.redis_streams import SampleQueue

    url, run, folder, index, processes, segment_samples, ready = argv
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client = connect(url)
    arch = Archiver(SampleQueue(client, run), folder, part=ArchivePart(int(index), int(processes)),
                    segment_samples=int(segment_samples), flush_interval_s=0.25, block_ms=100)
    Path(ready).touch()
    try:
        arch.run(stop=stop)
    finally:
        client.close()


if __name__ == "__main__":
    if len(sys.argv) != 9 or sys.argv[1] != "worker":
        sys.exit("usage: python -m pipeline.benchmarks.archive worker URL RUN FOLDER INDEX PROCESSES SEGMENT_SAMPLES "
                 "READY (the harness runs it; use `sluice bench archive`)")
    _worker(sys.argv[2:])
