"""The locking between generation and weight updates that SGLang 0.5.23's tokenizer manager does, in the CPU engine's
HTTP process, so that a client (sluice's pusher above all) meets the same waits, and the same deadlock, as against a
real SGLang server.

What SGLang does, and so this engine:

- **The model-update lock** (``ModelUpdateLock``) is an asyncio readers-writer lock that prefers writers. Every
  ``/generate`` holds it as a reader for its whole life, from admission until its answer. While a writer waits, new
  readers wait too, so a writer waits only for the generations already admitted.
- **The pause** (``PauseGate``): ``/pause_generation`` (any mode) sets ``is_pause``; with ``in_place`` the scheduler
  stops between two forward passes and the requests in flight keep their place and their KV cache. While paused, a
  NEW ``/generate`` waits, before it takes the reader lock, until ``/continue_generation``.
- **Weight-update calls** (``/begin_weight_update``, ``/update_weights_from_distributed``, ``/end_weight_update``,
  ``/update_weights_from_disk``) look at ``is_pause`` when they arrive: paused, they run without the lock; not
  paused, they first take the writer lock, that is, they wait until every generation in flight has finished.
  ``/update_weight_version``, ``/init_weights_update_group`` and the pause calls take no lock, as in SGLang.

So a ``/begin_weight_update`` that arrives before the pause, followed by an in-place pause that freezes the
generations it waits for, waits for ever: SGLang's watchdog ends that by killing the server, and this engine by
nothing (a ``/continue_generation`` or an abort unblocks it). A pusher must have every pause answered before any
begin. sluice's own ordered announcements (``begin_window`` on bucket 0, ``update_turns.py``) pause first, then open
the window, so they never take the writer lock; an indexed announcement or end that arrives before its window looks
at the pause only once the window is open (``weight_routes.py``).

``--hold-until-update`` counts as a pause here: requests wait at the gate until the first whole update.

Everything in this module runs on the engine's event loop: its state changes between two awaits only, so it needs no
thread lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


class ModelUpdateLock:
    """Writer-preferring readers-writer lock for asyncio: ``reading`` for a generation, ``writing`` for a weight
    update. A writer that gives up while waiting (its request cancelled) lets the readers it held back go."""

    def __init__(self) -> None:
        self.readers = 0
        """Generations that hold the lock."""
        self.writer = False
        """Whether a weight update holds it."""
        self.writers_waiting = 0
        """Weight updates waiting for it; while any waits, no new reader gets in."""
        self._waiters: list[asyncio.Future[None]] = []

    @asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        """Held by one generation from admission to its answer."""
        await self._wait(lambda: not self.writer and self.writers_waiting == 0)
        self.readers += 1
        try:
            yield
        finally:
            self.readers -= 1
            if self.readers == 0:
                self._wake()

    @asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        """Held by a weight update that came while generation was not paused: entered once no generation holds the
        lock any more."""
        self.writers_waiting += 1
        try:
            await self._wait(lambda: not self.writer and self.readers == 0)
        except BaseException:
            self.writers_waiting -= 1
            self._wake()  # readers held back only by this writer may go now
            raise
        self.writers_waiting -= 1
        self.writer = True
        try:
            yield
        finally:
            self.writer = False
            self._wake()

    async def _wait(self, ready: Callable[[], bool]) -> None:
        # Every change wakes every waiter, which checks its own condition again: few waiters, rare changes.
        while not ready():
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class PauseGate:
    """SGLang's ``is_pause``: set by ``/pause_generation``, cleared by ``/continue_generation``; new generations wait
    at the gate while it is set. Created outside the event loop (the engine is), used only on it."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()

    @property
    def paused(self) -> bool:
        """Whether generation is paused (``is_pause``)."""
        return not self._open.is_set()

    def set_paused(self, paused: bool) -> None:
        """Pause, or continue and let the waiting generations in."""
        if paused:
            self._open.clear()
        else:
            self._open.set()

    async def wait_until_continued(self) -> None:
        """Return at once when not paused, else once generation continues."""
        await self._open.wait()
