"""The Parquet archive: durable segments acked only after rename, exact read-back, filters, crash recovery, compact
routing columns that plain readers reshape, and schema-1 archives still read."""

from __future__ import annotations

import io
import shutil
import threading
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import QueueError, SampleDecodeError
from pipeline.queue.archive import Archiver, ArchiveReader, ArchiveWriter, load_index, parse_id
from pipeline.queue.arrow import parquet_write_options, samples_to_table, table_to_samples
from pipeline.queue.base import QueueEntry
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import Sample, SampleStatus, SamplingInfo
from tests.helpers.samples import make_group, make_sample

SCHEMA1_FIXTURE = Path(__file__).parents[1] / "fixtures" / "archive_schema1"


def _fill(queue: SampleQueue, n: int, seed: int = 0, **kw: object) -> tuple[list[str], list[list]]:
    rng = np.random.default_rng(seed)
    groups = [make_group(rng, 3, version=(v // 2, v // 2 + 1), **kw) for v in range(n)]
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


@pytest.mark.parametrize(("num_experts", "encoding"), [(8, "RLE_DICTIONARY"), (128, "BYTE_STREAM_SPLIT")])
def test_files_open_with_pandas_and_duckdb_without_sluice(
    queue: SampleQueue, tmp_path: Path, num_experts: int, encoding: str
) -> None:
    queue.create_group("archive")
    ids, groups = _fill(queue, 4, seed=2, num_experts=num_experts, topk=8, layers=3)
    Archiver(queue, tmp_path / "a", block_ms=10).run(idle_exit_s=0.2)
    (seg,) = sorted((tmp_path / "a").glob("seg-*.parquet"))
    row_group = pq.ParquetFile(seg).metadata.row_group(0)
    routing = [row_group.column(i) for i in range(row_group.num_columns)
               if row_group.column(i).path_in_schema.startswith("routing_response")]
    assert encoding in routing[0].encodings
    samples = [s for g in groups for s in g]
    df = pd.read_parquet(seg)
    assert len(df) == 12 and list(df["sample_id"]) == [s.sample_id for s in samples]
    assert list(df["response_ids"].iloc[0]) == groups[0][0].response_ids.tolist()
    for (_, row), sample in zip(df.iterrows(), samples, strict=True):
        assert np.array_equal(_routing_as_documented(row), sample.routed_experts)
    (rows,) = duckdb.sql(
        "select count(*), max(version_max), sum(len(response_ids)), "
        "sum(len(routing_prompt) + len(routing_response)), max(list_max(routing_response)) "
        f"from read_parquet('{tmp_path / 'a'}/seg-*.parquet')"
    ).fetchall()
    assert rows == (12, max(s.version_max for s in samples), sum(len(s.response_ids) for s in samples),
                    sum(s.routed_experts.size for s in samples),
                    max(int(s.routed_experts[s.num_prompt_tokens :].max()) for s in samples))


def _routing_as_documented(row: pd.Series) -> np.ndarray | None:
    """A row's routing the way docs/queue.md tells a pandas user to rebuild it (no sluice code)."""
    if row["routing_dtype"] is None:
        return None
    layers, topk = int(row["routing_layers"]), int(row["routing_topk"])
    parts = [np.asarray(row[c]).reshape(layers, -1, topk) for c in ("routing_prompt", "routing_response")]
    return np.concatenate(parts, axis=1).transpose(1, 0, 2).astype(row["routing_dtype"])


def _write(folder: Path, groups: list[list[Sample]]) -> Path:
    entries = [QueueEntry(id=f"{i + 1}-0", samples=g, version_min=0, version_max=0) for i, g in enumerate(groups)]
    return folder / ArchiveWriter(folder).write_segment(entries).name


def test_routing_round_trips_exactly_in_its_own_dtype(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    small = make_group(rng, 2, num_experts=8)  # uint8
    wide = make_group(rng, 2, num_experts=300, layers=3, topk=4)  # uint16
    dense = make_group(rng, 2, num_experts=None)
    empty_response = [make_sample(rng, response_len=0, num_experts=128, topk=8)]  # P - 1 rows, all prompt
    cases = {"uint8": [small, dense, empty_response], "mixed": [small, wide, dense]}
    for name, groups in cases.items():
        seg = _write(tmp_path / name, groups)
        assert [s for _, s in ArchiveReader(tmp_path / name).entries()] == [s for g in groups for s in g]
        schema = pq.read_schema(seg)
        assert schema.metadata[b"sluice.schema"] == b"2"
        assert schema.field("routing_prompt").type.value_type == (pa.uint8() if name == "uint8" else pa.uint16())
    back = list(ArchiveReader(tmp_path / "mixed").samples())
    assert [s.routed_experts.dtype for s in back[:4]] == [np.uint8] * 2 + [np.dtype("<u2")] * 2


def _schema1_fixture_samples() -> list[tuple[str, Sample]]:
    """The samples in tests/fixtures/archive_schema1, written by sluice's schema-1 archiver (``routed_experts`` as
    one token-major ``list<uint16>``) from exactly these samples."""
    rng = np.random.default_rng(1234)
    out = []
    for i, (experts, layers, topk) in enumerate([(8, 2, 2), (8, 2, 2), (300, 3, 4), (None, 0, 0), (128, 4, 8)]):
        p, r = 3 + i, 4 + i
        routed = None
        if experts:
            routed = rng.integers(0, experts, (p + r - 1, layers, topk)).astype("u1" if experts <= 256 else "<u2")
        s = Sample(
            prompt_ids=rng.integers(0, 50, p).astype("<i4"),
            response_ids=rng.integers(0, 50, r).astype("<i4"),
            rollout_logprobs=-rng.random(r).astype("<f4"),
            token_versions=np.full(r, i, dtype="<i4"),
            routed_experts=routed,
            reward=float(i) / 2,
            reward_info={"pass": i % 2 == 0},
            status=SampleStatus.COMPLETED if i != 3 else SampleStatus.TRUNCATED,
            finish_reason="stop",
            sample_id=f"s{i}",
            group_id=f"g{i // 2}",
            prompt_id=f"p{i // 2}",
            index=i % 2,
            producer="fixture",
            engine="none",
            created_at=1_700_000_000.0 + i,
            sampling=SamplingInfo(temperature=0.9, max_new_tokens=r, seed=i),
        )
        out.append((f"1700000000000-{i // 2}", s))
    return out


def test_schema1_archive_still_reads_exactly(tmp_path: Path) -> None:
    (seg,) = SCHEMA1_FIXTURE.glob("seg-*.parquet")
    schema = pq.read_schema(seg)
    assert schema.metadata[b"sluice.schema"] == b"1" and schema.field("routed_experts").type == pa.list_(pa.uint16())
    shutil.copytree(SCHEMA1_FIXTURE, tmp_path / "a")
    assert list(ArchiveReader(tmp_path / "a").entries()) == _schema1_fixture_samples()
    # An archiver upgraded mid-run leaves both schemas in one folder; entries reads each segment in its own.
    more = make_group(np.random.default_rng(9), 2, num_experts=128, topk=8)
    entry = QueueEntry(id="1800000000000-0", samples=more, version_min=0, version_max=0)
    ArchiveWriter(tmp_path / "a").write_segment([entry])
    assert [s for _, s in ArchiveReader(tmp_path / "a").entries()] == [s for _, s in _schema1_fixture_samples()] + more
    with pytest.raises(SampleDecodeError, match="mixes schema-1 and schema-2"):
        list(table_to_samples(ArchiveReader(tmp_path / "a").table()))


def _schema1_bytes(samples: list[Sample]) -> int:
    """Bytes of a segment in schema 1's layout, as its archiver wrote it (pyarrow defaults, zstd)."""
    table = samples_to_table(samples).drop_columns(["routing_prompt", "routing_response"])
    values = np.concatenate([s.routed_experts.reshape(-1) for s in samples]).astype(np.uint16)
    offsets = np.cumsum([0] + [s.routed_experts.size for s in samples]).astype(np.int32)
    table = table.append_column("routed_experts", pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)))
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return len(buf.getvalue())


def _schema2_bytes(samples: list[Sample]) -> int:
    table = samples_to_table(samples)
    buf = io.BytesIO()
    pq.write_table(table, buf, **parquet_write_options(table))
    return len(buf.getvalue())


def _routed_sample(prompt_ids: np.ndarray, response_ids: np.ndarray, routing: np.ndarray, index: int) -> Sample:
    r = len(response_ids)
    return Sample(prompt_ids=prompt_ids, response_ids=response_ids, routed_experts=routing, index=index,
                  rollout_logprobs=-np.random.default_rng(index).random(r), token_versions=np.zeros(r, np.int32),
                  sample_id=f"s{index}", created_at=0.0)


def test_long_samples_keep_a_groups_prompt_routing_once(tmp_path: Path) -> None:
    # Uniform ids (7 bits each at 128 experts) leave only the repeated prompt rows to save. Schema 1 loses them once
    # a sample's routing outgrows zstd's window; schema 2 keeps them beside each other. Measured 0.91 here.
    rng = np.random.default_rng(10)
    prompt_ids, prompt_routing = rng.integers(0, 1000, 256), rng.integers(0, 128, (256, 48, 8))
    group = [
        _routed_sample(prompt_ids, rng.integers(0, 1000, 2048),
                       np.concatenate([prompt_routing, rng.integers(0, 128, (2047, 48, 8))]).astype(np.uint8), i)
        for i in range(8)
    ]
    assert _schema2_bytes(group) <= 0.95 * _schema1_bytes(group)


@pytest.mark.slow
def test_recorded_moe_routing_archives_smaller_than_schema1(tmp_path: Path) -> None:
    # Routing a real (tiny, 128 experts, top-8, 4 layers) Qwen3-MoE recorded for two groups of 8 sharing a prompt.
    # Its experts are skewed per layer, which byte-aligned ids let zstd see. Measured 0.78 of schema 1's bytes.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from pipeline.models.tiny import init_tiny_model
    from pipeline.producers.cpu_engine.routing import RoutingRecorder

    folder = init_tiny_model("qwen3-moe", tmp_path / "moe", num_experts=128, num_experts_per_tok=8,
                             num_hidden_layers=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = np.random.default_rng(11)
    samples: list[Sample] = []
    for _ in range(2):
        prompt = rng.integers(4, model.config.vocab_size, 128)
        ids = np.concatenate([np.tile(prompt, (8, 1)), rng.integers(4, model.config.vocab_size, (8, 768))], axis=1)
        recorder = RoutingRecorder(model)
        with torch.no_grad():
            model(input_ids=torch.tensor(ids[:, :-1]))
        routing = recorder.take(8, ids.shape[1] - 1).numpy().astype(np.uint8)
        recorder.close()
        assert all(np.array_equal(routing[i, :128], routing[0, :128]) for i in range(8))
        samples += [_routed_sample(prompt, ids[i, 128:], routing[i], len(samples) + i) for i in range(8)]
    assert _schema2_bytes(samples) <= 0.85 * _schema1_bytes(samples)


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
