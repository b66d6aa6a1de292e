"""The trainer's side of ``sluice queue audit``: every sample's fate from the committed ledger, checked against the
stream. Exactly-once shows as 0 duplicates (a sample id with two fates) and 0 lost (a sample the trainer group acked
that no committed ledger line accounts for)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.consumers.trainer.ledger import read_ledger
from pipeline.errors import SampleDecodeError
from pipeline.queue.archive import parse_id
from pipeline.queue.redis_streams import SampleQueue
from pipeline.rundir import latest_checkpoint, ledger_dir


@dataclass
class TrainerAudit:
    """Fates of the run's samples in the trainer, as of its last committed checkpoint."""

    committed_step: int
    produced: int  # samples in the stream (trimmed entries were acked by every group, so trained or judged)
    trained: int
    stale: int
    invalid: int
    filtered: int  # removed by a group filter (pipeline.consumers.trainer.filters)
    pending: int  # delivered to the trainer, not yet committed
    undelivered: int
    duplicates: int
    lost: int
    lost_ids: list[str] = field(default_factory=list)


def audit_trainer(queue: SampleQueue, run_dir: Path, group: str = "trainer") -> TrainerAudit:
    latest = latest_checkpoint(run_dir)
    step = int(latest.name.split("-")[1]) if latest is not None else -1
    fates: Counter[str] = Counter()
    seen: Counter[str] = Counter()
    for line in read_ledger(ledger_dir(run_dir), upto_step=step):
        fates[line.fate] += 1
        seen[line.sample_id] += 1
    groups = {g.name: g for g in queue.stats().groups}
    last = parse_id(groups[group].last_delivered_id) if group in groups else (-1, -1)
    pending_ids = set(queue.pending_ids(group)) if group in groups else set()
    produced = pending = undelivered = 0
    lost: list[str] = []
    for entry_id, item in queue.scan():
        if isinstance(item, SampleDecodeError):
            continue  # dead-lettered; never the trainer's to train
        for sample in item.samples:
            produced += 1
            if entry_id in pending_ids:
                pending += 1
            elif parse_id(entry_id) > last:
                undelivered += 1
            elif seen[sample.sample_id] == 0:
                lost.append(sample.sample_id)
    return TrainerAudit(
        committed_step=step, produced=produced, trained=fates["trained"], stale=fates["stale"],
        invalid=fates["invalid"], filtered=fates["filtered"], pending=pending, undelivered=undelivered,
        duplicates=sum(1 for c in seen.values() if c > 1), lost=len(lost), lost_ids=lost[:20],
    )

