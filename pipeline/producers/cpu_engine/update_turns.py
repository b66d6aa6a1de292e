"""The order in which the CPU engine receives a window's announcements when a pusher sends them ahead of the answers.

A pusher that knows the engine says ``ordered_updates`` (``/model_info``) posts bucket k+1's
``/update_weights_from_distributed`` while bucket k is still on the wire, so the engine has it parsed and waiting the
moment bucket k is in (docs/weight-push.md, "Announcements ahead of the answers"). Two HTTP requests on two
connections may arrive in either order, but the broadcasts must be received in the order they are sent: gloo matches
a receive with the next broadcast, whatever tensors it was meant for. So every such announcement carries its
``bucket_index`` in the window and the ``push_id`` of its push, and is received only on its turn. Bucket k+1's turn
comes once bucket k's receives have all started (``started``): the group runs its receives behind k's.

The window itself may be opened by the push's bucket 0 (``begin_window``), so a later bucket of that push, or its
``/end_weight_update``, may arrive before the window is open: while no other push's window is open, it waits for it.

A bucket that fails (refused, or its receive failed) fails the rest of the window at once: the engine did not take
its bytes, so a later receive would take them in its place. A window that closes (the pusher's failure path ends
every window) refuses whatever of its push still waits. An announcement of another push than the window's (a stale
request of a failed push that arrived late) is refused.
"""

from __future__ import annotations

import asyncio


class UpdateTurns:
    """Turns of one engine's update window; ``take`` before receiving an indexed bucket, ``done`` after."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._open = False
        self._push: str | None = None  # the push of the open (or last) window; None until a bucket names it
        self._next = 0
        self._failed: str | None = None
        self._done = 0  # buckets 0 .. _done - 1 are done (received or failed)
        self._finished: set[int] = set()
        self._serial = 0  # windows opened so far

    async def open(self, push_id: str | None = None) -> None:
        """A new window: turns start again at bucket 0, of push ``push_id`` (None: of whichever push sends it)."""
        async with self._changed:
            self._open, self._push, self._next, self._failed = True, push_id, 0, None
            self._done, self._finished = 0, set()
            self._serial += 1
            self._changed.notify_all()

    async def close(self) -> None:
        """The window closed: whatever of its push still waits is refused."""
        async with self._changed:
            self._open = False
            self._changed.notify_all()

    def holds(self, push_id: str) -> bool:
        """Whether the open window is push ``push_id``'s."""
        return self._open and self._push == push_id

    async def take(self, index: int, push_id: str) -> str | None:
        """Wait until bucket ``index`` of push ``push_id`` is due. None: it is, receive it, then call ``done``.
        Otherwise why it is refused; nothing may be received for it, and ``done`` is not called."""
        if index < 0:
            return f"bucket_index {index} is negative"
        async with self._changed:
            arrived = self._arrived()
            await self._changed.wait_for(lambda: self._refusal(index, push_id, arrived) is not None or (
                self._mine(push_id) and self._next == index))
            refused = self._refusal(index, push_id, arrived)
            if refused is None:
                self._push = push_id
            return refused

    async def started(self, index: int) -> None:
        """Every receive of bucket ``index`` has started, its bytes still coming: the next bucket's turn, whose
        receives the group runs behind these. ``done`` follows as ever; if it says the bucket failed, the rest of the
        window fails from there (a bucket already started behind it fails with it on the group)."""
        async with self._changed:
            self._next = max(self._next, index + 1)
            self._changed.notify_all()

    async def done(self, index: int, error: str | None) -> None:
        """Bucket ``index`` is received (``error`` None) or failed, which fails the rest of the window."""
        async with self._changed:
            if error is not None:
                self._fail(index, error)
            self._next = max(self._next, index + 1)
            self._finished.add(index)
            while self._done in self._finished:
                self._done += 1
            self._changed.notify_all()

    async def settled(self, index: int, push_id: str) -> str | None:
        """Wait until every bucket of push ``push_id`` before ``index`` is done; None if all were received, else why
        not. A bucket started behind one still receiving (``started``) checks this before it may move the label, and
        an ``/end_weight_update`` posted with the last announcement before it closes the window."""
        async with self._changed:
            arrived = self._arrived()
            await self._changed.wait_for(lambda: self._settled(index, push_id, arrived) is not None)
            settled = self._settled(index, push_id, arrived)
            return None if settled == "" else settled

    async def fail(self, index: int, error: str) -> None:
        """Bucket ``index`` was refused before its turn: the rest of the window fails now (its bytes are coming, and
        a later receive would take them in its place)."""
        async with self._changed:
            self._fail(index, error)
            self._changed.notify_all()

    def _fail(self, index: int, error: str) -> None:
        self._failed = self._failed or f"bucket {index} of this window failed ({error})"

    def _mine(self, push_id: str) -> bool:
        """Whether the current window (open, or the last one) is push ``push_id``'s, or open and not yet claimed."""
        return self._push == push_id or (self._open and self._push is None)

    def _arrived(self) -> int | None:
        """The window a request arrives in (its serial), or None if none is open."""
        return self._serial if self._open else None

    def _elsewhere(self, push_id: str, arrived: int | None) -> str | None:
        """Why push ``push_id`` has no window here, if it never will; None if it has one, or may yet get one."""
        if arrived is not None and arrived != self._serial:  # another window opened since (a new trainer's, say)
            return "the weight update window closed before its turn"
        if self._mine(push_id):
            return None if self._open else "the weight update window closed"
        if self._open:
            return f"push {push_id!r} is not this window's, which carries push {self._push!r}"
        if arrived is not None:
            return "the weight update window closed before its turn"
        return None  # it came with no window open: its push's bucket 0, which opens one, may come after it

    def _refusal(self, index: int, push_id: str, arrived: int | None) -> str | None:
        elsewhere = self._elsewhere(push_id, arrived)
        if elsewhere is not None:
            return f"bucket {index}: {elsewhere}"
        if not self._mine(push_id):
            return None  # waits for the window
        if self._failed is not None:
            return self._failed
        if self._next > index:
            return f"bucket {index} came after bucket {self._next - 1} of this window had its turn"
        return None

    def _settled(self, index: int, push_id: str, arrived: int | None) -> str | None:
        """"" once settled, why not if it never will be, None while it may still be."""
        elsewhere = self._elsewhere(push_id, arrived)
        if not self._mine(push_id):
            return elsewhere
        if self._failed is not None:
            return self._failed
        if self._done >= index:
            return ""
        return elsewhere
