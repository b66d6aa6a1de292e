"""Reading TensorBoard event files back with TensorBoard's own reader (what its UI uses), for the tests."""

from __future__ import annotations

from pathlib import Path


def read_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar series in an event-file folder: tag -> {step: value} (a step written twice: the last wins)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0, "scalars": 0})  # 0: keep every event
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["tensors"]:  # tensorboard.summary.Writer writes scalars as rank-0 tensors
        out[tag] = {e.step: float(make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
    for tag in acc.Tags()["scalars"]:
        out[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    return out
