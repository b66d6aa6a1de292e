"""``trainer.profile_steps = [a, b]``: torch.profiler over trainer steps a..b, as a Chrome/Perfetto trace.

Each rank writes ``RUN_DIR/profiles/trainer-rank{r}-steps{a}-{b}.json`` once step b is done (or the loop ends inside
the window). Every step inside the window is wrapped in a ``sluice.step.{n}`` range (``record_function``), so the
trace shows where each step begins and ends, with the drain, the forward/backward passes, the push and the commit
nested in it. Open the file at https://ui.perfetto.dev (drag it in) or in chrome://tracing.

The profiler runs only inside the window: the rest of the run pays nothing. A step is everything one pass of the
trainer's loop does (drain, train, push, record, commit), which is why the hooks sit at the top of the loop and
after it rather than around the train step alone.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline.rundir import profiles_dir

log = logging.getLogger(__name__)

STEP_MARK = "sluice.step.{}"


def trace_path(run_dir: Path, rank: int, steps: tuple[int, int]) -> Path:
    """Where rank ``rank`` writes the trace of ``steps``."""
    return profiles_dir(run_dir) / f"trainer-rank{rank}-steps{steps[0]}-{steps[1]}.json"


class StepProfiler:
    """Starts torch.profiler at the first step inside ``steps`` and writes the trace after the last one."""

    def __init__(self, steps: tuple[int, int] | None, run_dir: Path, rank: int = 0) -> None:
        self.steps = steps
        self.path = trace_path(run_dir, rank, steps) if steps is not None else None
        self._prof: Any = None
        self._mark: Any = None
        self.written: Path | None = None

    def start_step(self, step: int) -> None:
        """Step ``step`` begins (the previous one, if any, has ended)."""
        self._end_mark()
        if self.steps is None or self.written is not None:
            return
        first, last = self.steps
        if step > last:
            self.finish()
            return
        if step < first:
            return
        if self._prof is None:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
            self._prof.__enter__()
            log.info("profiling trainer steps %d..%d", first, last)
        import torch

        self._mark = torch.profiler.record_function(STEP_MARK.format(step))
        self._mark.__enter__()

    def finish(self) -> None:
        """End the window (after the loop, or once a step past it starts): stop the profiler and write the trace."""
        self._end_mark()
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        prof.export_chrome_trace(str(tmp))
        tmp.replace(self.path)
        self.written = self.path
        log.info("profile of trainer steps %s written to %s (open it in https://ui.perfetto.dev)", self.steps,
                 self.path)

    def _end_mark(self) -> None:
        if self._mark is not None:
            mark, self._mark = self._mark, None
            mark.__exit__(None, None, None)
