"""The archive split over two archivers (``queue.archive.processes = 2``), on a single server and on a 3-primary
cluster (``ON_BOTH``): every entry archived exactly once, each archiver fetching only the payloads of the entries it
owns; a crash between rename and ack (in a thread, and a real SIGKILLed process) archives nothing twice and loses
nothing; the trim waits for both groups; replay merges both archivers' segments back into stream order; and an
archive continued with another number of archivers is refused."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from pipeline.cli.queue import archive_summary
from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.launch.launcher import archive_groups, archiver_specs
from pipeline.queue.archive import Archiver, ArchiveReader, ArchiveWriter, load_index, parse_id
from pipeline.queue.archive_parts import ArchivePart, archive_parts, group_part, owner_of, segment_part
from pipeline.queue.base import QueueEntry
from pipeline.queue.keys import hash_tag
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import Sample
from tests.helpers import one_slot, redis_cluster
from tests.helpers.one_slot import ON_BOTH
from tests.helpers.samples import make_group

redis_kind, redis_url, redis_client = one_slot.redis_kind, one_slot.redis_url, one_slot.redis_client
redis_cluster = redis_cluster.redis_cluster

SPLIT = archive_parts(2)


def _groups(n: int, seed: int) -> list[list[Sample]]:
    """``n`` groups of 3 samples whose group ids, and so their owners, are fixed by ``seed``."""
    rng = np.random.default_rng(seed)
    groups = [make_group(rng, 3, version=(v // 2, v // 2 + 1)) for v in range(n)]
    for i, g in enumerate(groups):
        for s in g:
            s.group_id = f"g{seed}-{i}"
    return groups


def _counting(queue: SampleQueue) -> list[str]:
    """The payload keys ``queue`` fetches from here on."""
    fetched: list[str] = []
    fetch = queue.fetch_payloads

    def counted(keys):  # type: ignore[no-untyped-def]
        fetched.extend(keys)
        return fetch(keys)

    queue.fetch_payloads = counted  # type: ignore[method-assign]
    return fetched


def _archived(folder: Path) -> list[str]:
    return [sid for sid, _ in ArchiveReader(folder).entries()]


def _assert_exactly_once_in_stream_order(folder: Path, ids: list[str], groups: list[list[Sample]]) -> None:
    back = list(ArchiveReader(folder).entries())
    assert [sid for sid, _ in back] == [i for i, g in zip(ids, groups) for _ in g]  # stream order, each once
    assert [s for _, s in back] == [s for g in groups for s in g]


# ------------------------------------------------------------------------------------------------- the split
@ON_BOTH
def test_two_archivers_archive_every_entry_once_each_fetching_only_its_own(
    queue: SampleQueue, redis_client: object, redis_kind: str, tmp_path: Path
) -> None:
    groups = _groups(24, seed=0)
    ids = queue.put_many(groups)
    queues = [SampleQueue(queue.redis, queue.run) for _ in SPLIT]
    fetched = [_counting(q) for q in queues]
    archivers = [Archiver(q, tmp_path / "a", part=p, segment_samples=7, block_ms=10) for q, p in zip(queues, SPLIT)]
    threads = [threading.Thread(target=a.run, kwargs={"idle_exit_s": 0.3}) for a in archivers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    _assert_exactly_once_in_stream_order(tmp_path / "a", ids, groups)
    pkey = {i: h.payload_key for i, h in queue.scan_headers()}
    for part, keys in zip(SPLIT, fetched):
        own = [i for i, g in zip(ids, groups) if owner_of(g[0].group_id, 2) == part.index]
        assert 0 < len(own) < len(ids)
        assert sorted(keys) == sorted(pkey[i] for i in own)  # its own entries' payloads, each once, nothing else
        assert queue.pending_ids(part.group) == [] and queue.lag(part.group) == 0
    segments = load_index(tmp_path / "a")
    assert {(s.part, s.parts) for s in segments} == {(0, 2), (1, 2)}
    assert all(segment_part(s.name) == s.writer for s in segments)
    if redis_kind == "cluster":
        # 6 shard tags, 2 archivers: archiver i's payloads sit on the tags whose index is i mod 2, its own shards.
        tags = queue.shard_tags()
        assert len(tags) % 2 == 0
        for part, keys in zip(SPLIT, fetched):
            assert {tags.index(hash_tag(k)) % 2 for k in keys} == {part.index}


def test_replay_merges_interleaved_archivers_into_stream_order(tmp_path: Path) -> None:
    groups = _groups(9, seed=1)
    entries = [QueueEntry(id=f"{1000 + i}-{i % 2}", samples=g, version_min=0, version_max=0)
               for i, g in enumerate(groups)]
    # Archiver 0 owns entries 0, 3, 4, 8, archiver 1 the rest; each wrote two segments, their ranges interleaving.
    own = {0: [0, 3, 4, 8], 1: [1, 2, 5, 6, 7]}
    for part in SPLIT:
        writer = ArchiveWriter(tmp_path / "a", part=part)
        mine = [entries[i] for i in own[part.index]]
        writer.write_segment(mine[:2])
        writer.write_segment(mine[2:])
    ids = [e.id for e in entries]
    _assert_exactly_once_in_stream_order(tmp_path / "a", ids, groups)
    reader = ArchiveReader(tmp_path / "a")
    assert reader.table().column("stream_id").to_pylist() == [i for i, g in zip(ids, groups) for _ in g]
    assert {sid for sid, _ in reader.entries(id_range=(ids[2], ids[5]))} == set(ids[2:6])
    # The index is a cache of every archiver's segments: rebuilt from their footers, and equal.
    before = load_index(tmp_path / "a")
    (tmp_path / "a" / "index.json").unlink()
    assert load_index(tmp_path / "a") == before
    assert sorted(s.name for s in before) == sorted(p.name for p in (tmp_path / "a").glob("seg-*-of-2.parquet"))


# ---------------------------------------------------------------------------------------------------- crashes
@ON_BOTH
def test_a_crash_of_one_archiver_between_rename_and_ack_archives_nothing_twice(queue: SampleQueue,
                                                                               tmp_path: Path) -> None:
    groups = _groups(20, seed=2)
    ids = queue.put_many(groups)
    # Archiver 1 read everything, wrote a segment of its first three entries, died before acking it; the rest of
    # what it read stays pending, unwritten. Archiver 0 meanwhile archived all of its own, up to the stream's end.
    Archiver(queue, tmp_path / "a", part=SPLIT[1]).recover()  # creates both groups, as a launcher would
    headers = queue.read_headers(SPLIT[1].group, "archiver", count=100)
    mine = [h for h in headers if SPLIT[1].owns(h.group_id)]
    ArchiveWriter(tmp_path / "a", part=SPLIT[1]).write_segment(queue.materialize(SPLIT[1].group, "archiver", mine[:3]))
    Archiver(queue, tmp_path / "a", part=SPLIT[0], block_ms=10).run(idle_exit_s=0.2)
    newest = load_index(tmp_path / "a")[-1]
    assert newest.part == 0 and parse_id(newest.last_id) > parse_id(mine[2].id)  # only its own segments count
    assert len(queue.pending_ids(SPLIT[1].group)) == len(ids)

    restarted = Archiver(queue, tmp_path / "a", part=SPLIT[1], block_ms=10)
    fetched = _counting(queue)
    restarted.run(idle_exit_s=0.2)
    assert sorted(fetched) == sorted(h.payload_key for h in mine[3:])  # the three on disk are not fetched again
    _assert_exactly_once_in_stream_order(tmp_path / "a", ids, groups)
    assert all(queue.pending_ids(p.group) == [] for p in SPLIT)


_ARCHIVER = """
import os, signal, sys
from pipeline.queue.archive import Archiver
from pipeline.queue.archive_parts import ArchivePart
from pipeline.queue.connection import connect
from pipeline.queue.redis_streams import SampleQueue
url, run, folder, index, die_after = sys.argv[1:6]
arch = Archiver(SampleQueue(connect(url), run), folder, part=ArchivePart(int(index), 2), segment_samples=6,
                flush_interval_s=0.2, block_ms=20)
write = arch.writer.write_segment
written = []
def write_then_die(entries):
    written.append(write(entries))
    if len(written) == int(die_after):
        os.kill(os.getpid(), signal.SIGKILL)  # renamed and fsynced, not acked
    return written[-1]
arch.writer.write_segment = write_then_die
arch.run(idle_exit_s=1.0)
"""


@ON_BOTH
def test_a_sigkilled_archiver_process_restarted_mid_run_loses_nothing_and_archives_nothing_twice(
    queue: SampleQueue, redis_url: str, tmp_path: Path
) -> None:
    first, second = _groups(20, seed=3), _groups(10, seed=4)
    ids = queue.put_many(first)
    folder = tmp_path / "archive"

    def start(part: ArchivePart, die_after: int = 0) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", _ARCHIVER, redis_url, queue.run, str(folder), str(part.index),
                                 str(die_after)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    procs = [start(SPLIT[0]), start(SPLIT[1], die_after=2)]
    try:
        assert procs[1].wait(timeout=120) == -signal.SIGKILL, procs[1].communicate()[0][-3000:]
        assert procs[0].wait(timeout=120) == 0, procs[0].communicate()[0][-3000:]
        assert queue.pending_ids(SPLIT[1].group)  # its second segment is on disk, unacked
        ids += queue.put_many(second)  # the run goes on while archiver 1 is down
        procs = [start(SPLIT[0]), start(SPLIT[1])]
        for p in procs:
            assert p.wait(timeout=120) == 0, p.communicate()[0][-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    _assert_exactly_once_in_stream_order(folder, ids, first + second)
    assert all(queue.pending_ids(p.group) == [] and queue.lag(p.group) == 0 for p in SPLIT)


# ------------------------------------------------------------------------------------------------------- trim
@ON_BOTH
def test_the_trim_waits_until_both_archive_groups_acked(queue: SampleQueue, tmp_path: Path) -> None:
    ids = queue.put_many(_groups(8, seed=5))
    Archiver(queue, tmp_path / "a", part=SPLIT[0], block_ms=10).run(idle_exit_s=0.2)
    assert queue.pending_ids(SPLIT[0].group) == [] and queue.lag(SPLIT[0].group) == 0
    assert queue.trim() == 0 and queue.redis.xlen(queue.keys.samples) == len(ids)  # archiver 1 has read nothing
    Archiver(queue, tmp_path / "a", part=SPLIT[1], block_ms=10).run(idle_exit_s=0.2)
    assert queue.trim() == len(ids) and queue.redis.xlen(queue.keys.samples) == 0
    assert len(_archived(tmp_path / "a")) == 8 * 3


# --------------------------------------------------------------------------------------------- another split
def test_an_archive_continued_with_another_number_of_archivers_is_refused(queue: SampleQueue,
                                                                          tmp_path: Path) -> None:
    queue.put_many(_groups(4, seed=6))
    Archiver(queue, tmp_path / "a", block_ms=10).run(idle_exit_s=0.2)  # one archiver, group "archive"
    for part in SPLIT:
        with pytest.raises(ConfigError, match=r"queue.archive.processes = 2, but .* written by 1 archiver"):
            Archiver(queue, tmp_path / "a", part=part).run(idle_exit_s=0.1)
    # Its groups alone say so too (a fresh folder), and nothing of the other split is created.
    with pytest.raises(ConfigError, match="queue.archive.processes = 1 again"):
        Archiver(queue, tmp_path / "fresh", part=SPLIT[0]).run(idle_exit_s=0.1)
    assert queue.group_names() == ["archive"]
    # ... and the other way round: a split archive (another run's) refuses a lone archiver.
    other = SampleQueue(queue.redis, f"{queue.run}-b")
    try:
        other.put_many(_groups(4, seed=7))
        Archiver(other, tmp_path / "split", part=ArchivePart(0, 3), block_ms=10).run(idle_exit_s=0.2)
        with pytest.raises(ConfigError, match="written by 3 archiver"):
            Archiver(other, tmp_path / "split").run(idle_exit_s=0.1)
        other.redis.delete(*other.redis.keys(f"{other.keys.prefix}:*"))
        with pytest.raises(ConfigError, match=r"the segments in .*split say so"):  # its folder alone, too
            Archiver(other, tmp_path / "split").run(idle_exit_s=0.1)
    finally:
        other.redis.delete(*other.redis.keys(f"{other.keys.prefix}:*"), "-")


def test_the_launcher_starts_one_process_and_group_per_archiver(queue: SampleQueue, tmp_path: Path) -> None:
    def cfg(processes: int):  # type: ignore[no-untyped-def]
        return load_config(None, [f"run.run_dir={json.dumps(str(tmp_path / 'run'))}",
                                  f"queue.archive.processes={processes}"])

    assert cfg(1).queue.archive.processes == 1 == load_config(None, []).queue.archive.processes
    (alone,) = archiver_specs(cfg(1))
    assert alone.name == "archiver" and alone.cmd[-2:] == ["archiver", str((tmp_path / "run").resolve())]
    specs = archiver_specs(cfg(2))
    assert [s.name for s in specs] == ["archiver-0", "archiver-1"] and [s.cmd[-1] for s in specs] == ["0", "1"]
    assert archive_groups(cfg(2), queue) == ["archive-0-of-2", "archive-1-of-2"]
    for g in archive_groups(cfg(2), queue):
        queue.create_group(g)
    with pytest.raises(ConfigError, match="queue.archive.processes = 2 again"):
        archive_groups(cfg(1), queue)
    with pytest.raises(ConfigError, match="queue.archive.processes: Input should be greater than or equal to 1"):
        cfg(0)
    assert [group_part(g) for g in ("archive", "archive-1-of-2", "archive-2-of-2", "trainer")] == \
        [ArchivePart(), SPLIT[1], None, None]


def test_queue_stats_sums_the_split_archive(queue: SampleQueue) -> None:
    queue.put_many(_groups(6, seed=8))
    for p in SPLIT:
        queue.create_group(p.group)
    queue.create_group("trainer")
    queue.read_headers(SPLIT[0].group, "archiver", count=4)
    summary = archive_summary([asdict(g) for g in queue.stats().groups])
    assert summary == {"processes": 2, "groups": ["archive-0-of-2", "archive-1-of-2"], "pending": 4, "lag": 6}


def test_ownership_splits_evenly() -> None:
    owners = Counter(owner_of(f"{i:032x}", 2) for i in range(10_000))
    assert abs(owners[0] - owners[1]) < 300
    assert Counter(owner_of(f"group-{i}", 3) for i in range(9_000)).most_common()[-1][1] > 2_800
    assert sum(p.owns("x") for p in archive_parts(4)) == 1
