"""Blocking collectives run off the event loop, and their results handed back to it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` on ``loop`` from another thread; nothing if the loop is gone (its push failed and moved on)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def run_in_thread(fn: Callable[[], _T]) -> asyncio.Future[_T]:
    """Run a blocking collective off the event loop, in a daemon thread.

    Not ``asyncio.to_thread``: a broadcast whose peer vanished blocks until the backend timeout, and the default
    executor's threads would then hold up interpreter exit for that long.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()

    def _settle(result: _T | None, error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def _target() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine, not swallowed
            call_soon(loop, _settle, None, exc)
        else:
            call_soon(loop, _settle, result, None)

    threading.Thread(target=_target, name="sluice-weight-broadcast", daemon=True).start()
    # Nobody may be awaiting any more (the push already failed); retrieve the outcome so asyncio does not warn.
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future
