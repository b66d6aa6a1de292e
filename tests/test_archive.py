"""The Parquet archive: durable segments acked only after rename, exact read-back, filters, crash recovery."""

from __future__ import annotations

import threading
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest
from conftest import make_group

from pipeline.errors import QueueError
from pipeline.queue.archive import Archiver, ArchiveReader, ArchiveWriter, load_index, parse_id
from pipeline.queue.redis_streams import SampleQueue


def _fill(queue: SampleQueue, n: int, seed: int = 0) -> tuple[list[str], list[list]]:
    rng = np.random.default_rng(seed)
    groups = [make_group(rng, 3, version=(v // 2, v // 2 + 1)) for v in range(n)]
    return queue.put_many(groups), groups


def test_archive_write_and_read_back_equal_the_input(queue: SampleQueue, tmp_path: Path) -> None:
    queue.create_group("archive")
    ids, groups = _fill(queue, 10)
    arch = Archiver(queue, tmp_path / "archive", segment_samples=7, block_ms=10)
    arch.run(idle_exit_s=0.2)
    segs = load_index(tmp_path / "archive")
    assert len(segs) >= 2 and sum(s.samples for s in segs) == 30
    assert segs[0].first_id == ids[0] and segs[-1].last_id == ids[-1]
    # Everything archived is acked; nothing is pending in the archive group.
    assert queue.pending_ids("archive") == [] and queue.lag("archive") == 0

    reader = ArchiveReader(tmp_path / "archive")
    back = list(reader.entries())
    assert [s for _, s in back] == [s for g in groups for s in g]
    assert [sid for sid, _ in back] == [i for i, g in zip(ids, groups) for _ in g]


def test_reader_filters_by_id_and_version_range(queue: SampleQueue, tmp_path: Path) -> None:
    queue.create_group("archive")
    ids, groups = _fill(queue, 10, seed=1)
    Archiver(queue, tmp_path / "a", segment_samples=6, block_ms=10).run(idle_exit_s=0.2)
    reader = ArchiveReader(tmp_path / "a")
    got = list(reader.entries(id_range=(ids[3], ids[6])))
    assert {sid for sid, _ in got} == set(ids[3:7]) and len(got) == 12
    in_range = [s for g in groups for s in g if s.version_min >= 1 and s.version_max <= 3]
    assert list(reader.samples(version_range=(1, 3))) == in_range and in_range
    assert list(reader.samples(version_range=(100, None))) == []


def test_files_open_with_pandas_and_duckdb_without_sluice(queue: SampleQueue, tmp_path: Path) -> None:
    queue.create_group("archive")
    ids, groups = _fill(queue, 4, seed=2)
    Archiver(queue, tmp_path / "a", block_ms=10).run(idle_exit_s=0.2)
    (seg,) = sorted((tmp_path / "a").glob("seg-*.parquet"))
    df = pd.read_parquet(seg)
    assert len(df) == 12 and list(df["sample_id"]) == [s.sample_id for g in groups for s in g]
    assert list(df["response_ids"].iloc[0]) == groups[0][0].response_ids.tolist()
    (rows,) = duckdb.sql(
        f"select count(*), max(version_max), sum(len(response_ids)) from read_parquet('{tmp_path / 'a'}/seg-*.parquet')"
    ).fetchall()
    assert rows == (12, max(s.version_max for g in groups for s in g), sum(len(s.response_ids) for g in groups for s in g))


def test_crash_after_rename_before_ack_archives_nothing_twice(queue: SampleQueue, tmp_path: Path) -> None:
    queue.create_group("archive")
    ids, _ = _fill(queue, 6, seed=3)
    # The archiver read everything and renamed a segment, then died before its ack.
    entries = queue.read("archive", "archiver", count=4)
    ArchiveWriter(tmp_path / "a").write_segment(entries)
    assert len(queue.pending_ids("archive")) == 4

    restarted = Archiver(queue, tmp_path / "a", block_ms=10)
    restarted.run(idle_exit_s=0.2)
    assert queue.pending_ids("archive") == []
    reader = ArchiveReader(tmp_path / "a")
    seen = [sid for sid, _ in reader.entries()]
    assert sorted(set(seen), key=parse_id) == ids and len(seen) == 6 * 3  # each entry exactly once


def test_crash_before_rename_rewrites_the_segment(queue: SampleQueue, tmp_path: Path) -> None:
    queue.create_group("archive")
    ids, groups = _fill(queue, 3, seed=4)
    queue.read("archive", "archiver", count=3)  # read, then died before writing anything
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / ".seg-half-written.parquet.tmp").write_bytes(b"PAR1 torn")
    Archiver(queue, tmp_path / "a", block_ms=10).run(idle_exit_s=0.2)
    assert list(ArchiveReader(tmp_path / "a").samples()) == [s for g in groups for s in g]


def test_index_is_rebuilt_from_segments(queue: SampleQueue, tmp_path: Path) -> None:
    queue.create_group("archive")
    _fill(queue, 5, seed=5)
    Archiver(queue, tmp_path / "a", segment_samples=3, block_ms=10).run(idle_exit_s=0.2)
    before = load_index(tmp_path / "a")
    (tmp_path / "a" / "index.json").unlink()
    assert load_index(tmp_path / "a") == before


def test_one_archiver_per_folder(queue: SampleQueue, tmp_path: Path) -> None:
    queue.create_group("archive")
    stop = threading.Event()
    first = Archiver(queue, tmp_path / "a", block_ms=10)
    th = threading.Thread(target=first.run, kwargs={"stop": stop})
    th.start()
    try:
        import time

        time.sleep(0.2)
        with pytest.raises(QueueError, match="another archiver"):
            Archiver(queue, tmp_path / "a").run(idle_exit_s=0.1)
    finally:
        stop.set()
        th.join()
