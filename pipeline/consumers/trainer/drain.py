"""Draining the ``trainer`` group: recovery against the ledger, then batches of prompt groups under the staleness
policy and the group filters. Only the trainer's rank 0 reads the stream, and it decides from headers alone: the
payloads are fetched by the data-parallel readers, each its own share (``pipeline.consumers.trainer.readers``).

Nothing is acked here. Every entry a batch consumed (trained, stale, invalid or filtered) stays pending until the
checkpoint that holds its effect is committed; the trainer acks it then (docs/architecture.md, "Exactly-once effect").

Pacing slots are given back here, though, at drain time: a group that will not be trained (stale, invalid, filtered
or requeued) releases the slot its producer took, so producers can start a replacement now rather than at the next
commit (docs/queue.md, "Pacing slots"). The release deletes the group's slot record in the same script, which makes it
idempotent: a restarted trainer that decides a pending entry again finds no record and releases nothing twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.config.filters import FilterConfig
from pipeline.config.staleness import StalenessConfig
from pipeline.consumers.trainer.filters import FilterCounts, FilterVerdict, GroupFilters
from pipeline.consumers.trainer.ledger import Ledger, LedgerLine
from pipeline.consumers.trainer.staleness import (
    LINEAR,
    GroupDecision,
    GroupVersions,
    Lineage,
    StalenessCounts,
    decide_group,
)
from pipeline.queue.base import HeaderEntry, SampleHeader
from pipeline.queue.keys import parse_slot_item
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import Sample, SampleStatus

log = logging.getLogger(__name__)

#: Outcomes a sample can carry and still be trained on.
TRAINABLE = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)

# Give back the pacing slots of groups that will not be trained; for a requeued one, put its prompt back where
# producers take it first, with its requeue count raised. A group's record is in group_slots, or still in its
# producer's in-flight hash when the drain read the entry before the producer moved it (the put comes first). Whoever
# deletes the record releases the slot, so it is released once: the producer records nothing more, and a restart or
# a peer finds nothing to hand back. A group without a record (released already, or put by something other than a
# producer) changes nothing.
# KEYS: group_slots, groups_started, prompt_retry, then the in-flight hash of each group's producer;
# ARGV: group_id, mode ('release' | 'requeue') per group. Returns per group: 0 no record, 1 released, 2 requeued.
_RELEASE = """
local out = {}
for g = 1, #ARGV / 2 do
  local gid, mode = ARGV[2 * g - 1], ARGV[2 * g]
  local where = KEYS[1]
  local item = redis.call('HGET', where, gid)
  if not item then
    where = KEYS[3 + g]
    item = redis.call('HGET', where, gid)
  end
  if item then
    redis.call('HDEL', where, gid)
    redis.call('DECR', KEYS[2])
    if mode == 'requeue' then
      local index, n = string.match(item, '^(%d+):?(%d*)$')
      redis.call('RPUSH', KEYS[3], index .. ':' .. ((tonumber(n) or 0) + 1))
      out[#out + 1] = 2
    else
      out[#out + 1] = 1
    end
  else
    out[#out + 1] = 0
  end
end
return out
"""

Verdict = Literal["trained", "stale", "invalid", "filtered"]

#: A group as the drain judges it: headers (a live drain), or whole samples (replay, and user filters' groups).
Group = Sequence[Sample] | Sequence[SampleHeader]


def trainable(s: Sample | SampleHeader) -> bool:
    """Whether a sample can be trained on. The others of a trained group still reach the train step, which counts
    their rewards in the group's statistics and trains none of their tokens."""
    return s.status in TRAINABLE and s.num_response_tokens > 0


@dataclass(frozen=True)
class Judgement:
    """What the trainer does with one drained group, and why (:func:`judge_group`)."""

    fate: Verdict
    valid: list[Any]
    """The trainable samples (or their headers)."""
    invalid: list[Any]
    decision: GroupDecision | None  # None when no sample was trainable
    filtered_by: str | None = None
    weight: float = 1.0
    """The group filters' weight of a trained group: it scales the group's part of the loss."""

    @property
    def requeue(self) -> bool:
        """Whether the prompt goes back to the producers."""
        return self.decision is not None and self.decision.action == "requeue"


def judge_group(
    samples: Group,
    current: int,
    staleness: StalenessConfig,
    filters: GroupFilters | None = None,
    requeues: Callable[[str], int] = lambda group_id: 0,
    lineage: Lineage = LINEAR,
) -> Judgement:
    """Invalid samples out, then the staleness policy, then the filters: the live drain and replay both use this.

    ``requeues(group_id)`` is asked only for a group the policy would requeue, so the common path costs nothing.
    ``lineage``: which weights each version holds, once a trainer restored a checkpoint (lags are then distances
    along it).
    """
    valid: list[Any] = []
    invalid: list[Any] = []
    for s in samples:
        (valid if trainable(s) else invalid).append(s)
    if not valid:
        return Judgement("invalid", valid, invalid, None)
    decision = decide_group(GroupVersions.from_samples(valid), current, staleness, lineage)
    if decision.action == "requeue":
        n = requeues(valid[0].group_id)
        if n:
            decision = decide_group(GroupVersions.from_samples(valid, requeues=n), current, staleness, lineage)
    if decision.action != "train":
        return Judgement("stale", valid, invalid, decision)
    verdict = filters.weigh(valid) if filters is not None else FilterVerdict(None)
    if verdict.dropped_by is not None:
        return Judgement("filtered", valid, invalid, decision, verdict.dropped_by)
    return Judgement("trained", valid, invalid, decision, weight=verdict.weight)


def load_lineage(queue: SampleQueue) -> Lineage:
    """The run's version lineage: the restores its trainers recorded (one small hash, read once per drain read)."""
    raw = queue.redis.hgetall(queue.keys.lineage)
    return Lineage({int(k): int(v) for k, v in raw.items()}) if raw else LINEAR


def record_restore(queue: SampleQueue, version: int, base: int) -> None:
    """Record that ``version``, the first push after a trainer restored a checkpoint, holds ``base``'s weights.

    Written before that push, so no sample of ``version`` can be judged without it. A trainer that fails before the
    push and resumes again pushes the same version number and overwrites the record with its own base.
    """
    if not 0 <= base < version:
        # The checkpoint is newer than the counter (a Redis that lost it): nothing was abandoned to judge against.
        log.warning("not recording restore %d -> %d: a restore holds an older version's weights", version, base)
        return
    queue.redis.hset(queue.keys.lineage, str(version), str(base))
    queue.log_event("restore", version=version, base=base)


# Spend the slots a capped step left unused, once per step: the budget grows by batch_groups per push, so a step that
# trains fewer groups would otherwise leave the difference to producers for good, and pacing would drift out of
# bounds (in sync mode every surplus group finishes a version late and is dropped). Keyed by the step, so a restarted
# trainer that redoes a capped step spends nothing twice. KEYS: slots_burned, groups_started; ARGV: step, count.
_BURN = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('INCRBY', KEYS[2], ARGV[2])
  return 1
end
return 0
"""


@dataclass
class SlotCounts:
    """Pacing slots a batch gave back (on ``Batch.slots``)."""

    released: int = 0  # groups that will not be trained, whose slots went back to the producers
    requeued: int = 0  # among them: prompts put back for another generation
    requeue_unknown: int = 0  # requeues whose group had no slot record, so no prompt index to put back
    burned: int = 0  # slots a capped step left unused and spent, so that producers stay within the budget
    lost: int = 0  # trained groups whose payload a reader could not have: dead-lettered, prompt handed back

    def as_metrics(self, prefix: str = "pacing/") -> dict[str, float]:
        """The counts as ``pacing/`` metrics."""
        return {f"{prefix}slots_released": float(self.released), f"{prefix}prompts_requeued": float(self.requeued),
                f"{prefix}requeue_unknown": float(self.requeue_unknown), f"{prefix}slots_burned": float(self.burned),
                f"{prefix}payloads_lost": float(self.lost)}


@dataclass
class Batch:
    """One step's worth of prompt groups, and everything the drain decided on the way."""

    groups: list[list[Any]] = field(default_factory=list)
    """The trained groups' trainable samples: headers on rank 0 of a live drain, whole samples otherwise."""
    group_weights: list[float] = field(default_factory=list)
    """The group filters' weight of each group (1 = as is); empty means all 1."""
    invalid: list[list[Any]] = field(default_factory=list)
    """Each trained group's samples that cannot be trained (failed, aborted, empty): not trained, but their rewards
    count in the group's statistics; empty where none were recorded."""
    group_entries: list[str] = field(default_factory=list)
    sources: list[HeaderEntry | None] = field(default_factory=list)
    """Each trained group's stream entry as read (where its payload lies); None where ``groups`` holds the samples."""
    decisions: list[GroupDecision] = field(default_factory=list)
    lines: list[LedgerLine] = field(default_factory=list)  # stale, invalid and filtered fates, decided at drain time
    consumed: list[str] = field(default_factory=list)  # every entry id taken this step, to ack at the commit
    counts: StalenessCounts = field(default_factory=StalenessCounts)
    lags: list[int] = field(default_factory=list)
    filters: FilterCounts = field(default_factory=FilterCounts)
    slots: SlotCounts = field(default_factory=SlotCounts)
    sampled_rewards: list[float] = field(default_factory=list)
    """Rewards of every trainable sample of the groups trained or filtered: what the policy scores when sampled.
    The trained groups alone overstate it under dynamic sampling, which keeps exactly the informative ones."""

    def add(self, entry_id: str, judged: Judgement, step: int, current: int,
            source: HeaderEntry | None = None) -> None:
        """Take one drained group into the batch: trained, or its samples' fates for the ledger. ``source``: the
        entry whose payload a reader fetches, when ``judged`` was made from its headers."""
        self.consumed.append(entry_id)
        self.lines += [LedgerLine(s.sample_id, entry_id, "invalid", step, current) for s in judged.invalid]
        if judged.decision is None:
            return
        if judged.fate in ("trained", "filtered"):
            self.sampled_rewards += [s.reward for s in judged.valid]
        if judged.fate == "filtered":
            # Counted under filter/ only: staleness/groups_train stays the number of groups actually trained.
            assert judged.filtered_by is not None
            self.filters.record(judged.filtered_by, len(judged.valid))
        else:
            self.counts.record(judged.decision)
            self.lags.append(judged.decision.lag)
        if judged.fate == "trained":
            self.filters.record_kept(judged.weight)
            # Padded with 1s for groups added without a judgement (tests, replays built by hand).
            self.group_weights += [1.0] * (len(self.groups) - len(self.group_weights)) + [judged.weight]
            self.groups.append(judged.valid)
            self.invalid += [[] for _ in range(len(self.groups) - 1 - len(self.invalid))] + [judged.invalid]
            self.group_entries.append(entry_id)
            self.sources += [None] * (len(self.groups) - 1 - len(self.sources)) + [source]
            self.decisions += [judged.decision]
            return
        self.lines += [LedgerLine(s.sample_id, entry_id, judged.fate, step, current) for s in judged.valid]

    def extend(self, more: Batch) -> None:
        """Append another draw of the same step (replacements for groups whose payloads were lost)."""
        pad = len(self.groups)
        self.group_weights += [1.0] * (pad - len(self.group_weights)) + more.group_weights
        self.sources += [None] * (pad - len(self.sources)) + more.sources
        self.invalid += [[] for _ in range(pad - len(self.invalid))] + more.invalid
        self.groups += more.groups
        self.group_entries += more.group_entries
        self.decisions += more.decisions
        self.lines += more.lines
        self.consumed += more.consumed
        self.counts += more.counts
        self.lags += more.lags
        self.filters += more.filters
        self.sampled_rewards += more.sampled_rewards
        for f in ("released", "requeued", "requeue_unknown", "burned", "lost"):
            setattr(self.slots, f, getattr(self.slots, f) + getattr(more.slots, f))

    def untrained(self, index: int) -> list[Any]:
        """Trained group ``index``'s samples that are not trained (see ``invalid``)."""
        return self.invalid[index] if index < len(self.invalid) else []

    def source(self, index: int) -> HeaderEntry | None:
        """The entry trained group ``index`` was judged from, if it was judged from headers."""
        return self.sources[index] if index < len(self.sources) else None

    def tokens(self, index: int) -> int:
        """Prompt and response tokens of trained group ``index``: what a data-parallel share is balanced by."""
        return sum(s.num_prompt_tokens + s.num_response_tokens for s in self.groups[index])

    def take_out(self, index: int) -> str:
        """Remove trained group ``index`` (its payload was lost, so it was dead-lettered and acked instead), undoing
        what ``add`` counted for it; returns its entry id."""
        entry_id = self.group_entries.pop(index)
        group = self.groups.pop(index)
        weight = self.group_weights.pop(index) if index < len(self.group_weights) else 1.0
        if index < len(self.invalid):
            self.invalid.pop(index)
        if index < len(self.sources):
            self.sources.pop(index)
        if index < len(self.decisions):
            decision = self.decisions.pop(index)
            self.counts.forget(decision)
            self.lags.remove(decision.lag)
        self.filters.forget_kept(weight)
        self.consumed.remove(entry_id)
        for s in group:
            self.sampled_rewards.remove(s.reward)
        self.slots.lost += 1
        return entry_id

    def weights(self) -> list[float] | None:
        """One weight per group, or None when no group was reweighted (the train step then weighs none)."""
        weights = self.group_weights + [1.0] * (len(self.groups) - len(self.group_weights))
        return weights if any(w != 1.0 for w in weights) else None

    def drain_metrics(self) -> dict[str, float]:
        """Filter and pacing-slot counters of this batch, for the step's metrics line."""
        return {**self.filters.as_metrics(), **self.slots.as_metrics()}


@dataclass(frozen=True)
class Recovery:
    """What a restarted trainer found pending."""

    already_committed: int  # entries whose every sample is in the committed ledger: acked, not trained again
    to_redo: int  # entries re-read or claimed, to be trained (again)


class Drainer:
    """Reads the trainer group for one trainer process (one consumer name, stable across restarts)."""

    def __init__(
        self,
        queue: SampleQueue,
        ledger: Ledger,
        staleness: StalenessConfig,
        *,
        filters: GroupFilters | FilterConfig | None = None,
        group: str = "trainer",
        consumer: str = "trainer-0",
        block_ms: int = 1000,
        claim_idle_ms: int = 60_000,
        warn_filtered: int = 1000,
        min_groups: int = 1,
    ) -> None:
        self.queue, self.ledger, self.staleness = queue, ledger, staleness
        self.filters = GroupFilters(filters) if isinstance(filters, FilterConfig) else filters
        self.min_groups = min_groups  # a capped draw keeps at least this many groups (one per data-parallel rank)
        self.group, self.consumer = group, consumer
        self.block_ms, self.claim_idle_ms = block_ms, claim_idle_ms
        self.warn_filtered = warn_filtered
        self._backlog: list[HeaderEntry] = []
        self._release = queue.redis.register_script(_RELEASE)
        self._burn = queue.redis.register_script(_BURN)
        self._restores_burned: set[int] = set()
        # Consumed entry id -> (group id, producer): at the ack, the slot records of trained groups are forgotten.
        self._entry_groups: dict[str, tuple[str, str]] = {}
        # Sample ids of the entries drained and not yet acked: a second entry with the same samples (a put that
        # redis-py re-sent after Redis died before answering it) is not drained twice.
        self._held_samples: dict[str, tuple[str, ...]] = {}

    def recover(self) -> Recovery:
        """Re-read this consumer's pending entries and claim dead trainers', acking those already committed."""
        self.queue.create_group(self.group, "0")
        pending = self.queue.read_pending_headers(self.group, self.consumer)
        pending += self.queue.claim_stale_headers(self.group, self.consumer, self.claim_idle_ms)
        done = [e for e in pending if all(self.ledger.is_committed(h.sample_id) for h in e.headers)]
        for e in done:
            self._entry_groups[e.id] = (e.group_id, e.producer)
        self._ack([e.id for e in done])
        done_set = {e.id for e in done}
        self._backlog = [e for e in pending if e.id not in done_set]
        if pending:
            log.info("trainer recovery: %d pending entries already committed (acked), %d to train again",
                     len(done), len(self._backlog))
        return Recovery(already_committed=len(done), to_redo=len(self._backlog))

    def ack(self, entry_ids: list[str]) -> None:
        """Acknowledge entries whose effect a commit now holds (and any committed leftovers: ``ack_leftovers``)."""
        self._ack(entry_ids)
        self.ack_leftovers()

    def _ack(self, entry_ids: list[str]) -> None:
        """Acknowledge entries whose effect a commit now holds, and forget their groups' slot records.

        A trained group keeps its slot for good (the version it advanced paid for it), so only its record goes: from
        group_slots, or from its producer's in-flight hash if that producer died between its put and moving the record
        (a restart then has nothing to hand back, and the prompt is not generated twice). All in one MULTI: acked but
        still recorded would leave a record no drain ever sees again.
        """
        if not entry_ids:
            return
        by_producer: dict[str, list[str]] = {}
        for e in entry_ids:
            group_id, producer = self._entry_groups.pop(e, ("", ""))
            self._held_samples.pop(e, None)
            if group_id:
                by_producer.setdefault(producer, []).append(group_id)
        pipe = self.queue.redis.pipeline(transaction=True)
        for producer, group_ids in by_producer.items():
            pipe.hdel(self.queue.keys.group_slots, *group_ids)
            pipe.hdel(self.queue.keys.producer_inflight(producer), *group_ids)
        pipe.xack(self.queue.keys.samples, self.group, *entry_ids)
        pipe.execute()

    def next_batch(self, batch_groups: int, step: int, version: Callable[[], int],
                   should_stop: Callable[[], bool] = lambda: False) -> Batch:
        """Read until ``batch_groups`` groups pass the staleness policy and the filters (or ``should_stop``, or the
        filters' draw cap once ``min_groups`` are kept)."""
        batch = Batch()
        self._burn_restores(batch_groups, batch)
        warned_at = self.warn_filtered
        while len(batch.groups) < batch_groups and not should_stop():
            if self.filters is not None and self.filters.drawn_enough(len(batch.groups), batch.filters.groups,
                                                                      batch_groups, self.min_groups):
                batch.filters.capped = 1
                break
            want = batch_groups - len(batch.groups)
            if self._backlog:
                entries, self._backlog = self._backlog[:want], self._backlog[want:]
            else:
                entries = self._first_deliveries(
                    self.queue.read_headers(self.group, self.consumer, count=want, block_ms=self.block_ms))
            current = version()
            lineage = load_lineage(self.queue)
            whole = self._samples_for_filters(entries)
            releases: list[tuple[str, str, bool]] = []
            for entry in entries:
                group: Group = entry.headers
                if whole is not None:
                    if entry.id not in whole:
                        continue  # its payload is lost: dead-lettered, and its prompt handed back
                    group = whole[entry.id]
                judged = judge_group(group, current, self.staleness, self.filters,
                                     lambda group_id, p=entry.producer: self._requeues(group_id, p), lineage)
                batch.add(entry.id, judged, step, current, source=entry)
                self._entry_groups[entry.id] = (entry.group_id, entry.producer)
                self._held_samples[entry.id] = tuple(h.sample_id for h in entry.headers)
                if judged.fate != "trained":
                    releases.append((entry.group_id, entry.producer, judged.requeue))
            self._give_back(releases, batch.slots)
            if batch.filters.groups >= warned_at:
                warned_at *= 2
                log.warning("step %d: group filters removed %d groups and kept %d of %d; is every group alike "
                            "(a collapsed policy, or a reward that cannot tell answers apart)?", step,
                            batch.filters.groups, len(batch.groups), batch_groups)
        if batch.filters.capped and len(batch.groups) < batch_groups:
            unused = batch_groups - len(batch.groups)
            keys = [self.queue.keys.slots_burned, self.queue.keys.groups_started]
            batch.slots.burned += unused * int(self._burn(keys=keys, args=[step, unused]))
        return batch

    def _samples_for_filters(self, entries: list[HeaderEntry]) -> dict[str, list[Sample]] | None:
        """The whole samples of ``entries``, by entry id, when a user filter must see them (it is handed samples,
        tokens and all); None when headers are enough. Rank 0 then fetches these payloads once for the filters, and
        the readers fetch the kept ones again. An entry whose payload is lost is dead-lettered here."""
        if self.filters is None or not self.filters.user or not entries:
            return None
        return {e.id: e.samples for e in self.queue.materialize(self.group, self.consumer, entries)}

    def lose(self, batch: Batch, lost: Sequence[tuple[int, str]]) -> None:
        """Trained groups of ``batch`` whose payloads its readers could not have (group index, reason): each is
        dead-lettered with its reason and the payload as it is now (if any), and its prompt handed back. The caller
        takes them out of the batch (``Batch.take_out``) once the step's plan is settled, and draws replacements."""
        entries: list[tuple[HeaderEntry, str]] = []
        for index, reason in lost:
            entry = batch.source(index)
            if entry is None:
                raise RuntimeError(f"group {index} of the batch was shipped whole, yet a reader could not decode it: "
                                   f"{reason}")
            entries.append((entry, reason))
        keys = [e.payload_key for e, _ in entries if e.payload_key is not None]
        now = self.queue.fetch_payloads(keys) if keys else {}
        self.queue.lose_payloads(self.group, self.consumer,
                                 [(e, reason, now.get(e.payload_key or "")) for e, reason in entries])
        for entry, _ in entries:
            self._entry_groups.pop(entry.id, None)
            self._held_samples.pop(entry.id, None)

    def _burn_restores(self, batch_groups: int, batch: Batch) -> None:
        """Spend the slots a restore added to the pacing budget, once per restore (docs/queue.md, "Pacing slots").

        The budget is ``(policy_version + max_lag + 1) * batch_groups``, and a restore ``J -> B`` raised the counter
        by ``J - B`` with no trained batch to pay for it: the pushes of the abandoned steps (whose groups are trained
        again, keeping their slots) and the resync push. Left in the budget, those slots let producers run that many
        batches further ahead for the rest of the run, and the surplus is dropped as stale again and again (the fault
        harness measured 32-848 stale samples, median 316, per rolled-back trial of 768 trained; 0 without a fault).
        Keyed by ``J`` in ``slots_burned``, so a restarted trainer spends nothing twice."""
        for start, base in load_lineage(self.queue).restores.items():
            if start in self._restores_burned:
                continue
            count = (start - base) * batch_groups
            keys = [self.queue.keys.slots_burned, self.queue.keys.groups_started]
            batch.slots.burned += count * int(self._burn(keys=keys, args=[f"restore:{start}", count]))
            self._restores_burned.add(start)

    def _first_deliveries(self, entries: list[HeaderEntry]) -> list[HeaderEntry]:
        """The entries this trainer has not drained before, and whose samples it has not drained in another entry.

        When Redis dies (docs/faults.md, "Durability") two things can bring samples back. A server that lost its
        last writes delivers again entries whose delivery it lost. And redis-py re-sends a command whose answer it
        did not get, so a producer's put that Redis applied just before it died is applied twice: a second entry
        with the same samples. An entry held for an uncommitted step, or a copy of one, is skipped: the commit acks
        the original, and ``ack_leftovers`` then the copy. One whose samples the ledger committed is acked without
        training, as a recovery would. Training either would count its samples twice.
        """
        held = {sid for ids in self._held_samples.values() for sid in ids}
        fresh, committed = [], []
        for e in entries:
            ids = [h.sample_id for h in e.headers]
            if e.id in self._entry_groups or all(sid in held for sid in ids):
                log.warning("entry %s holds samples already drained for a step not yet committed (did Redis die "
                            "before it answered?); not drained twice", e.id)
            elif all(self.ledger.is_committed(sid) for sid in ids):
                committed.append(e)
            else:
                fresh.append(e)
        if committed:
            log.warning("%d entries hold samples already committed (did Redis die before it answered?); acked "
                        "without training", len(committed))
            for e in committed:
                self._entry_groups[e.id] = (e.group_id, e.producer)
            self._ack([e.id for e in committed])
        return fresh

    def ack_leftovers(self) -> int:
        """Settle the entries pending for this trainer that it does not hold; returns how many.

        Each is one of two things, both left by a Redis that died mid-command (AOF keeps a prefix of the writes):
        - committed: a commit's XACK was lost, or it is a copy of an entry a commit acked. It is acked now; nothing
          else would ack it before a trainer restart, and it would hold back trimming for good.
        - not committed: a read whose answer was lost (Redis delivered it, redis-py re-sent the read and got the
          next entries). It goes to the backlog and is drained like any pending entry, unless it copies samples
          this trainer holds, in which case a later call acks it once their commit lands.
        """
        held = set(self._entry_groups) | {e.id for e in self._backlog}
        stale = [i for i in self.queue.pending_ids(self.group, self.consumer) if i not in held]
        held_samples = {sid for ids in self._held_samples.values() for sid in ids}
        done, found = [], []
        for entry_id in stale:
            for eid, entry in self.queue.scan_headers(entry_id, entry_id):
                if not isinstance(entry, HeaderEntry):
                    continue
                ids = [h.sample_id for h in entry.headers]
                if all(self.ledger.is_committed(sid) for sid in ids):
                    self._entry_groups[eid] = (entry.group_id, entry.producer)
                    done.append(eid)
                elif not all(sid in held_samples for sid in ids):
                    found.append(entry)
        if done:
            log.warning("%d committed entries were pending again (did Redis lose an XACK, or apply a put twice?); "
                        "acked now", len(done))
            self._ack(done)
        if found:
            log.warning("%d entries were delivered to this trainer without it seeing them (did Redis die before "
                        "answering a read?); draining them now", len(found))
            self._backlog += found
        return len(done) + len(found)

    def _requeues(self, group_id: str, producer: str) -> int:
        pipe = self.queue.redis.pipeline(transaction=False)
        pipe.hget(self.queue.keys.group_slots, group_id)
        pipe.hget(self.queue.keys.producer_inflight(producer), group_id)
        item = next((x for x in pipe.execute() if x is not None), None)
        return 0 if item is None else parse_slot_item(item)[1]

    def _give_back(self, releases: list[tuple[str, str, bool]], counts: SlotCounts) -> None:
        if not releases:
            return
        args: list[Any] = []
        for group_id, _, requeue in releases:
            args += [group_id, "requeue" if requeue else "release"]
        keys = self.queue.keys
        inflight = [keys.producer_inflight(producer) for _, producer, _ in releases]
        results = self._release(keys=[keys.group_slots, keys.groups_started, keys.prompt_retry, *inflight],
                                args=args)
        for (group_id, _, requeue), r in zip(releases, results, strict=True):
            counts.released += int(r > 0)
            counts.requeued += int(r == 2)
            if requeue and r == 0:
                counts.requeue_unknown += 1
                log.warning("group %s is to be requeued but has no pacing-slot record (put by something other than "
                            "a producer, already released, or its producer died between its put and its record, "
                            "which hands the prompt back anyway); it is dropped instead", group_id)
