"""The trainer's side of the weight push: ``WeightPusher``, rank 0 of the weight group (``pipeline.sync.weights``),
pushes named tensors to every engine bucket by bucket (buckets from ``pipeline.sync.packing`` through
``pipeline.sync.sources``), and the helpers that ask the engines what they hold and take.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from pipeline.errors import SyncError
from pipeline.sync.base import (
    DTYPE_ITEMSIZE,
    EngineReply,
    TensorMeta,
    WeightSource,
    WeightUpdateEngine,
    torch_dtype,
)
from pipeline.sync.lifecycle import Adoption, ManagedEngine, adopt_engines
from pipeline.sync.packing import FIRST_BUCKET_SHARE, FLAT_FORMAT, BucketPacker, BucketSlots, PackedBucket
from pipeline.sync.sources import Prepacked, Streamed, exhaust, is_packed
from pipeline.sync.sources_push import SourceReport, SourcesLead, failures
from pipeline.sync.threads import call_soon, run_in_thread
from pipeline.sync.weights import (
    DEFAULT_BUCKET_BYTES,
    MB,
    WeightGroup,
    bind_weight_store,
    init_weight_group,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True)
class PushStats:
    """What one weight push moved and how long it took (begin to end, HTTP included)."""

    weight_version: str
    tensors: int
    buckets: int
    bytes: int
    """Bytes on the wire: every tensor in the dtype it was announced in."""
    seconds: float
    peak_buffer_bytes: int = 0
    """The most bucket-buffer bytes rank 0 held at once (about two buckets for a streamed push)."""
    zero_copy_bytes: int = 0
    """Bytes sent straight from the tensors' own memory, never copied into a bucket (a streamed push's large
    tensors in the wire dtype)."""
    flush_refused: int = 0
    """Engines that kept their prefix cache after this push (SGLang flushes only a fully idle engine, and requests
    paused in place are pending). New requests still never reuse those prefixes: the engine clients key the cache
    by weight version (``SGLangClient``, ``extra_key``)."""

    @property
    def mb_per_s(self) -> float:
        """Throughput in MiB/s."""
        return self.bytes / MB / self.seconds if self.seconds > 0 else math.inf


DEFAULT_STALL_TIMEOUT_S = 120.0
"""How long a push may keep generation paused before it is abandoned: well inside SGLang's scheduler watchdog
(300 s), which kills a server paused for longer."""
_SETTLE_TIMEOUT_S = 10.0  # for the ends and continues that clean up after a failed push: none of them takes a lock


@dataclass(frozen=True)
class PushOptions:
    """How a ``WeightPusher`` packs and sends, the same for each of its pushes (see ``WeightPusher``)."""

    bucket_bytes: int | None = None
    """Bytes per bucket; None: the backend's default (``DEFAULT_BUCKET_BYTES``)."""
    dtype: str | None = None
    """The dtype floats go on the wire in (e.g. "bfloat16": half the bytes for an fp32 trainer); None: their own."""
    expected: Mapping[str, TensorMeta] | None = None
    """The engines' parameters: a tensor that does not fit them is refused before anything is sent."""
    flush_cache: bool = True
    flat: bool = True
    """One flat uint8 broadcast per bucket (SGLang's ``flattened_bucket``); False: one per tensor."""
    zero_copy: bool = True
    zero_copy_bytes: int | None = None
    """From how many bytes a tensor in the wire dtype is sent from its own memory (``BucketPacker``)."""
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.dtype is not None:
            torch_dtype(self.dtype)
        if self.stall_timeout_s <= 0:
            raise SyncError(f"stall_timeout_s must be positive, got {self.stall_timeout_s}")


class PushStalledError(SyncError):
    """A weight push did not finish within its stall timeout; the message names the step it was waiting for."""


_NOTHING_TO_PUSH = "a weight push needs at least one tensor; use /update_weight_version to only bump the version"

Weights = Iterable[tuple[str, torch.Tensor]] | Sequence[PackedBucket]
"""What a push sends: named tensors, packed as they arrive, or buckets packed before (``WeightPusher.pack``)."""


class WeightPusher:
    """Rank 0 of the weight group: pushes named tensors to every engine, bucket by bucket.

    Per push: ``/pause_generation`` (in place) on all engines, and once every engine confirmed its pause,
    ``/begin_weight_update`` on all (SGLang's begin takes the model-update writer lock unless the engine is already
    paused, and that lock waits for every in-flight generation, which a later in-place pause freezes); per bucket
    ``/update_weights_from_distributed`` to all engines concurrently with the bucket's broadcast (one flat uint8
    tensor, SGLang's ``flattened_bucket`` format, or one broadcast per tensor with ``flat=False``); then
    ``/end_weight_update``, a best-effort ``/flush_cache`` (an engine with requests paused in place refuses it;
    refusals are counted in ``PushStats.flush_refused``) and ``/continue_generation``. A push not finished
    ``stall_timeout_s`` after it began raises ``PushStalledError`` (well inside SGLang's 300 s scheduler watchdog,
    which kills a server paused for longer); see ``push`` for what the engines are left with then. The next
    bucket is cast and packed in a thread while the current one is on the wire, and at most two bucket buffers exist
    at once (``pipeline.sync.packing``). A streamed push sends a large tensor already in the wire dtype straight from
    its own memory (``zero_copy_bytes``, see ``BucketPacker``), so the named tensors must not change until ``push``
    returns; ``pack`` always copies. ``weight_version`` rides only on the last bucket, so an engine never labels
    tokens with the new version while it holds a mix of old and new weights.
    """

    def __init__(self, group: WeightGroup, engines: Sequence[WeightUpdateEngine],
                 options: PushOptions = PushOptions(), sources: SourcesLead | None = None) -> None:
        if group.rank != 0:
            raise SyncError(f"the pusher must be rank 0 of the weight group, this process is rank {group.rank}")
        if not engines:
            raise SyncError("WeightPusher needs at least one engine")
        self.group = group
        self.engines = list(engines)
        self.options = options
        self.bucket_bytes = options.bucket_bytes or DEFAULT_BUCKET_BYTES[group.backend]
        self.dtype = options.dtype
        self.expected = options.expected
        self.flush_cache = options.flush_cache
        self.flat = options.flat
        self.zero_copy = options.zero_copy
        self.zero_copy_bytes = options.zero_copy_bytes
        self.stall_timeout_s = options.stall_timeout_s
        self.flush_refused = 0
        """Refused flushes over every push of this pusher."""
        self.last_reports: list[SourceReport] = []
        """What each source sent in the last push from several sources (rank 0's own first)."""
        self._stage = "idle"  # what the push in progress waits for (named when it stalls)
        self._announced = False  # whether the push in progress announced a bucket: the engines' weights may differ
        self._buffers = BucketSlots(2, self.bucket_bytes, group.device)  # reused by every streamed push
        self._flushable: list[WeightUpdateEngine] | None = None  # asked once, at the first push's flush
        self._ordered: bool | None = None  # asked once, at the first push: may announcements run ahead of answers
        self.sources = sources
        """The other trainer ranks, each sending the tensors it owns (``pipeline.sync.sources_push``); None: this
        rank sends every tensor."""
        self._sources_joined = False  # whether the other sources joined groups with this pusher's engines
        self._logged_sources = False
        self._concurrent: bool | None = None  # asked once: may every source send at once, or do they take turns
        self.tp_sizes: list[int] = [1] * len(self.engines)
        """Each engine's TP size (ranks it takes in a weight group), as ``connect`` was given them."""

    @classmethod
    async def connect(
        cls,
        engines: Sequence[WeightUpdateEngine],
        *,
        master_address: str,
        master_port: int = 0,
        group_name: str = "sluice_weights",
        backend: str = "gloo",
        ranks_per_engine: Sequence[int] | None = None,
        timeout_s: float = 300.0,
        options: PushOptions = PushOptions(),
        sources: SourcesLead | None = None,
    ) -> WeightPusher:
        """Host the weight group and have every engine join it; ``ranks_per_engine`` is each engine's TP size."""
        ranks = list(ranks_per_engine) if ranks_per_engine is not None else [1] * len(engines)
        if len(ranks) != len(engines) or any(r < 1 for r in ranks):
            raise SyncError(f"ranks_per_engine needs one positive entry per engine, got {ranks} for {len(engines)}")
        world_size = 1 + sum(ranks)
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        store = None
        if master_port == 0:  # bound here and now, then announced: no port picked first and bound later
            store = bind_weight_store(world_size, timeout_s)
            master_port = int(store.port)
        hosting = run_in_thread(
            lambda: init_weight_group(master_address, master_port, 0, world_size, group_name, backend, timeout_s,
                                      store=store)
        )
        joins = [
            engine.init_weights_update_group(
                master_address=master_address,
                master_port=master_port,
                rank_offset=offset,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
            )
            for engine, offset in zip(engines, offsets)
        ]
        await _expect_success(engines, joins, "init_weights_update_group")
        group = await asyncio.wait_for(hosting, timeout_s)
        pusher = cls(group, engines, options, sources)
        pusher.tp_sizes = ranks
        return pusher

    @property
    def all(self) -> list[WeightUpdateEngine]:
        """The engines of this group: all there are (a rotation also holds engines out of its group)."""
        return list(self.engines)

    def counters(self) -> dict[str, float]:
        """Refused prefix-cache flushes over every push (a stall raises here: only a rotation retries and counts
        them)."""
        return {"flush_refused": float(self.flush_refused), **self.source_counters()}

    def source_counters(self) -> dict[str, float]:
        """Of the last push from several sources: how many sent, and the share of the bytes rank 0 sent."""
        total = sum(r.bytes for r in self.last_reports)
        if not total:
            return {}
        return {"sources": float(sum(1 for r in self.last_reports if r.bytes)),
                "rank0_share": self.last_reports[0].bytes / total}

    async def adopt(self, version: int, *, fresh: bool, model_path: str | None = None) -> list[Adoption]:
        """``adopt_engines`` over the engines that have its endpoints (all of them outside tests)."""
        managed: list[ManagedEngine] = [e for e in self.engines if hasattr(e, "update_weight_version")]  # type: ignore[misc]
        return await adopt_engines(managed, version=version, fresh=fresh, model_path=model_path)

    async def push_once(self, weights: WeightSource, weight_version: str | int) -> PushStats | None:
        """``push``, with a call that exports the weights taken as well; never None, as nothing here is rebuilt to
        try again (``EngineRotation.push_once`` is)."""
        return await self.push(weights() if callable(weights) else weights, weight_version)

    def packer(self) -> BucketPacker:
        """A packer for one streamed push: this pusher's bucket size (the first bucket a sixteenth of it), wire
        dtype, device, two reused buffers, and zero-copy for large tensors in the wire dtype."""
        self._buffers.reset()
        return BucketPacker(bucket_bytes=self.bucket_bytes, dtype=self.dtype, device=self.group.device,
                            expected=self.expected, buffers=self._buffers, zero_copy=self.zero_copy,
                            zero_copy_bytes=self.zero_copy_bytes,
                            first_bucket_bytes=self.bucket_bytes // FIRST_BUCKET_SHARE)

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[PackedBucket]:
        """Every weight cast and packed now, for a push later (a snapshot: the model in the wire dtype, copied, never
        aliasing the parameters)."""
        packer = BucketPacker(bucket_bytes=self.bucket_bytes, dtype=self.dtype, device=self.group.device,
                              expected=self.expected, slots=None)
        return packer.pack_all(named_tensors)

    async def push(self, weights: Weights, weight_version: str | int) -> PushStats:
        """Push every weight to every engine and set their version; raises SyncError naming the engine on failure.

        Named tensors are packed as they arrive (the iterable is always exhausted, even on failure: a trainer's
        exporter is a collective); large ones in the wire dtype are sent from their own memory, so nothing may write
        them until this returns. The first bucket is packed, so every check of its tensors has passed, before any
        engine is asked anything; a later tensor that fails a check fails the push after earlier buckets went out,
        and the engines keep the old version label until a whole push lands.

        A push that fails or stalls (``PushStalledError`` after ``stall_timeout_s``) closes the engines' update
        windows. If no bucket was announced yet, the engines still hold the old weights whole and continue
        generating under the old label; otherwise they may hold a mix, so they stay paused for the next push (the
        rotation's retry, or the restarted trainer's re-sync), which alone may continue them.
        """
        version = str(weight_version)
        if self.group.broken is not None:
            exhaust(weights)
            raise SyncError(
                f"weight group {self.group.group_name!r} is unusable ({self.group.broken}); "
                "close this pusher and connect a new one"
            )
        start = time.perf_counter()
        source = Prepacked(weights) if is_packed(weights) else Streamed(self.packer(), weights)  # type: ignore[arg-type]
        self._stage, self._announced = "the first bucket", False
        self.last_reports = []
        deadline = asyncio.timeout(self.stall_timeout_s)
        try:
            async with deadline:
                if self.sources is not None:
                    buckets, tensors, sent, refused = await self._push_from_sources(source, version)
                else:
                    buckets, tensors, sent, refused = await self._push(source, version)
        except TimeoutError as exc:
            if not deadline.expired():
                raise
            self.group.mark_broken(f"a weight push stalled waiting for {self._stage}")
            if self.sources is not None:
                # A collective of the control channel may still be in flight in its thread.
                self.sources.mark_broken(f"weight push {version} stalled waiting for {self._stage}")
            raise PushStalledError(
                f"weight push {version} did not finish within {self.stall_timeout_s:g}s: it was waiting for "
                f"{self._stage} ({', '.join(e.name for e in self.engines)}). The push was abandoned and the engines' "
                f"update windows closed; {self._left_as()}. sync.stall_timeout_s sets the limit; keep it under "
                "SGLang's --watchdog-timeout (300 s by default), which kills a server paused for longer."
            ) from exc
        finally:
            self._stage = "idle"
        self.flush_refused += refused
        return PushStats(weight_version=version, tensors=tensors, buckets=buckets, bytes=sent,
                         seconds=time.perf_counter() - start, peak_buffer_bytes=source.peak_buffer_bytes,
                         zero_copy_bytes=source.zero_copy_bytes, flush_refused=refused)

    def _left_as(self) -> str:
        return ("generation continues on the old weights" if not self._announced
                else "generation stays paused until a push lands, as some weights may have changed")

    async def _push(self, source: Streamed | Prepacked, version: str) -> tuple[int, int, int, int]:
        """The push itself: (buckets, tensors, bytes, refused flushes)."""
        buckets = tensors = sent = 0
        opened = paused = False
        try:
            # Paused in place for the whole push: requests keep their place and their KV cache, no forward pass
            # runs, so no token is computed from half-updated weights (docs/weight-push.md, "Generation across a
            # push").
            first = asyncio.ensure_future(source.next())
            if self._ordered:
                # Known from an earlier push: bucket 0's announcement pauses and opens each window itself.
                item = await first
                if item is None:
                    raise SyncError(_NOTHING_TO_PUSH)
                opened = paused = True
                buckets, tensors, sent = await self._push_ahead(source, item, version, begin=True)
                item = None
            else:
                # The pause and the packing of the first bucket go on together. The window opens only once every
                # engine confirmed its pause: an SGLang engine that is not yet paused takes the model-update writer
                # lock for the begin, which waits for every in-flight generation, and the pause arriving next would
                # freeze those generations for ever (a deadlock SGLang's watchdog ends by killing the server).
                self._stage = "every engine's /pause_generation"
                paused = True  # before the answers: an engine that paused is continued again if another refused
                pauses = [asyncio.ensure_future(e.pause_generation("in_place")) for e in self.engines]
                await asyncio.wait([first, *pauses])
                for task in pauses:
                    task.exception()  # seen, in case the first bucket raises before they are checked
                item = first.result()
                if item is None:
                    raise SyncError(_NOTHING_TO_PUSH)
                await _expect_success(self.engines, pauses, "pause_generation")
                self._stage = "every engine's /begin_weight_update"
                opened = True
                await _expect_success(self.engines, [e.begin_weight_update() for e in self.engines],
                                      "begin_weight_update")
                if self._ordered is None:
                    self._ordered = await _take_ordered_updates(self.engines)
                    self._flushable = await _with_prefix_cache(self.engines) if self.flush_cache else []
                if self._ordered:
                    buckets, tensors, sent = await self._push_ahead(source, item, version, begin=False)
                    item = None
            while item is not None:
                bucket, last = item
                self._stage = f"bucket {buckets} (its broadcast and every engine's load)"
                # No flush with the update: SGLang refuses to flush while requests are in flight, as they are in place.
                await self._push_bucket(bucket, version if last else None, False)
                buckets, tensors, sent = buckets + 1, tensors + len(bucket.metas), sent + bucket.nbytes
                bucket.release()
                source.sent()
                self._stage = f"bucket {buckets} to be packed"
                item = await source.next()
        except BaseException:
            await self._settle_failed(source, opened, paused)
            raise
        await source.abort()  # nothing left to stop; waits for the packing thread to end
        if not self._ordered:  # an engine that takes announcements in order had its end with the last one
            self._stage = "every engine's /end_weight_update"
            await _expect_success(self.engines, [e.end_weight_update() for e in self.engines], "end_weight_update")
        refused = 0
        if self.flush_cache:
            self._stage = "the prefix caches' /flush_cache"
            refused = await self._flush_prefix_caches(version)
        # Every engine has every weight and the new label: generation continues (an engine held since it was adopted,
        # sync.lifecycle, serves from here on too).
        if not self._continued_at_end():
            self._stage = "every engine's /continue_generation"
            await _expect_success(self.engines, [e.continue_generation() for e in self.engines], "continue_generation")
        return buckets, tensors, sent, refused

    async def send_share(self, weights: Weights, version: str) -> tuple[int, int, int]:
        """Send these tensors into an update window another rank opened (a source of a push from several,
        ``pipeline.sync.sources_push``): one announcement at a time on this pusher's own group, no version label,
        no pause, begin or end. Returns (buckets, tensors, bytes)."""
        if self.group.broken is not None:
            exhaust(weights)
            raise SyncError(f"weight group {self.group.group_name!r} is unusable ({self.group.broken})")
        source = Prepacked(weights) if is_packed(weights) else Streamed(self.packer(), weights)  # type: ignore[arg-type]
        try:
            return await self._send_buckets(source)
        finally:
            await source.abort()

    async def _send_buckets(self, source: Streamed | Prepacked) -> tuple[int, int, int]:
        """Every bucket of ``source``, one announcement at a time and unlabelled: (buckets, tensors, bytes)."""
        buckets = tensors = sent = 0
        item = await source.next()
        while item is not None:
            bucket, _last = item
            self._stage = f"bucket {buckets} (its broadcast and every engine's load)"
            await self._push_bucket(bucket, None, False)
            buckets, tensors, sent = buckets + 1, tensors + len(bucket.metas), sent + bucket.nbytes
            bucket.release()
            source.sent()
            item = await source.next()
        return buckets, tensors, sent

    async def _push_from_sources(self, source: Streamed | Prepacked, version: str) -> tuple[int, int, int, int]:
        """The push led from here, every trainer rank sending its own share (``pipeline.sync.sources_push``):
        (buckets, tensors, bytes, refused flushes), counting what this rank sent; ``last_reports`` has each
        source's. The version label moves only after every source has landed, with ``/update_weight_version`` on
        every engine, still paused; a source that failed leaves the label as it was and the engines paused."""
        assert self.sources is not None
        sources = self.sources
        opened = paused = False
        try:
            if not self._sources_joined:
                self._stage = "the other sources to join weight groups"
                await sources.connect([e.name for e in self.engines], self.tp_sizes, self.dtype)
                self._sources_joined = True
            if self._concurrent is None:
                self._concurrent = all(await _engines_say(self.engines, "concurrent_sources", False))
                self._flushable = await _with_prefix_cache(self.engines) if self.flush_cache else []
            self._stage = "every engine's /pause_generation"
            paused = True
            await _expect_success(self.engines, [e.pause_generation("in_place") for e in self.engines],
                                  "pause_generation")
            self._stage = "every engine's /begin_weight_update"
            opened = True
            await _expect_success(self.engines, [e.begin_weight_update() for e in self.engines], "begin_weight_update")
            self._announced = True  # from here the sources may announce: some weights may change
            self._stage = "every source's share"

            async def own() -> tuple[int, int, int]:
                return await self._send_buckets(source)

            if self._concurrent:
                reports = await sources.send(version, None, own)
            else:
                # SGLang receives one update at a time, and a broadcast needs every engine: sources take turns, or
                # two engines that took two sources' announcements in different orders would wait on each other.
                reports = await sources.send(version, 0, own)
                for rank in range(1, sources.others + 1):
                    if failures(reports) is not None:
                        break
                    turn = await sources.send(version, rank)
                    reports = [turn[r] if r == rank else reports[r] for r in range(len(turn))]
            self.last_reports = reports
            if not self._logged_sources:
                self._logged_sources = True
                log.info("weight push %s from %d sources (%s bytes each); the label moves once all have landed",
                         version, len(reports), [r.bytes for r in reports])
            failed = failures(reports)
            if failed is not None:
                self._sources_joined = False  # a failed source's group may be out of step: each joins afresh
                raise SyncError(f"weight push {version}: a source failed ({failed}); the engines keep the label "
                                f"they had, paused until a push lands whole")
        except BaseException:
            await self._settle_failed(source, opened, paused)
            raise
        await source.abort()
        self._stage = "every engine's /end_weight_update"
        await _expect_success(self.engines, [e.end_weight_update() for e in self.engines], "end_weight_update")
        self._stage = "every engine's /update_weight_version"
        await _expect_success(self.engines, [e.update_weight_version(version)  # type: ignore[attr-defined]
                                             for e in self.engines], "update_weight_version")
        refused = 0
        if self.flush_cache:
            self._stage = "the prefix caches' /flush_cache"
            refused = await self._flush_prefix_caches(version)
        self._stage = "every engine's /continue_generation"
        await _expect_success(self.engines, [e.continue_generation() for e in self.engines], "continue_generation")
        mine = reports[0]
        return mine.buckets, mine.tensors, mine.bytes, refused

    async def _settle_failed(self, source: Streamed | Prepacked, opened: bool, paused: bool) -> None:
        """After a failed or stalled push: stop the packer, close the engines' windows, and continue generation if
        no weight can have changed. Each call is bounded: the engines are paused, so none of them takes a lock, and
        an engine that does not answer is the rotation's to find."""
        await source.abort()
        if opened:
            await _settle(self.engines, "end_weight_update")
        if paused and not self._announced:
            # After the ends: an SGLang engine continued first would take its writer lock for the end, which waits
            # for every generation the continue set running.
            await _settle(self.engines, "continue_generation")

    def _continued_at_end(self) -> bool:
        """Whether ``/end_weight_update`` also continues generation: with one engine, which takes announcements in
        order, and no prefix cache to flush between the two, its end means every engine has the whole push."""
        return bool(self._ordered) and len(self.engines) == 1 and not self._flushable

    async def _flush_prefix_caches(self, version: str) -> int:
        """Drop cached prefixes computed by the old weights, where the engine can; returns how many refused. SGLang
        flushes only a fully idle engine, and requests paused in place are pending, so in an async run most flushes
        are refused; new requests still never reuse the old prefixes, which the engine clients keep apart by weight
        version (``extra_key``), and a refused flush only leaves them to the cache's eviction. An engine that says it
        keeps no prefix cache is not asked: a round trip per push, a twentieth of a 50 MB push on gloo."""
        if self._flushable is None:
            self._flushable = await _with_prefix_cache(self.engines)
        flushable = self._flushable
        replies = await asyncio.gather(*(e.flush_cache() for e in flushable), return_exceptions=True)  # type: ignore[attr-defined]
        refused = 0
        for engine, reply in zip(flushable, replies):
            if isinstance(reply, BaseException) or not reply.success:
                refused += 1
                # Shown once per pusher at INFO, then counted (PushStats.flush_refused, the trainer's metrics).
                level = logging.INFO if self.flush_refused + refused == 1 else logging.DEBUG
                log.log(level, "engine %s kept its prefix cache after push %s (%s); new requests are keyed to the "
                        "new version and do not reuse it. Refusals are counted in sync/flush_refused.",
                        engine.name, version, reply if isinstance(reply, BaseException) else reply.message)
        return refused

    async def close(self) -> None:
        """Have every engine leave the group, then tear down this end; a new ``connect`` may reuse the group name.

        A broken group's end here goes first: an engine may still wait in a broadcast that will never be sent (one
        engine died inside a push, and the others had posted their receives). Its leaving would wait for that
        receive, until the group's timeout (300 s), and the receive fails only once this end's connections close."""
        if self.group.broken is not None:
            await asyncio.to_thread(self.group.close)
        calls = [e.destroy_weights_update_group(self.group.group_name) for e in self.engines]
        try:
            await _expect_success(self.engines, calls, "destroy_weights_update_group")
        finally:
            self.group.close()

    def _announce(self, bucket: PackedBucket, weight_version: str | None, flush_cache: bool,
                  **order: Any) -> dict[asyncio.Future[Any], WeightUpdateEngine]:
        """Post the bucket's ``/update_weights_from_distributed`` to every engine; the reply futures, by engine."""
        metas = bucket.metas
        self._announced = True
        # A run of zero-copy tensors goes on the per-tensor wire whatever the pusher's format: one broadcast each,
        # from their own memory.
        extra: dict[str, Any] = {"load_format": FLAT_FORMAT} if self.flat and bucket.parts is None else {}
        return {
            asyncio.ensure_future(
                engine.update_weights_from_distributed(
                    names=[m.name for m in metas],
                    dtypes=[m.dtype for m in metas],
                    shapes=[list(m.shape) for m in metas],
                    group_name=self.group.group_name,
                    flush_cache=flush_cache,
                    weight_version=weight_version,
                    abort_all_requests=False,
                    **extra,
                    **order,
                )
            ): engine
            for engine in self.engines
        }

    async def _push_ahead(self, source: Streamed | Prepacked, item: tuple[PackedBucket, bool] | None,
                          version: str, begin: bool) -> tuple[int, int, int]:
        """Send every bucket, announcing each as soon as it is packed, and starting its broadcasts as soon as the
        bucket before has started its last one (its bytes still on the wire).

        Only for engines that take a window's announcements in the order of their ``bucket_index`` whatever order
        they arrive in (``ordered_updates``): each one then waits for its turn at the engine and starts receiving the
        moment the bucket before has started its last receive, instead of a round trip and two thread hops after
        its last byte, about 3 ms a bucket here (docs/weight-push.md). Broadcasts still start in announced order, at
        most ``BROADCAST_WINDOW`` in flight across buckets, and the packing thread still holds at most two buckets:
        one is given back only once its last broadcast is through on rank 0's side. With ``begin``, bucket 0's
        announcement pauses generation and opens the window (``begin_window``). ``/end_weight_update`` goes out
        with the last announcement, naming the push and its bucket count, so each engine closes its window as soon
        as the last bucket is in (and continues, ``_continued_at_end``). Returns (buckets, tensors, bytes) sent."""
        push_id = uuid.uuid4().hex
        replies: dict[asyncio.Future[Any], WeightUpdateEngine] = {}
        sendings: list[_Sending] = []
        ends: list[asyncio.Future[EngineReply]] = []
        upcoming: asyncio.Future[Any] | None = None
        buckets = tensors = sent = 0
        landed = False  # what went out before a packing error has landed: the group is still in step
        try:
            while item is not None:
                bucket, last = item
                opening = {"begin_window": True} if begin and buckets == 0 else {}
                replies.update(self._announce(bucket, version if last else None, False, bucket_index=buckets,
                                              push_id=push_id, **opening))
                buckets, tensors, sent = buckets + 1, tensors + len(bucket.metas), sent + bucket.nbytes
                if last:
                    continued = self._continued_at_end()
                    ends = [asyncio.ensure_future(e.end_weight_update(push_id=push_id, buckets=buckets,
                                                                      continue_generation=continued))
                            for e in self.engines]
                if sendings:
                    await _watching(sendings[-1].issued, replies)  # the group matches broadcasts by their order
                sendings.append(self._send(bucket, source))
                upcoming = asyncio.ensure_future(source.next())
                try:
                    item = await _watching(upcoming, replies)
                except BaseException as exc:
                    if upcoming.done() and not upcoming.cancelled() and upcoming.exception() is exc:
                        # A tensor the packer refused (the engines have not been told of it): the buckets on the
                        # wire are whole, so let them land, as the one-at-a-time push does, and keep the group.
                        for sending in sendings:
                            await _watching(sending.done, replies)
                        await _watching(None, replies)
                        landed = True
                    raise
            for sending in sendings:
                await _watching(sending.done, replies)
            await _watching(None, replies)
        except BaseException as exc:
            for task in [*replies, *ends, *([upcoming] if upcoming is not None else [])]:
                task.cancel()
            if not landed:
                self.group.mark_broken(f"a weight push failed mid-bucket: {exc}")
            # The error may be a sending's own, which would then hold this frame and so every sending's broadcasts:
            # a cycle that keeps the gloo communicator, and its connections to the engines, alive past close().
            sendings.clear()
            raise
        # Every bucket is in on every engine: what fails from here is a load, and the group is still in step.
        await _expect_success(self.engines, ends, "end_weight_update")
        return buckets, tensors, sent

    def _send(self, bucket: PackedBucket, source: Streamed | Prepacked) -> _Sending:
        """Broadcast one bucket from a thread; it goes back to ``source`` once its bytes are through here."""
        loop = asyncio.get_running_loop()
        issued: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if not issued.done():
                issued.set_result(None) if error is None else issued.set_exception(error)

        def send() -> None:
            try:
                works = self._issue_bucket(bucket)
            except BaseException as exc:
                call_soon(loop, settle, exc)
                raise
            call_soon(loop, settle, None)
            self.group.wait(works)

        def give_back(done: asyncio.Future[None]) -> None:
            # Only a bucket whose bytes are through: after a failure, a broadcast may still read it (the failed
            # push's buffers are dropped, BucketSlots.reset).
            if not done.cancelled() and done.exception() is None:
                bucket.release()
                source.sent()

        issued.add_done_callback(lambda f: f.cancelled() or f.exception())
        done = run_in_thread(send)
        done.add_done_callback(give_back)
        return _Sending(issued, done)

    async def _push_bucket(self, bucket: PackedBucket, weight_version: str | None, flush_cache: bool) -> None:
        posts = self._announce(bucket, weight_version, flush_cache)
        sending = run_in_thread(lambda: self._broadcast_bucket(bucket))
        pending: set[asyncio.Future[Any]] = set(posts) | {sending}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is sending:
                        task.result()
                    else:
                        _check_reply(posts[task], task, "update_weights_from_distributed")
        except BaseException as exc:
            for task in pending:
                task.cancel()
            # Whether or not our side of the broadcast finished (gloo sends small tensors eagerly, so it may have),
            # a peer that failed did not take this bucket: the members are out of step and the group must be rebuilt.
            self.group.mark_broken(f"a weight push failed mid-bucket: {exc}")
            raise

    def _broadcast_bucket(self, bucket: PackedBucket) -> None:
        self.group.wait(self._issue_bucket(bucket))

    def _issue_bucket(self, bucket: PackedBucket) -> list[Any]:
        # Every receiver allocates exactly the announced bytes; a broadcast of another size would abort it (SIGABRT
        # in gloo), so the sizes are checked here, before anything is sent.
        announced = sum(m.nbytes for m in bucket.metas)
        if bucket.nbytes != announced:
            raise SyncError(f"a bucket of {bucket.nbytes} bytes was announced as {announced}; nothing was sent")
        # A snapshot in host memory sent over a group that sends from the device (NCCL) goes up one bucket at a
        # time; the works hold their tensors until done, a copy included.
        device = self.group.device
        if self.flat and bucket.parts is None:
            return self.group.issue([bucket.flat.to(device)], src=0)
        return self.group.issue([tensor.contiguous().to(device) for _, tensor in bucket.tensors()], src=0)


@dataclass
class _Sending:
    """One bucket's broadcasts from rank 0: ``issued`` once the last one started, ``done`` once all are through."""

    issued: asyncio.Future[None]
    done: asyncio.Future[None]


async def engines_dtype(engines: Sequence[WeightUpdateEngine], fallback: str | None) -> str | None:
    """The dtype to send floats in: the one every engine holds its weights in (asked through ``weight_dtype`` where
    an engine has it), else ``fallback`` (the model's own). Engines that disagree get the widest, each casting on load.
    """
    asks = [e.weight_dtype() for e in engines if hasattr(e, "weight_dtype")]  # type: ignore[attr-defined]
    found = {d for d in await asyncio.gather(*asks) if d is not None}
    if len(found) > 1:
        widest = max(found, key=lambda d: DTYPE_ITEMSIZE[d])
        log.warning("the engines hold their weights in %s; the push sends %s, which each casts on load",
                    sorted(found), widest)
        return widest
    return found.pop() if found else fallback


async def engines_tp(engines: Sequence[WeightUpdateEngine]) -> list[int]:
    """Each engine's TP size (``tp_size`` where an engine has it, else 1): how many ranks it takes in the group."""

    async def tp(engine: WeightUpdateEngine) -> int:
        ask = getattr(engine, "tp_size", None)
        return int(await ask()) if ask is not None else 1

    return list(await asyncio.gather(*(tp(e) for e in engines)))


async def _with_prefix_cache(engines: Sequence[WeightUpdateEngine]) -> list[WeightUpdateEngine]:
    """The engines to flush after a push: those with ``flush_cache`` that do not say they keep no prefix cache (an
    engine that cannot be asked is flushed, as before: a flush too many costs a round trip, a stale cache more)."""
    keeps = await _engines_say(engines, "prefix_cache", True)
    return [e for e, keep in zip(engines, keeps) if keep and hasattr(e, "flush_cache")]


async def _take_ordered_updates(engines: Sequence[WeightUpdateEngine]) -> bool:
    """Whether every engine takes a window's announcements in ``bucket_index`` order (the CPU engine says
    ``ordered_updates`` in ``/model_info``; SGLang does not, and gets one announcement at a time, which is always
    correct)."""
    return all(await _engines_say(engines, "ordered_updates", False))


async def _engines_say(engines: Sequence[WeightUpdateEngine], question: str, default: bool) -> list[bool]:
    """Each engine's answer to an optional yes/no question (a method of that name), or ``default`` for an engine
    that lacks it or cannot answer."""

    async def says(engine: WeightUpdateEngine) -> bool:
        ask = getattr(engine, question, None)
        if ask is None:
            return default
        try:
            return bool(await ask())
        except Exception as exc:  # noqa: BLE001 - the default is the safe answer
            log.debug("engine %s did not answer %s (%s); taking %s", engine.name, question, exc, default)
            return default

    return list(await asyncio.gather(*(says(e) for e in engines)))


async def _watching(target: asyncio.Future[_T] | None, replies: dict[asyncio.Future[Any], WeightUpdateEngine]
                    ) -> _T | None:
    """Wait for ``target`` (with None: for every reply); every reply that comes in meanwhile is checked (a refusal
    raises at once) and dropped from ``replies``."""
    while True:
        pending: set[asyncio.Future[Any]] = set(replies)
        if target is not None:
            pending.add(target)
        if not pending:
            return None
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not target:
                _check_reply(replies.pop(task), task, "update_weights_from_distributed")
        if target is not None and target in done:
            return target.result()


async def _settle(engines: Sequence[WeightUpdateEngine], endpoint: str) -> None:
    """``endpoint`` on every engine, each answer or failure ignored, all within ``_SETTLE_TIMEOUT_S``: clean-up after a
    failed push, whose own error is what the caller raises."""
    calls = asyncio.gather(*(getattr(e, endpoint)() for e in engines), return_exceptions=True)
    try:
        await asyncio.wait_for(asyncio.shield(calls), _SETTLE_TIMEOUT_S)
    except TimeoutError:
        log.warning("engines did not answer /%s within %gs after a failed weight push", endpoint, _SETTLE_TIMEOUT_S)


def _check_reply(engine: WeightUpdateEngine, task: asyncio.Future[Any], endpoint: str) -> None:
    try:
        reply: EngineReply = task.result()
    except SyncError:
        raise
    except Exception as exc:
        raise SyncError(f"engine {engine.name} failed {endpoint}: {exc}") from exc
    if not reply.success:
        raise SyncError(f"engine {engine.name} refused {endpoint}: {reply.message}")


async def _expect_success(
    engines: Sequence[WeightUpdateEngine], calls: Sequence[Any], endpoint: str
) -> None:
    tasks = [asyncio.ensure_future(call) for call in calls]
    if not tasks:
        return
    await asyncio.wait(tasks)
    for task in tasks:
        # Marks each failure as seen: once the first one raises below, the others would otherwise be reported by
        # the garbage collector, at a moment of its choosing (it once broke a compile that was running then).
        task.exception()
    for engine, task in zip(engines, tasks):
        _check_reply(engine, task, endpoint)
