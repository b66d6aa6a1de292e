"""Least-loaded routing over several engines (``EnginePool``), with failover to a healthy one and background
``/health`` probes of those that stopped answering. Each engine is an ``SGLangClient``
(``pipeline.producers.sglang_client``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pipeline.errors import EngineError
from pipeline.producers.base import GenerateResult
from pipeline.producers.sglang_client import (
    Backoff,
    EngineUnavailableError,
    ExponentialBackoff,
    Retry,
    SGLangClient,
)

_T = TypeVar("_T")


@dataclass
class _EngineState:
    client: SGLangClient
    healthy: bool = True
    failures: int = 0
    next_probe_at: float = 0.0
    probing: bool = False
    last_error: str = ""


class EnginePool:
    """Least-loaded routing over several engines, skipping ones that stopped answering until ``/health`` passes.

    A generation that fails with ``EngineUnavailableError`` marks its engine unhealthy and is retried on another
    one under ``retry``. Unhealthy engines are re-probed with ``/health`` in the background, ``probe_backoff`` apart.
    Give the clients ``retry=NO_RETRY`` so that failover does not first wait out retries against a dead engine.
    """

    def __init__(
        self,
        clients: Sequence[SGLangClient],
        *,
        retry: Retry | None = None,
        probe_backoff: Backoff | None = None,
    ) -> None:
        if not clients:
            raise EngineError("EnginePool needs at least one engine client")
        self._states = [_EngineState(c) for c in clients]
        default_retry = Retry(retries=2 * len(clients), backoff=ExponentialBackoff(0.05, 2.0))
        self.retry = retry if retry is not None else default_retry
        self.probe_backoff = probe_backoff if probe_backoff is not None else ExponentialBackoff(0.2, 10.0)
        self._probes: set[asyncio.Task[None]] = set()
        self._turn = 0

    @property
    def clients(self) -> list[SGLangClient]:
        """All engines, healthy or not (e.g. for a weight push, which must reach every one)."""
        return [s.client for s in self._states]

    def healthy_clients(self) -> list[SGLangClient]:
        """Engines currently taking generations."""
        return [s.client for s in self._states if s.healthy]

    def is_healthy(self, client: SGLangClient) -> bool:
        """Whether ``client``'s engine currently takes generations."""
        return self._state(client).healthy

    def mark_unhealthy(self, client: SGLangClient, reason: str) -> None:
        """Stop routing to ``client`` until a ``/health`` probe passes."""
        state = self._state(client)
        state.failures += 1
        state.last_error = reason
        if state.healthy:
            state.healthy = False
            state.next_probe_at = time.monotonic() + self.probe_backoff.compute(state.failures)

    async def probe(self, client: SGLangClient) -> bool:
        """Ask ``/health`` now; a pass puts the engine back in rotation, a failure pushes the next probe back."""
        state = self._state(client)
        ok = await client.health()
        if ok:
            state.healthy, state.failures, state.last_error = True, 0, ""
        else:
            state.failures += 1
            state.healthy = False
            state.next_probe_at = time.monotonic() + self.probe_backoff.compute(state.failures)
        return ok

    async def probe_all(self) -> list[bool]:
        """Probe every engine now."""
        return list(await asyncio.gather(*(self.probe(s.client) for s in self._states)))

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        rid: str | None = None,
    ) -> GenerateResult:
        """``SGLangClient.generate`` on the least-loaded healthy engine, failing over to others."""
        return await self._with_failover(
            lambda c: c.generate(
                input_ids,
                sampling_params,
                return_logprob=return_logprob,
                return_routed_experts=return_routed_experts,
                routed_experts_start_len=routed_experts_start_len,
                rid=rid,
            )
        )

    async def generate_many(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: Mapping[str, Any],
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        rids: Sequence[str] | None = None,
    ) -> list[GenerateResult]:
        """``SGLangClient.generate_many`` on the least-loaded healthy engine, failing over to others."""
        return await self._with_failover(
            lambda c: c.generate_many(
                prompts,
                sampling_params,
                return_logprob=return_logprob,
                return_routed_experts=return_routed_experts,
                routed_experts_start_len=routed_experts_start_len,
                rids=rids,
            )
        )

    async def close(self) -> None:
        """Stop pending probes and close every client."""
        for task in list(self._probes):
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
        await asyncio.gather(*(s.client.close() for s in self._states))

    async def _with_failover(self, call: Callable[[SGLangClient], Awaitable[_T]]) -> _T:
        async def attempt() -> _T:
            client = self._pick()
            try:
                return await call(client)
            except EngineUnavailableError as exc:
                self.mark_unhealthy(client, str(exc))
                raise

        return await self.retry.call(attempt)

    def _pick(self) -> SGLangClient:
        self._schedule_probes()
        healthy = [s for s in self._states if s.healthy]
        if not healthy:
            errors = "; ".join(f"{s.client.name}: {s.last_error or 'failed /health'}" for s in self._states)
            raise EngineUnavailableError(f"no healthy engine ({errors}); waiting for /health probes to pass")
        # Rotate the starting point so that ties do not always land on the first engine.
        self._turn = (self._turn + 1) % len(healthy)
        rotated = healthy[self._turn :] + healthy[: self._turn]
        return min(rotated, key=lambda s: s.client.in_flight).client

    def _schedule_probes(self) -> None:
        now = time.monotonic()
        for state in self._states:
            if not state.healthy and not state.probing and state.next_probe_at <= now:
                state.probing = True
                task = asyncio.get_running_loop().create_task(self._probe_task(state))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    async def _probe_task(self, state: _EngineState) -> None:
        try:
            await self.probe(state.client)
        finally:
            state.probing = False

    def _state(self, client: SGLangClient) -> _EngineState:
        for state in self._states:
            if state.client is client:
                return state
        raise EngineError(f"{client!r} is not part of this pool")


