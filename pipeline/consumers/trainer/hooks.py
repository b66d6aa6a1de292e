"""User hooks of the trainer: functions named in the recipe's ``[hooks]`` section, called as the run goes.

- ``metrics``: ``fn(step, metrics)`` with the step's metrics line (every numeric field, as floats) once it is
  computed, before it is written;
- ``after_step``: ``fn(step, info)`` after each optimizer step, with ``info`` = ``{"policy_version", "samples",
  "groups"}`` (the version the step trained against, and what it trained on);
- ``after_commit``: ``fn(step, checkpoint_dir)`` after each checkpoint commit (the model, the optimizer, the ledger
  and the acks are all done), with the checkpoint's folder as a string.

Hooks are plain (sync) functions, checked at recipe load, and run on the trainer's rank 0 only, one at a time, in the
order listed. Each call runs in a thread of its own and is waited for at most ``hooks.timeout_s``. A hook that raises
or runs past the timeout never stops training: its first failure is logged with the traceback's last frames, and
every failure is counted in the next metrics line (``hooks/errors``, and ``hooks/errors/<kind>/<hook>``). A hook still
running past its timeout is left to finish in its thread; its later calls are skipped until it has, and counted in
``hooks/skipped``.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.config.hooks import SIGNATURES, HooksConfig, Kind
from pipeline.plugins import resolve

log = logging.getLogger(__name__)

@dataclass
class Hook:
    """One resolved hook and its failures."""

    kind: Kind
    ref: str
    fn: Callable[..., Any]
    errors: int = 0
    skipped: int = 0
    running: threading.Thread | None = None  # a call still running past its timeout

    @property
    def key(self) -> str:
        return f"hooks/errors/{self.kind}/{self.ref.replace(':', '.')}"


class HookRunner:
    """Calls the hooks of each kind, isolating training from them (module docstring)."""

    def __init__(self, hooks: list[Hook], timeout_s: float) -> None:
        self.hooks = hooks
        self.timeout_s = timeout_s

    @classmethod
    def from_config(cls, cfg: HooksConfig) -> HookRunner | None:
        """The runner of the configured hooks (resolved: the config checked them at load), or None without any."""
        hooks = [Hook(kind=sig_kind(field), ref=ref, fn=resolve(ref, field=field, signature=sig))
                 for field, ref, sig in cfg.refs()]
        return cls(hooks, cfg.timeout_s) if hooks else None

    def on_step(self, step: int, info: Mapping[str, Any], metrics: Mapping[str, Any]) -> dict[str, float]:
        """Run the after_step hooks, then the metrics hooks; returns the counters to add to the step's line."""
        self._run("after_step", step, dict(info))
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        self._run("metrics", step, numeric)
        return self.counters()

    def on_commit(self, step: int, checkpoint_dir: str) -> None:
        """Run the after_commit hooks."""
        self._run("after_commit", step, checkpoint_dir)

    def counters(self) -> dict[str, float]:
        """``hooks/errors`` (all hooks), ``hooks/skipped``, and each hook's own error count, since the start."""
        out = {"hooks/errors": float(sum(h.errors for h in self.hooks)),
               "hooks/skipped": float(sum(h.skipped for h in self.hooks))}
        out.update({h.key: float(h.errors) for h in self.hooks})
        return out

    def _run(self, kind: Kind, *args: Any) -> None:
        for hook in self.hooks:
            if hook.kind == kind:
                self._call(hook, args)

    def _call(self, hook: Hook, args: tuple[Any, ...]) -> None:
        if hook.running is not None:
            if hook.running.is_alive():
                hook.skipped += 1  # its last call still runs: a second one would pile threads up behind it
                return
            hook.running = None
        failure: list[BaseException] = []

        def call() -> None:
            try:
                hook.fn(*args)
            except BaseException as e:  # any user error is reported, never raised into the trainer
                failure.append(e)

        thread = threading.Thread(target=call, name=f"hook-{hook.kind}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            hook.running = thread
            self._failed(hook, f"still running after hooks.timeout_s = {self.timeout_s}s; training goes on, and "
                               "its next calls are skipped until this one returns")
        elif failure:
            e = failure[0]
            frames = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-3))
            self._failed(hook, f"raised {type(e).__name__}: {e}\n{frames}")

    def _failed(self, hook: Hook, what: str) -> None:
        hook.errors += 1
        if hook.errors == 1:  # once per hook: a hook that fails every step must not flood the log
            log.warning("hook %s = %r %s (further failures are counted in %s, not logged)", hook.kind, hook.ref,
                        what, hook.key)


def sig_kind(field: str) -> Kind:
    """``hooks.after_step[0]`` -> ``after_step``."""
    kind = field.removeprefix("hooks.").split("[", 1)[0]
    assert kind in SIGNATURES, field
    return kind  # type: ignore[return-value]
