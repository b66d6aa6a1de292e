"""Who sends which weight: every Hugging Face tensor the engines load gets one owner rank, and each rank exports
only what it owns, gathering nothing it will not send (docs/weight-push.md, "Every owner sends its own share").

- A routed expert's weights: the rank of expert data-parallel replica 0 that holds that expert (with expert tensor
  parallelism, one rank of its ETP group, which gathers the shards to itself alone).
- A tensor split by tensor parallelism: one rank, whose TP group gathers the shards to it (``gather``, not
  ``all_gather``).
- A replicated tensor (norms, routers, and every dense weight without TP): one rank, with no communication.

Dense and replicated tensors go, largest first, to the rank with the fewest bytes so far (experts counted first),
so every rank sends about the same share. The plan is pure arithmetic on what every rank holds alike (the local
parameter names and shapes, and each rank's coordinates, exchanged once), so every rank computes the same plan and
every gather is entered by exactly the ranks of one group, in the same order.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.consumers.megatron.config import ModelConfig
from pipeline.consumers.megatron.convert import (
    MEGATRON_EXPERT,
    check_exportable,
    is_tp_sharded,
    megatron_full_to_hf,
    named_weights,
    unshard_to,
)


@dataclass(frozen=True)
class RankCoords:
    """Where one global rank sits in megatron's groups (pipeline parallelism is 1)."""

    rank: int
    dp: int
    """Data-parallel replica of the dense weights: ranks with the same ``dp`` form one TP group."""
    ep: int
    etp: int
    expert_dp: int


def rank_coords() -> list[RankCoords]:
    """Every rank's coordinates, indexed by global rank: one small all-gather over the world."""
    from megatron.core import parallel_state as ps

    mine = torch.tensor([ps.get_data_parallel_rank(), ps.get_expert_model_parallel_rank(),
                         ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank()], dtype=torch.int64)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(table, mine)
    return [RankCoords(rank, *(int(v) for v in row.tolist())) for rank, row in enumerate(table)]


@dataclass(frozen=True)
class OwnerPlan:
    """The owner of every exported tensor and the bytes each rank sends."""

    dense: dict[str, int]
    """Megatron name of a dense or replicated weight -> the global rank that sends it."""
    expert_etp: dict[str, int]
    """Megatron name of a local expert weight -> the ETP rank that sends it (in each EP rank's ETP group of expert
    replica 0)."""
    bytes_per_rank: list[int]
    """Bytes each global rank sends per push, in the parameters' dtype."""

    def owner(self, name: str, coords: RankCoords) -> bool:
        """Whether the rank at ``coords`` sends the weight ``name`` (for an expert weight: its EP rank's experts)."""
        if name in self.dense:
            return self.dense[name] == coords.rank
        return coords.expert_dp == 0 and self.expert_etp[name] == coords.etp


def plan_owners(mg_model: torch.nn.Module, coords: list[RankCoords]) -> OwnerPlan:
    """Owners for ``mg_model``'s weights; every rank computes the same plan (see the module docstring)."""
    from megatron.core import parallel_state as ps

    world = len(coords)
    tp_group, etp_group = ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group()
    etp_size = dist.get_world_size(etp_group)
    loads = [0] * world
    expert_etp: dict[str, int] = {}
    dense_sizes: list[tuple[int, int, str]] = []
    for order, (name, param) in enumerate(named_weights(mg_model)):
        match = MEGATRON_EXPERT.match(name)
        if match is not None:
            etp = int(match.group(2)) % etp_size  # spread an EP rank's experts over its ETP ranks
            expert_etp[name] = etp
            whole = param.numel() * param.element_size() * (etp_size if is_tp_sharded(param, etp_group) else 1)
            for c in coords:
                if c.expert_dp == 0 and c.etp == etp:
                    loads[c.rank] += whole
            continue
        tp = dist.get_world_size(tp_group) if is_tp_sharded(param, tp_group) else 1
        dense_sizes.append((-param.numel() * param.element_size() * tp, order, name))
    dense: dict[str, int] = {}
    for negative_bytes, _order, name in sorted(dense_sizes):
        rank = min(range(world), key=lambda r: (loads[r], r))
        dense[name] = rank
        loads[rank] -= negative_bytes
    return OwnerPlan(dense=dense, expert_etp=expert_etp, bytes_per_rank=loads)


class OwnedExport:
    """The exporter of one rank's share: ``__call__`` yields (HF name, full tensor) for what this rank owns.

    Every rank must exhaust it together (the TP and ETP gathers are collectives of their groups). Unsharded tensors
    are views of the live parameters, as with ``iter_hf_weights``.
    """

    def __init__(self, mg_model: torch.nn.Module, model: ModelConfig) -> None:
        self.mg_model, self.model = mg_model, model
        self.coords = rank_coords()
        self.me = self.coords[dist.get_rank()]
        self.plan = plan_owners(mg_model, self.coords)

    @property
    def share_bytes(self) -> int:
        """The bytes this rank sends per push, in the parameters' dtype."""
        return self.plan.bytes_per_rank[self.me.rank]

    def __call__(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        from megatron.core import parallel_state as ps

        extra = check_exportable(self.mg_model, self.model)
        tp_group, etp_group = ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group()
        for name, param in named_weights(self.mg_model):
            match = MEGATRON_EXPERT.match(name)
            if match is not None:
                items = self._expert(name, param, match, etp_group)
            else:
                owner = self.coords[self.plan.dense[name]]
                if owner.dp != self.me.dp and is_tp_sharded(param, tp_group):
                    continue  # another TP group gathers it to its owner
                if not is_tp_sharded(param, tp_group) and owner.rank != self.me.rank:
                    continue
                full = unshard_to(param, name, tp_group, owner.rank)
                if full is None:
                    continue
                items = [(extra[name], full)] if name in extra else megatron_full_to_hf(name, full, self.model)
            for hf_name, tensor in items:
                yield hf_name, (tensor.to(dtype) if dtype is not None else tensor).contiguous()

    def _expert(self, name: str, param: torch.Tensor, match: re.Match[str],
                etp_group: object) -> list[tuple[str, torch.Tensor]]:
        if self.me.expert_dp != 0:
            return []
        etp = self.plan.expert_etp[name]
        full = unshard_to(param, name, etp_group, dist.get_process_group_ranks(etp_group)[etp])
        if full is None:
            return []
        from megatron.core import parallel_state as ps

        per_rank = self.model.num_experts // ps.get_expert_model_parallel_world_size()
        prefix, local, rest = match.groups()
        return megatron_full_to_hf(f"{prefix}.{int(local) + self.me.ep * per_rank}.{rest}", full, self.model)
