"""The engine's generation loop: one thread that owns the model.

HTTP handlers never touch the model. They hand sequences to ``submit`` and control actions (weight loads, version
changes, aborts) to ``call``. The loop runs control actions only between forward passes, so a weight update never
lands inside a step: every token is produced entirely by one set of weights and is labelled with the version that
was current when its forward pass ran. A weight update received straight into the model's tensors holds forward
passes off for the whole transfer instead (``hold_passes``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from pipeline.producers.cpu_engine.generator import BatchGenerator, Sequence

log = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True)
class Load:
    """A snapshot of how busy the engine is (served by ``GET /get_load``)."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_tokens: int
    max_batch: int
    paused: bool
    forward_passes: int
    tokens_generated: int


class Scheduler:
    """Batches submitted sequences into shared forward passes and runs control actions between them."""

    def __init__(self, generator: BatchGenerator, max_batch: int) -> None:
        self.generator = generator
        self.max_batch = max_batch
        self._waiting: deque[Sequence] = deque()
        self._actions: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._cond = threading.Condition()
        self._paused = False
        self._stopped = False
        self._running = 0
        self._holds = 0  # hold_passes blocks in progress: no forward pass may start
        self._in_pass = False  # the loop is in an iteration that may run a forward pass
        self._admitting = 0  # taken off the queue by this iteration, admitted after its control actions
        self._thread = threading.Thread(target=self._loop, name="sluice-cpu-engine-scheduler", daemon=True)

    def start(self) -> None:
        """Start the loop thread."""
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop after its current step; waiting and running sequences are aborted."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences for generation; each one's ``on_finish`` is called from the loop thread when done."""
        with self._cond:
            if self._stopped:
                raise RuntimeError("the engine is shutting down")
            self._waiting.extend(seqs)
            self._cond.notify_all()

    def call(self, action: Callable[[], _T]) -> Future[_T]:
        """Run ``action`` in the loop thread between two forward passes; the future holds its result."""
        future: Future[_T] = Future()
        with self._cond:
            self._actions.append((action, future))
            self._cond.notify_all()
        return future

    def set_paused(self, paused: bool) -> None:
        """Pause or resume generation; control actions still run while paused."""
        with self._cond:
            self._paused = paused
            self._cond.notify_all()

    @contextmanager
    def hold_passes(self) -> Iterator[None]:
        """No forward pass runs inside this block: entering waits for one in flight to end, and none starts until
        the block exits, whatever pause or continue comes meanwhile. For a thread that writes the model's tensors in
        place (a weight update received straight into them); control actions still run. Never from the loop thread."""
        with self._cond:
            self._holds += 1
            while self._in_pass:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify_all()

    @property
    def paused(self) -> bool:
        """Whether generation is paused."""
        return self._paused

    @property
    def alive(self) -> bool:
        """Whether the loop thread is running."""
        return self._thread.is_alive()

    def abort_in_loop(self, predicate: Callable[[Sequence], bool], message: str) -> int:
        """Abort waiting and running sequences that match ``predicate``; only from an action run by ``call``."""
        hit = self.abort_waiting(predicate, message)
        running = self.generator.abort(predicate, message)
        self._running = len(self.generator.rows)
        _notify(running)
        return len(hit) + len(running)

    def load(self) -> Load:
        """How busy the engine is right now."""
        with self._cond:
            waiting = len(self._waiting)
        gen = self.generator
        return Load(
            self._running,
            waiting,
            gen.num_tokens,
            self.max_batch,
            self._paused,
            gen.forward_passes,
            gen.tokens_generated,
        )

    def pending_in_loop(self) -> tuple[int, int]:
        """(waiting, running) sequences, counting those this iteration is about to admit as waiting; only from an
        action run by ``call`` (the running ones are the generator's, which only the loop thread may read)."""
        with self._cond:
            waiting = len(self._waiting) + self._admitting
        return waiting, len(self.generator.rows)

    def abort_waiting(self, predicate: Callable[[Sequence], bool], message: str) -> list[Sequence]:
        """Finish queued (not yet started) sequences that match ``predicate`` with reason ``abort``."""
        with self._cond:
            hit = [s for s in self._waiting if predicate(s)]
            self._waiting = deque(s for s in self._waiting if not predicate(s))
        for seq in hit:
            seq.finish_reason = {"type": "abort", "message": message}
        _notify(hit)
        return hit

    def _next_work(self) -> tuple[list[tuple[Callable[[], Any], Future[Any]]], list[Sequence], bool, bool]:
        """Wait for work; return the actions to run, the sequences to admit, whether a forward pass may run, and
        whether to stop."""
        with self._cond:
            while not self._stopped and not self._actions and (
                self._paused or self._holds or not (self._waiting or self._running)
            ):
                self._cond.wait()
            actions = list(self._actions)
            self._actions.clear()
            admit: list[Sequence] = []
            # Decided under the lock, with _in_pass: a hold that comes later waits for this iteration to end.
            generate = not (self._paused or self._holds)
            if generate:
                while self._waiting and self._running + len(admit) < self.max_batch:
                    admit.append(self._waiting.popleft())
            self._in_pass = generate
            self._admitting = len(admit)
            return actions, admit, generate, self._stopped

    def _end_pass(self) -> None:
        with self._cond:
            self._in_pass = False
            self._admitting = 0
            self._cond.notify_all()

    def _loop(self) -> None:
        # One thread does all model work; inference_mode keeps autograd bookkeeping off the hot path.
        while True:
            actions, admit, generate, stopped = self._next_work()
            try:
                for action, future in actions:
                    _run_action(action, future)
                if stopped:
                    self._shutdown(admit)
                    return
                try:
                    with torch.inference_mode():
                        self._iterate(admit, generate)
                except Exception as exc:  # noqa: BLE001 - the loop's crash handler: fail the requests, keep serving
                    log.exception("generation step failed; aborting the running requests")
                    self._fail_all(admit, f"generation failed in the engine: {exc!r}")
            finally:
                self._end_pass()

    def _iterate(self, admit: list[Sequence], generate: bool) -> None:
        if admit:
            _notify(self.generator.admit(admit))
        if self.generator.rows and generate and not self._paused:
            _notify(self.generator.step())
        self._running = len(self.generator.rows)

    def _fail_all(self, admit: list[Sequence], message: str) -> None:
        failed = [s for s in [*admit, *self.generator.rows] if not s.notified]
        self.generator.reset()
        for seq in failed:
            seq.finish_reason = {"type": "abort", "message": message}
        self._running = 0
        _notify(failed)

    def _shutdown(self, admit: list[Sequence]) -> None:
        message = "the engine is shutting down"
        with self._cond:
            pending = list(self._waiting) + admit
            self._waiting.clear()
        for seq in pending:
            seq.finish_reason = {"type": "abort", "message": message}
        _notify(pending + self.generator.abort(lambda s: True, message))


def _run_action(action: Callable[[], Any], future: Future[Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(action())
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting HTTP handler
        future.set_exception(exc)


def _notify(seqs: list[Sequence]) -> None:
    for seq in seqs:
        if seq.notified:
            continue
        seq.notified = True
        if seq.on_finish is not None:
            seq.on_finish(seq)
