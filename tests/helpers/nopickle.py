"""A guard that refuses every unpickling in a process: ``pickle.loads``/``pickle.load``, ``pickle.Unpickler`` (also
torch.distributed's copy of it, taken at import), ``torch.load``, and, through an audit hook, any unpickler that
resolves a global (``pickle.find_class``), whatever module holds a reference to it. Each refusal is appended to a
log file too, so that one swallowed by an ``except`` in the code under test is still seen.

Tests install it in their own process (``refusing_pickle()``) and, through ``nopickle_site/sitecustomize.py`` on
PYTHONPATH with ``SLUICE_NO_PICKLE_LOG`` set, in the subprocesses they start (an engine, trainer ranks).
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

ENV_LOG = "SLUICE_NO_PICKLE_LOG"


class Unpickled(RuntimeError):
    """Something unpickled while the guard was on."""


_state: dict[str, Any] = {"active": False, "log": None, "saved": None, "hooked": False}


def _refuse(what: str) -> None:
    if _state["log"]:
        with open(_state["log"], "a") as f:
            f.write(f"{os.getpid()} {what}\n{''.join(traceback.format_stack(limit=12))}\n")
    raise Unpickled(f"{what}: nothing on a data or sync path may unpickle")


class _RefusingUnpickler(pickle.Unpickler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse("pickle.Unpickler")


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "pickle.find_class" and _state["active"]:
        _refuse(f"pickle.find_class{args}")


def install(log: str | None = None, *, with_torch: bool = True) -> None:
    if _state["active"]:
        return
    _state["log"] = log
    saved: dict[tuple[Any, str], Any] = {(pickle, n): getattr(pickle, n) for n in ("loads", "load", "Unpickler")}
    pickle.loads = lambda *a, **k: _refuse("pickle.loads")  # type: ignore[assignment]
    pickle.load = lambda *a, **k: _refuse("pickle.load")  # type: ignore[assignment]
    pickle.Unpickler = _RefusingUnpickler  # type: ignore[misc]
    if with_torch:
        import torch
        import torch.distributed.distributed_c10d as c10d

        for owner, name in ((torch, "load"), (c10d, "_unpickler")):
            saved[(owner, name)] = getattr(owner, name)
        torch.load = lambda *a, **k: _refuse("torch.load")  # type: ignore[assignment]
        c10d._unpickler = _RefusingUnpickler  # type: ignore[attr-defined]
    _state["saved"] = saved
    if not _state["hooked"]:
        sys.addaudithook(_audit)  # cannot be removed: it acts only while the guard is active
        _state["hooked"] = True
    _state["active"] = True


def uninstall() -> None:
    if not _state["active"]:
        return
    for (owner, name), value in _state["saved"].items():
        setattr(owner, name, value)
    _state["active"] = False


def install_from_env() -> None:
    log = os.environ.get(ENV_LOG)
    if log:
        install(log)


@contextmanager
def refusing_pickle(log: str | None = None) -> Iterator[None]:
    install(log)
    try:
        yield
    finally:
        uninstall()
