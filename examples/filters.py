"""Example group filters (docs/plugins.md, "Group filters"). Recipe lines:

    [plugins]
    paths = ["examples"]

    [filters]
    zero_variance = true
    user = ["filters:quality_weight", "filters:upweight_hard"]

A filter gets one prompt group (``list[Sample]``, after the staleness policy kept it) and returns True / 1.0 (keep),
False / 0.0 (drop) or another finite weight >= 0 that scales the group's part of the loss. Weights of several filters
multiply; ``filter/groups_reweighted`` and ``filter/weight_mean`` count them in the trainer's metrics.
"""

from __future__ import annotations

from typing import Any

from pipeline.queue.sample import SampleStatus


def quality_weight(group: list[Any]) -> float:
    """Drop a group whose every answer was cut off at max_new_tokens; weigh the others by how many answers finished
    on their own (0.5 when all but one were cut off, 1.0 when none was): truncated answers are scored on text the
    model never finished, so their rewards say less."""
    finished = sum(1 for s in group if s.status == SampleStatus.COMPLETED)
    if finished == 0:
        return 0.0
    return 0.5 + 0.5 * (finished - 1) / max(len(group) - 1, 1)


def upweight_hard(group: list[Any]) -> float:
    """Twice the weight for prompts the policy mostly gets wrong (mean reward below 0.5): the rarer successes there
    carry the most signal."""
    mean = sum(float(s.reward) for s in group) / len(group)
    return 2.0 if mean < 0.5 else 1.0
