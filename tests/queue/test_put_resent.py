"""A put whose pipeline is sent twice (a connection lost after the server ran it but before the reply came back, and
the client's retry sending it again) leaves one entry per group, and trimming drops the record that made it so."""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.queue.redis_streams import SampleQueue
from tests.helpers import one_slot, redis_cluster
from tests.helpers.one_slot import ON_BOTH
from tests.helpers.samples import make_group

redis_kind, redis_url, redis_client = one_slot.redis_kind, one_slot.redis_url, one_slot.redis_client
redis_cluster = redis_cluster.redis_cluster


@ON_BOTH
def test_a_put_sent_twice_adds_each_group_once(queue: SampleQueue) -> None:
    rng = np.random.default_rng(3)
    queue.create_group("trainer")
    sent: list[dict[str, Any]] = []
    enqueue = queue._enqueue

    def recorded(**kw: Any) -> Any:
        sent.append({k: v for k, v in kw.items() if k != "client"})
        return enqueue(**kw)

    queue._enqueue = recorded  # type: ignore[method-assign]
    groups = [make_group(rng, 4) for _ in range(3)]
    ids = queue.put_many(groups)
    assert len(sent) == 1
    again = [i.decode() if isinstance(i, bytes) else i for i in enqueue(**sent[0])]  # the retry's second run
    assert again == ids, "a resent put added entries or answered other ids"
    assert queue.redis.xlen(queue.keys.samples) == 3
    entries = queue.read("trainer", "c", count=10)
    assert [e.samples for e in entries] == groups
    queue.ack("trainer", [e.id for e in entries])
    queue.trim()
    assert queue.redis.xlen(queue.keys.samples) == 0
    assert not queue.redis.exists(queue.keys.landed), "trimming left the landed record of dropped headers"
