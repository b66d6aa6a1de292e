"""The order in which the CPU engine receives a window's announcements when a pusher sends them ahead of the answers.

A pusher that knows the engine says ``ordered_updates`` (``/model_info``) posts bucket k+1's
``/update_weights_from_distributed`` while bucket k is still on the wire, so the engine has it parsed and waiting the
moment bucket k is in (docs/weight-push.md, "Announcements ahead of the answers"). Two HTTP requests on two
connections may arrive in either order, but the broadcasts must be received in the order they are sent: gloo matches
a receive with the next broadcast, whatever tensors it was meant for. So every such announcement carries its
``bucket_index`` in the window and the ``push_id`` of its push, and is received only on its turn.

A bucket that fails (refused, or its receive failed) fails the rest of the window at once: the engine did not take
its bytes, so a later receive would take them in its place. A window that closes (the pusher's failure path ends
every window) refuses whatever still waits. An announcement of another push than the one the window's bucket 0
came from (a stale request of a failed push that arrived late) is refused too.
"""

from __future__ import annotations

import asyncio


class UpdateTurns:
    """Turns of one engine's update window; ``take`` before receiving an indexed bucket, ``done`` after."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._open = False
        self._next = 0
        self._push: str | None = None
        self._failed: str | None = None

    async def open(self) -> None:
        """A new window: turns start again at bucket 0, of whichever push sends it."""
        async with self._changed:
            self._open, self._next, self._push, self._failed = True, 0, None, None
            self._changed.notify_all()

    async def close(self) -> None:
        """The window closed: whatever still waits for its turn is refused."""
        async with self._changed:
            self._open = False
            self._changed.notify_all()

    async def take(self, index: int, push_id: str) -> str | None:
        """Wait until bucket ``index`` of push ``push_id`` is due. None: it is, receive it, then call ``done``.
        Otherwise why it is refused; nothing may be received for it, and ``done`` is not called."""
        if index < 0:
            return f"bucket_index {index} is negative"
        async with self._changed:
            await self._changed.wait_for(lambda: self._refusal(index, push_id) is not None or self._next == index)
            refused = self._refusal(index, push_id)
            if refused is None:
                self._push = push_id
            return refused

    async def done(self, index: int, error: str | None) -> None:
        """Bucket ``index`` is received (``error`` None) or failed, which fails the rest of the window."""
        async with self._changed:
            if error is not None:
                self._fail(index, error)
            self._next = index + 1
            self._changed.notify_all()

    async def fail(self, index: int, error: str) -> None:
        """Bucket ``index`` was refused before its turn: the rest of the window fails now (its bytes are coming, and
        a later receive would take them in its place)."""
        async with self._changed:
            self._fail(index, error)
            self._changed.notify_all()

    def _fail(self, index: int, error: str) -> None:
        self._failed = self._failed or f"bucket {index} of this window failed ({error})"

    def _refusal(self, index: int, push_id: str) -> str | None:
        if not self._open:
            return "the weight update window closed before this bucket's turn"
        if self._failed is not None:
            return self._failed
        if self._push is not None and self._push != push_id:
            return f"bucket {index} belongs to push {push_id!r}, but this window carries push {self._push!r}"
        if self._next > index:
            return f"bucket {index} came after bucket {self._next - 1} of this window had its turn"
        return None
