"""The fault harness's own bookkeeping, independent of the code under test.

Everything here reads raw data with plain redis-py commands, msgpack and pyarrow: the samples stream through a
consumer group of the harness's own (``StreamTap``), the trainer's and archiver's consumer groups, the dead-letter and
events streams, the ``policy_version`` counter, the ledger's Parquet segments, the archive's Parquet segments and the
checkpoints' ``sluice_meta.json``. It imports no sluice reader (``SampleQueue``, ``read_ledger``, ``ArchiveReader``,
``audit_trainer``), so a bug in those cannot hide a loss from it. ``check`` is a pure function of a ``RunRecord``, so
a test can feed it a doctored record and see that it reports what it should.

The run's Redis may be one server or a Redis Cluster (a ``redis+cluster://`` URL, ``raw_client``). On a cluster the
run's control keys share one slot, so the same commands read them; payload keys are spread over every primary, and
are counted by a ``SCAN`` of each primary.
"""

from __future__ import annotations

import json
import re
import threading
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pyarrow.parquet as pq
import redis
from redis.cluster import ClusterNode, RedisCluster

from pipeline.queue.connection import cluster_startup_nodes, is_cluster_url
from pipeline.queue.redis_streams import GONE_REASON
from pipeline.rundir import archive_dir, ledger_dir, run_checkpoints

TAP_GROUP = "faults-tap"
TAP_CONSUMER = "harness"
#: The archive's consumer groups: ``archive`` for one archiver, ``archive-i-of-M`` for archiver i of M
#: (``queue.archive.processes``). Written out here rather than imported, like the ownership rule below, so that a
#: wrong split in the archiver cannot agree with itself in the check.
_ARCHIVE_GROUP = re.compile(r"^archive(?:-(\d+)-of-(\d+))?$")

RawClient = redis.Redis | RedisCluster


def raw_client(url: str, **kwargs: Any) -> RawClient:
    """A plain redis-py client of ``url``: ``RedisCluster`` for a ``redis+cluster://`` URL (every node it names a
    startup node), else ``redis.Redis``. RESP2, as the run's own clients speak."""
    if is_cluster_url(url):
        base, nodes = cluster_startup_nodes(url)
        return RedisCluster(url=base, startup_nodes=[ClusterNode(h, p) for h, p in nodes[1:]], protocol=2, **kwargs)
    return redis.Redis.from_url(url, protocol=2, **kwargs)


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _field(fields: dict[Any, Any], name: str) -> Any:
    return fields.get(name.encode(), fields.get(name))


def sample_ids_of(fields: dict[Any, Any] | None) -> list[str] | None:
    """The sample ids of one stream entry, read straight from its msgpack: the header's ``sample_id`` column (entry
    schema 3), or the inline envelope's samples (schemas 1 and 2); None if unreadable."""
    if not fields:
        return None
    try:
        head = fields.get(b"head", fields.get("head"))
        if head is not None:
            return [str(i) for i in msgpack.unpackb(head, raw=False)["sample_id"]]
        data = fields.get(b"data", fields.get("data"))
        env = msgpack.unpackb(data, raw=False)
        return [str(m["sample_id"]) for m in env["samples"]]
    except Exception:  # any malformed entry: the run must dead-letter it; the check looks for that
        return None


def group_id_of(fields: dict[Any, Any] | None) -> str | None:
    """The prompt group id of one stream entry (what decides which archiver owns it); None if unreadable."""
    if not fields:
        return None
    try:
        head = _field(fields, "head")
        if head is not None:
            return str(msgpack.unpackb(head, raw=False)["group_id"][0])
        return str(msgpack.unpackb(_field(fields, "data"), raw=False)["samples"][0]["group_id"])
    except Exception:  # malformed: the entry is owned by no archiver the check can name
        return None


class StreamTap:
    """Records every entry that reaches the samples stream, through a consumer group of the harness's own.

    The group is created at id 0 as soon as the run's Redis answers, before producers start. It reads and acks as it
    goes, so the run's trimming works as usual: trimming drops only entries every group acked, this one included, so
    no entry can leave the stream before the tap has recorded it. Its own pending entries are read first on every
    pass (a read whose answer a Redis kill lost), and records are keyed by entry id, so a re-delivery counts once.
    """

    def __init__(self, url: Callable[[], str | None], stream: str, poll_s: float = 0.3) -> None:
        self._url = url
        self.stream = stream
        self.poll_s = poll_s
        self.entries: dict[str, list[str] | None] = {}
        self.group_ids: dict[str, str | None] = {}
        self.attached_empty: bool | None = None  # the stream was empty when the group was made (nothing missed)
        self.errors = 0
        self._client: RawClient | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> StreamTap:
        self._thread = threading.Thread(target=self._loop, name="faults-tap", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._client = None

    def _connect(self) -> RawClient | None:
        url = self._url()
        if url is None:
            return None
        client = raw_client(url, socket_timeout=5, socket_connect_timeout=2)
        self.attach(client)
        return client

    def attach(self, client: RawClient) -> None:
        try:
            if self.attached_empty is None:
                self.attached_empty = int(client.xlen(self.stream)) == 0
            client.xgroup_create(self.stream, TAP_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if self._client is None:
                    self._client = self._connect()
                if self._client is not None:
                    self.drain(self._client)
            except (redis.RedisError, OSError):
                self.errors += 1  # Redis killed or restarting: reconnect (the URL may have changed) and go on
                if self._client is not None:
                    self._client.close()
                self._client = None
            self._stop.wait(self.poll_s)

    def drain(self, client: RawClient) -> int:
        """Read this tap's pending entries, then every new one, record and ack them; returns how many."""
        n = 0
        with self._lock:
            for start in ("0", ">"):
                while True:
                    reply = client.xreadgroup(TAP_GROUP, TAP_CONSUMER, {self.stream: start}, count=256)
                    rows = reply[0][1] if reply else []
                    rows = [(_s(i), f) for i, f in rows if f is not None or start == "0"]
                    if not rows:
                        break
                    for entry_id, fields in rows:
                        if fields is not None or entry_id not in self.entries:
                            self.entries[entry_id] = sample_ids_of(fields)
                            self.group_ids[entry_id] = group_id_of(fields)
                    client.xack(self.stream, TAP_GROUP, *[i for i, _ in rows])
                    n += len(rows)
                    if start == "0":
                        break  # acked: the next "0" read would return the rest of the backlog
        return n


@dataclass
class RunRecord:
    """What a finished trial left behind, as raw data."""

    tapped: dict[str, list[str] | None]
    """Every entry that reached the stream (from the tap): id -> its sample ids (None: undecodable)."""
    stream_ids: set[str]
    """Entries still in the stream at the end."""
    trainer_pending: set[str]
    trainer_last: str | None
    """The trainer group's last-delivered id (None: no group)."""
    deadletter_ids: set[str]
    """Entries the trainer's group dead-lettered for what they held (a dead-letter because the entry was gone
    from the stream is a loss, not an answer)."""
    ledger: list[dict[str, Any]]
    """Committed ledger lines (segments up to the newest complete checkpoint)."""
    counter: int
    """``policy_version`` in Redis."""
    pushes: list[int]
    """Versions of the events stream's ``weight_push`` events, in stream order."""
    event_checkpoints: list[tuple[int, int]]
    """(step, version) of the events stream's ``checkpoint`` events, in stream order."""
    newest_checkpoint: tuple[int, int] | None
    """(step, policy_version) of the newest complete checkpoint's metadata."""
    archive_rows: list[tuple[str, str]] | None
    """(stream id, sample id) of every archived sample; None when the archive is off."""
    archive_pending: dict[str, set[str]] = field(default_factory=dict)
    """Per archive group (``archive``, or ``archive-i-of-M``), the entries pending in it."""
    archive_last: dict[str, str | None] = field(default_factory=dict)
    """Per archive group, its last-delivered id."""
    archive_deadletter_ids: set[str] = field(default_factory=set)
    """Entries an archiver's group dead-lettered for their content."""
    group_ids: dict[str, str | None] = field(default_factory=dict)
    """Tapped entry id -> its prompt group id (which archiver owns it); None: unreadable."""
    payload_keys: dict[str, list[str]] = field(default_factory=dict)
    """The run's payload keys left on each server (every primary of a cluster), by server."""
    stream_payloads: dict[str, str] = field(default_factory=dict)
    """Entry id -> payload key, for the entries still in the stream."""
    trash: int = 0
    """Payload keys still named in the trash set (a trim's second move not yet done)."""
    unacked: dict[str, int] = field(default_factory=dict)
    """Per consumer group of the samples stream, the entries delivered to it and never acked."""


@dataclass
class Verdict:
    """The checks of one trial. ``lost`` and ``duplicated`` count samples; the version and archive checks list what
    disagreed."""

    samples: int
    trained: int
    stale: int
    lost: int
    duplicated: int
    phantom: int
    """Ledger lines for sample ids that never reached the stream."""
    committed_step: int
    version_problems: list[str]
    archive_problems: list[str]
    lost_ids: list[str] = field(default_factory=list)
    duplicated_ids: list[str] = field(default_factory=list)
    payload_keys_left: int = 0
    """Payload keys that nothing will delete: no entry still in the stream names them."""
    unacked_left: int = 0
    """Entries delivered to some consumer group and never acked, summed over the groups."""
    leftover_problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.phantom or self.version_problems or self.archive_problems
                    or self.leftover_problems)


def _delivered_to(entry_id: str, last: str | None) -> bool:
    return last is not None and _id(entry_id) <= _id(last)


def check(r: RunRecord) -> Verdict:
    """No sample lost or trained twice, versions monotone and consistent, archive == stream."""
    fates: dict[str, list[str]] = {}
    for line in r.ledger:
        fates.setdefault(str(line["sample_id"]), []).append(str(line["fate"]))
    entries_of: dict[str, list[str]] = {}
    for entry_id, ids in r.tapped.items():
        for sid in ids or ():
            entries_of.setdefault(sid, []).append(entry_id)
    lost: list[str] = []
    for sid, entries in entries_of.items():
        if sid in fates:
            continue
        # Not judged yet is fine only if some copy of it is still the trainer's to read: pending, or not delivered.
        waiting = any(e in r.trainer_pending or (e in r.stream_ids and not _delivered_to(e, r.trainer_last))
                      for e in entries)
        if not waiting and not any(e in r.deadletter_ids for e in entries):
            lost.append(sid)
    # Entries the run could not decode must be dead-lettered, not silently acked.
    lost += [f"entry:{e}" for e, ids in r.tapped.items() if ids is None and e not in r.deadletter_ids
             and e not in r.trainer_pending and _delivered_to(e, r.trainer_last)]
    duplicated = sorted(sid for sid, f in fates.items() if len(f) > 1)
    phantom = [sid for sid in fates if sid not in entries_of]
    counts = Counter(line["fate"] for line in r.ledger)
    orphans = orphan_payloads(r)
    unacked = sum(r.unacked.values())
    return Verdict(
        samples=len(entries_of), trained=counts["trained"], stale=counts["stale"], lost=len(lost),
        duplicated=len(duplicated), phantom=len(phantom),
        committed_step=r.newest_checkpoint[0] if r.newest_checkpoint else -1,
        version_problems=version_problems(r), archive_problems=archive_problems(r),
        lost_ids=lost[:20], duplicated_ids=duplicated[:20], payload_keys_left=len(orphans), unacked_left=unacked,
        leftover_problems=leftover_problems(r, orphans),
    )


def orphan_payloads(r: RunRecord) -> list[str]:
    """Payload keys on any server that no entry still in the stream names. A finished run keeps the entries its
    trainer did not reach (the producers run ahead of it), with their payloads, for a resumed run; any other payload
    key is one that no trim will ever delete."""
    named = set(r.stream_payloads.values())
    return sorted(k for keys in r.payload_keys.values() for k in keys if k not in named)


def leftover_problems(r: RunRecord, orphans: list[str]) -> list[str]:
    """What a finished run must not leave behind: payload keys nothing deletes, keys waiting in the trash, entries
    delivered and never acked, and entries in the stream whose payload is gone."""
    out = []
    if orphans:
        where = sorted(node for node, keys in r.payload_keys.items() if set(keys) & set(orphans))
        out.append(f"{len(orphans)} payload keys that no stream entry names, on {', '.join(where)}, "
                   f"e.g. {orphans[:3]}")
    if r.trash:
        out.append(f"{r.trash} payload keys left in the trash set")
    if unacked := {g: n for g, n in r.unacked.items() if n}:
        out.append(f"entries delivered and never acked: {unacked}")
    have = {k for keys in r.payload_keys.values() for k in keys}
    if missing := sorted(e for e, k in r.stream_payloads.items() if k not in have):
        out.append(f"{len(missing)} stream entries whose payload is gone, e.g. {missing[:3]}")
    return out


def version_problems(r: RunRecord) -> list[str]:
    """The counter only goes up and the three records of it agree: Redis, the newest checkpoint, the events."""
    out = []
    if any(b <= a for a, b in zip(r.pushes, r.pushes[1:])):
        out.append(f"weight_push versions not strictly increasing: {r.pushes}")
    if r.pushes and max(r.pushes) != r.counter:
        out.append(f"policy_version in Redis is {r.counter}, the newest weight_push event says {max(r.pushes)}")
    ck = [v for _, v in r.event_checkpoints]
    if any(b < a for a, b in zip(ck, ck[1:])):
        out.append(f"checkpoint event versions went back: {r.event_checkpoints}")
    if r.newest_checkpoint is not None:
        step, version = r.newest_checkpoint
        if version > r.counter:
            out.append(f"newest checkpoint (step {step}) holds version {version} > Redis's {r.counter}")
        if (step, version) not in r.event_checkpoints:
            out.append(f"newest checkpoint (step {step}, version {version}) has no checkpoint event")
    by_step: dict[int, set[int]] = {}
    for line in r.ledger:
        if line["fate"] == "trained":
            by_step.setdefault(int(line["step"]), set()).add(int(line["policy_version"]))
    steps = sorted(by_step)
    if any(len(v) > 1 for v in by_step.values()):
        out.append("a ledger step trained under two policy versions")
    flat = [max(by_step[s]) for s in steps]
    if any(b <= a for a, b in zip(flat, flat[1:])):
        out.append(f"ledger versions by step not strictly increasing: {list(zip(steps, flat))[:30]}")
    return out


def archive_problems(r: RunRecord) -> list[str]:
    """Every entry that reached the stream is archived exactly once, except those the archiver has yet to read."""
    if r.archive_rows is None:
        return []
    out = []
    rows = Counter(r.archive_rows)
    if twice := [k for k, c in rows.items() if c > 1]:
        out.append(f"{len(twice)} samples archived twice, e.g. {twice[:3]}")
    archived = {e for e, _ in rows}
    tapped = set(r.tapped)
    if extra := archived - tapped:
        out.append(f"{len(extra)} archived entries never reached the stream, e.g. {sorted(extra)[:3]}")
    waiting = {e for e in tapped - archived if _archive_waiting(r, e)}
    if missing := tapped - archived - waiting - r.archive_deadletter_ids:
        out.append(f"{len(missing)} stream entries missing from the archive, e.g. {sorted(missing)[:3]}")
    for entry_id in archived & tapped:
        want = set(r.tapped[entry_id] or ())
        got = {s for e, s in rows if e == entry_id}
        if want != got:
            out.append(f"archived entry {entry_id} holds samples {sorted(got)[:3]}, the stream's {sorted(want)[:3]}")
            break
    return out


def archive_owner(group_id: str | None, groups: list[str]) -> str | None:
    """The archive group that must archive an entry of prompt group ``group_id``, given the run's archive groups:
    ``archive`` alone, or ``archive-i-of-M`` with i = crc32(group id) mod M (docs/architecture.md). None when that
    cannot be told (an unreadable entry, no archive group yet)."""
    if "archive" in groups:
        return "archive"
    splits = {int(m[2]) for g in groups if (m := _ARCHIVE_GROUP.match(g)) is not None and m[2] is not None}
    if group_id is None or len(splits) != 1:
        return None
    m_ = splits.pop()
    return f"archive-{zlib.crc32(group_id.encode()) % m_}-of-{m_}"


def _archive_waiting(r: RunRecord, entry_id: str) -> bool:
    """Whether an entry not in the archive is still its archiver's to read: pending in the owner's group, or in the
    stream and not yet delivered to it. When the owner cannot be told, any archive group that still holds it
    answers."""
    groups = sorted(r.archive_last)
    if not groups:
        return entry_id in r.stream_ids  # no archiver has made its group yet: every entry is still to come
    owner = archive_owner(r.group_ids.get(entry_id), groups)
    for g in [owner] if owner is not None else groups:
        if entry_id in r.archive_pending.get(g, set()) or (
                entry_id in r.stream_ids and not _delivered_to(entry_id, r.archive_last.get(g))):
            return True
    return False


# ------------------------------------------------------------------------------------------------------- collect
def _groups(client: RawClient, stream: str) -> dict[str, dict[str, Any]]:
    """The stream's consumer groups by name, as ``XINFO GROUPS`` describes them."""
    try:
        return {_s(g["name"]): g for g in client.xinfo_groups(stream)}
    except redis.ResponseError:
        return {}


def _group(client: RawClient, stream: str, name: str) -> tuple[set[str], str | None]:
    groups = _groups(client, stream)
    if name not in groups:
        return set(), None
    pending: set[str] = set()
    lo = "-"
    while True:
        rows = client.xpending_range(stream, name, min=lo, max="+", count=1000)
        pending.update(_s(x["message_id"]) for x in rows)
        if len(rows) < 1000:
            break
        lo = "(" + _s(rows[-1]["message_id"])
    return pending, _s(groups[name]["last-delivered-id"])


def _xrange(client: RawClient, key: str, keep: tuple[str, ...] | None = None) -> list[tuple[str, dict[str, str]]]:
    """Every entry of ``key``, with the fields named in ``keep`` (every field when None) as text."""
    out = []
    lo = "-"
    while True:
        rows = client.xrange(key, min=lo, max="+", count=1000)
        out += [(_s(i), {_s(k): _s(v) for k, v in f.items() if keep is None or _s(k) in keep}) for i, f in rows]
        if len(rows) < 1000:
            return out
        lo = "(" + _s(rows[-1][0])


def newest_checkpoint(run_dir: Path) -> tuple[int, int] | None:
    done = run_checkpoints(run_dir)
    if not done:
        return None
    meta = json.loads((done[-1] / "sluice_meta.json").read_text())
    return int(meta["step"]), int(meta.get("policy_version", 0))


def committed_ledger(run_dir: Path, upto_step: int) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for path in sorted(ledger_dir(run_dir).glob("seg-*.parquet")):
        if int(path.stem.split("-")[1]) <= upto_step:
            lines += pq.read_table(path).to_pylist()
    return lines


def archived_rows(run_dir: Path) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for path in sorted(archive_dir(run_dir).glob("seg-*.parquet")):
        t = pq.read_table(path, columns=["stream_id", "sample_id"])
        rows += list(zip(t["stream_id"].to_pylist(), t["sample_id"].to_pylist()))
    return rows


def run_of(prefix: str) -> str:
    """The run's name in its key prefix ``sluice:{run}``."""
    return prefix[prefix.index("{") + 1:prefix.rindex("}")]


def payload_keys(client: RawClient, run: str) -> dict[str, list[str]]:
    """The run's payload keys on each server, by server: every primary of a cluster (its own tag and its shard tags
    ``{run/i}``), or the one server."""
    if isinstance(client, RedisCluster):
        servers = [(n.name, client.get_redis_connection(n)) for n in client.get_primaries()]
    else:
        servers = [("server", client)]
    out: dict[str, list[str]] = {}
    for name, node in servers:
        found: set[str] = set()
        for pattern in (f"sluice:{{{run}}}:payload:*", f"sluice:{{{run}/*}}:payload:*"):
            found.update(_s(k) for k in node.scan_iter(match=pattern, count=1000))
        out[name] = sorted(found)
    return out


def collect(client: RawClient, prefix: str, run_dir: Path, tap: StreamTap, archive_on: bool) -> RunRecord:
    """Read what a finished trial left: call with the run's Redis up and the launcher gone."""
    stream = f"{prefix}:samples"
    tap.drain(client)  # what the tap had not read yet is still in the stream: its group holds it there
    pending, last = _group(client, stream, "trainer")
    groups = _groups(client, stream)
    archives = sorted(g for g in groups if _ARCHIVE_GROUP.match(g))
    apending: dict[str, set[str]] = {}
    alast: dict[str, str | None] = {}
    for g in archives:
        apending[g], alast[g] = _group(client, stream, g)
    events = _xrange(client, f"{prefix}:events")
    dead = _dead_lettered(client, prefix)
    ckpt = newest_checkpoint(run_dir)
    entries = _xrange(client, stream, keep=("pkey",))
    return RunRecord(
        tapped=dict(tap.entries), stream_ids={i for i, _ in entries},
        trainer_pending=pending, trainer_last=last,
        deadletter_ids=dead.get("trainer", set()),
        ledger=committed_ledger(run_dir, ckpt[0] if ckpt else -1),
        counter=int(client.get(f"{prefix}:policy_version") or 0),
        pushes=[int(e["version"]) for _, e in events if e.get("kind") == "weight_push"],
        event_checkpoints=[(int(e["step"]), int(e["version"])) for _, e in events if e.get("kind") == "checkpoint"],
        newest_checkpoint=ckpt, archive_rows=archived_rows(run_dir) if archive_on else None,
        archive_pending=apending, archive_last=alast,
        archive_deadletter_ids=set().union(*(dead.get(g, set()) for g in archives)),
        group_ids=dict(tap.group_ids), payload_keys=payload_keys(client, run_of(prefix)),
        stream_payloads={i: f["pkey"] for i, f in entries if "pkey" in f},
        trash=int(client.scard(f"{prefix}:payload_trash")),
        unacked={g: int(info["pending"]) for g, info in groups.items()},
    )


def _dead_lettered(client: RawClient, prefix: str) -> dict[str, set[str]]:
    """Per group, the entries it dead-lettered for their content."""
    out: dict[str, set[str]] = {}
    for i, f in _xrange(client, f"{prefix}:deadletter"):
        if not f.get("reason", "").startswith(GONE_REASON):
            out.setdefault(f.get("group", ""), set()).add(f.get("entry_id", i))
    return out

