"""``[filters]``: which drained prompt groups the trainer keeps (``pipeline.consumers.trainer.filters`` applies
them)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pipeline.plugins import Signature


class FilterConfig(BaseModel):
    """The ``[filters]`` section: group filters applied to every drained group the staleness policy accepts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    zero_variance: bool = False
    """Drop groups whose rewards are all equal (zero GRPO advantage) and keep drawing until the batch is full."""
    user: list[str] = []
    """Filters 'package.module:function', each called with one group (list[Sample]) and returning True to keep it,
    False to drop it, or a weight >= 0 that scales the group's loss (0 drops)."""
    max_draw_factor: float | None = Field(default=None, ge=1.0, le=1000.0)
    """Stop drawing for a step once filters removed this many times trainer.batch_groups groups, and train on the
    groups kept so far (a smaller batch); None = draw until the batch is full. Near convergence most groups are all
    right, and filling the batch would cost many times its generation (DAPO caps it with max_num_gen_batches)."""


FILTER_SIGNATURE = Signature(args=([],), described="(group: list[Sample]) -> bool | float", awaitable=False)
