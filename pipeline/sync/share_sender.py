"""A trainer rank other than 0 as a source of a push from several (``pipeline.sync.sources_push``)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

from pipeline.errors import SyncError
from pipeline.sync.base import WeightSource, WeightUpdateEngine
from pipeline.sync.pusher import PushOptions, WeightPusher
from pipeline.sync.sources_push import SOURCE_GROUP, ControlChannel, SourceReport

log = logging.getLogger(__name__)
_LEAVE_TIMEOUT_S = 10.0


MakeEngine = Callable[[str], WeightUpdateEngine]
"""An engine client from the engine's name (its base URL)."""


class ShareSender:
    """A trainer rank other than 0 as a source: rank 0 of a weight group of its own with every engine, sending the
    share of each push that this rank owns when rank 0 says so (``serve``)."""

    def __init__(self, control: ControlChannel, make_engine: MakeEngine, *, master_address: str, backend: str,
                 timeout_s: float, options: PushOptions) -> None:
        self.control = control
        self.make_engine = make_engine
        self.master_address, self.backend, self.timeout_s = master_address, backend, timeout_s
        self.options = options
        self.pusher: WeightPusher | None = None
        self._clients: dict[str, WeightUpdateEngine] = {}
        self._joins = 0

    def serve(self, weights: WeightSource, loop: asyncio.AbstractEventLoop) -> None:
        """Answer rank 0 until it says this push is done (every retry of it included)."""
        while True:
            message = self.control.broadcast(None)
            op = message["op"]
            if op == "done":
                return
            start = time.perf_counter()
            report = SourceReport(self.control.rank, None)
            try:
                if op == "connect":
                    loop.run_until_complete(self._connect(message["engines"], message["tp"], message.get("dtype")))
                elif op == "send":
                    if message.get("turn") in (None, self.control.rank):
                        report = loop.run_until_complete(self._send(weights, message["version"], start))
                else:
                    raise SyncError(f"unknown push-control message {op!r}")
            except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the push with it
                log.warning("weight push: this rank's %s failed: %s", op, exc)
                report = SourceReport(self.control.rank, f"{type(exc).__name__}: {exc}")
            self.control.gather(report)

    async def _connect(self, names: Sequence[str], tp: Sequence[int], dtype: str | None) -> None:
        await self._leave()
        engines = [self._clients.get(n) or self._clients.setdefault(n, self.make_engine(n)) for n in names]
        self._joins += 1
        # A new name for each join: the group it replaces may still be tearing down on an engine (a broken one
        # waits out its timeout there), and an engine refuses to join a name it holds.
        self.pusher = await WeightPusher.connect(
            engines, master_address=self.master_address, master_port=0,
            group_name=SOURCE_GROUP.format(rank=self.control.rank) + f"_{self._joins}", backend=self.backend,
            ranks_per_engine=list(tp), timeout_s=self.timeout_s,
            options=dataclasses.replace(self.options, dtype=dtype))

    async def _send(self, weights: WeightSource, version: str, start: float) -> SourceReport:
        if self.pusher is None:
            raise SyncError("asked to send before joining a weight group")
        source = weights() if callable(weights) else weights
        buckets, tensors, sent = await self.pusher.send_share(source, version)
        return SourceReport(self.control.rank, None, sent, buckets, tensors, time.perf_counter() - start)

    async def _leave(self) -> None:
        if self.pusher is None:
            return
        pusher, self.pusher = self.pusher, None
        if pusher.group.broken is not None:
            # A broadcast of the failed push may still wait for receives no engine will post: closing this end
            # waits for it until the group's timeout, so that happens in the background, and the engines are only
            # asked to leave (the next group has another name).
            threading.Thread(target=pusher.group.close, name="sluice-leave-broken-group", daemon=True).start()
            calls = [e.destroy_weights_update_group(pusher.group.group_name) for e in pusher.engines]
            done = await asyncio.wait([asyncio.ensure_future(c) for c in calls], timeout=_LEAVE_TIMEOUT_S)
            for task in done[0]:
                task.exception()
            return
        try:
            await pusher.close()
        except Exception as exc:  # noqa: BLE001 - a group being replaced; the engines may be gone
            log.debug("leaving the old weight group failed: %s", exc)

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        """Leave the weight group and close the engine clients."""
        async def closing() -> None:
            await self._leave()
            for client in self._clients.values():
                await client.close()

        loop.run_until_complete(closing())
