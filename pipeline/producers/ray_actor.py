"""Ray placement of producers: ``ProducerActor`` runs one plain-asyncio producer inside a Ray actor process.

Ray only places, starts and supervises here. Samples never pass through Ray's object store: the actor writes them
to the run's Redis, and its methods take and return small JSON-shaped dicts (the spec in, counters out).

Ray is an optional dependency (the ``ray`` extra: ``ray[default]==2.60.0``); importing this module does not need it,
only ``producer_actor_class`` and the helpers that start actors do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.errors import ConfigError, SluiceError
from pipeline.producers.producer import Producer, ProducerSpec, open_producer, stats_dict

#: What to install for this module: ``pip install "sluice-rl[ray]"`` should pull exactly this.
RAY_REQUIREMENT = "ray[default]==2.60.0"


class ProducerActor:
    """The actor's body: one producer, run on the actor's own event loop.

    Ray runs async actors' methods concurrently on one loop, so ``stop`` and ``stats`` answer while ``run`` works.
    """

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.spec = ProducerSpec.model_validate(dict(spec))
        self._producer: Producer | None = None
        self._stop: asyncio.Event | None = None
        self._final: dict[str, Any] | None = None

    async def run(self, max_groups: int | None = None) -> dict[str, Any]:
        """Produce until ``stop()`` or ``max_groups`` groups are queued; returns the final counters."""
        if self._producer is not None:
            raise SluiceError(f"producer {self.spec.name!r} is already running; call stop() before running it again")
        self._stop = asyncio.Event()
        try:
            async with open_producer(self.spec) as producer:
                self._producer = producer
                stats = await producer.run(max_groups=max_groups, stop=self._stop)
            self._final = stats_dict(stats)
            return self._final
        finally:
            self._producer = None

    async def stop(self) -> None:
        """Stop admitting groups; ``run`` returns once the groups in flight are on the queue."""
        if self._stop is not None:
            self._stop.set()

    async def stats(self) -> dict[str, Any]:
        """The live counters (or the last run's, once it returned)."""
        if self._producer is not None:
            return stats_dict(self._producer.stats)
        return dict(self._final or {})

    async def name(self) -> str:
        """The producer's name (a cheap liveness check)."""
        return self.spec.name


def producer_actor_class(num_cpus: float = 0.5) -> Any:
    """``ProducerActor`` as a Ray actor class asking for ``num_cpus`` (a producer mostly waits on HTTP and Redis)."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"placing producers with Ray needs Ray: pip install '{RAY_REQUIREMENT}'") from None
    return ray.remote(num_cpus=num_cpus, max_restarts=0)(ProducerActor)


def start_producers(specs: Sequence[ProducerSpec], num_cpus: float = 0.5) -> list[Any]:
    """One named actor per spec (named ``sluice-producer-{run}-{name}``); the caller's ``ray.init`` must have run."""
    if len({s.name for s in specs}) != len(specs):
        raise ConfigError(f"producer names must be unique, got {[s.name for s in specs]}")
    cls = producer_actor_class(num_cpus)
    return [cls.options(name=f"sluice-producer-{s.run}-{s.name}").remote(s.model_dump(mode="json")) for s in specs]


def stop_producers(actors: Sequence[Any], runs: Sequence[Any], timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Ask every actor to stop, then wait for their ``run`` calls; returns each one's final counters."""
    import ray

    ray.get([a.stop.remote() for a in actors], timeout=timeout_s)
    return list(ray.get(list(runs), timeout=timeout_s))
