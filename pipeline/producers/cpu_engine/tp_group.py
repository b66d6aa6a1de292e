"""The CPU engine's seat in the weight group, one rank per tensor-parallel rank (``--tp``).

SGLang with TP > 1 joins the trainer's weight group with every TP worker: ranks ``rank_offset .. rank_offset + tp - 1``
of a world of ``1 + sum(tp)``, and every one of them receives every broadcast (each keeps its own shard). The CPU
engine reproduces that seat so the trainer's side (offsets, world size, one broadcast reaching several ranks of one
engine) is exercised for real: with ``--tp N`` it holds N members of the group, each with its own gloo communicator,
and receives on all of them at once, one thread per rank. Its model is not sharded: **rank 0 of the engine applies
the full tensors**, and the other ranks' copies are compared with rank 0's byte for byte (an update whose ranks
disagree is refused) and then dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from pipeline.errors import EngineError
from pipeline.sync.weights import WeightGroup, init_weight_group

Receive = Callable[[WeightGroup, list[str], list[str], list[list[int]]], list[tuple[str, torch.Tensor]]]


class TpWeightGroup:
    """The ``tp`` members of one weight group that one engine holds."""

    def __init__(self, members: list[WeightGroup], bytes_received: list[int] | None = None) -> None:
        self.members = members
        self.bytes_received = bytes_received if bytes_received is not None else [0] * len(members)
        """Per rank: bytes taken off the weight group (the engine's counters, which outlive one group)."""
        self._probe: list[torch.Tensor] | None = None

    @classmethod
    async def join(cls, tp: int, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, timeout_s: float, bytes_received: list[int] | None = None) -> TpWeightGroup:
        """Join as ranks ``rank_offset .. rank_offset + tp - 1``, all at once (the group forms only when every member
        of the world has joined)."""
        if rank_offset + tp > world_size:
            raise EngineError(f"an engine with tp={tp} needs ranks {rank_offset}..{rank_offset + tp - 1}, but the "
                              f"weight group has world_size {world_size}; the trainer must count every engine's tp "
                              "(world_size = 1 + sum of tp)")
        # A thread per rank: each init blocks until the whole world joined, so ranks queued behind others in a
        # shared pool (asyncio's default one has min(32, cores + 4) threads) would never join.
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(tp, thread_name_prefix="sluice-tp-join") as pool:
            joins = [loop.run_in_executor(pool, init_weight_group, master_address, master_port, rank_offset + i,
                                          world_size, group_name, "gloo", timeout_s) for i in range(tp)]
            results = await asyncio.gather(*joins, return_exceptions=True)
        members = [r for r in results if isinstance(r, WeightGroup)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for member in members:
                member.close()
            raise errors[0]
        return cls(members, bytes_received)

    def receive(self, receive: Receive, names: list[str], dtypes: list[str], shapes: list[list[int]],
                recycle: Callable[[list[tuple[str, torch.Tensor]]], None] = lambda tensors: None,
                ) -> list[tuple[str, torch.Tensor]]:
        """Receive one announcement on every rank at once; rank 0's tensors, once every rank got the same bytes (the
        other ranks' go back to ``recycle``)."""
        if len(self.members) == 1:
            got = [receive(self.members[0], names, dtypes, shapes)]
        else:
            with ThreadPoolExecutor(len(self.members), thread_name_prefix="sluice-tp-rank") as pool:
                futures = [pool.submit(receive, m, names, dtypes, shapes) for m in self.members]
                errors = [f.exception() for f in futures]
                failed = next((e for e in errors if e is not None), None)
                if failed is not None:
                    for f, e in zip(futures, errors):  # what the other ranks received goes back to the pool
                        if e is None:
                            recycle(f.result())
                    raise failed
                got = [f.result() for f in futures]
        for rank, tensors in enumerate(got):
            self.bytes_received[rank] += sum(t.numel() * t.element_size() for _, t in tensors)
        try:
            for rank, tensors in enumerate(got[1:], start=1):
                if any(not torch.equal(_bytes(a), _bytes(b)) for (_, a), (_, b) in zip(got[0], tensors, strict=True)):
                    recycle(got[0])
                    raise EngineError(f"tp rank {rank} received other bytes than rank 0; the update is refused")
        finally:
            for tensors in got[1:]:
                recycle(tensors)
        return got[0]

    def prepare_probe(self, nbytes: int) -> None:
        """Allocate and touch the probe's buffers now, so that ``probe`` times the transfer alone. The previous
        probe's buffers are freed here, first: freeing costs about 0.1 ms per MB (220 ms for 2 GB), which ``probe``
        would otherwise count as part of the reference it times."""
        self._probe = None
        self._probe = [torch.zeros(nbytes, dtype=torch.uint8) for _ in self.members]

    def probe(self, nbytes: int) -> None:
        """Receive one flat uint8 broadcast of ``nbytes`` on every rank into the prepared buffers (``sluice bench
        sync``'s reference: the bare collective, no announcement per bucket, no packing, no load). The buffers are
        kept until the next ``prepare_probe`` or ``close``."""
        buffers = self._probe
        if buffers is None or buffers[0].numel() != nbytes:
            raise EngineError(f"no probe buffer of {nbytes} bytes; prepare one first")
        if len(self.members) == 1:  # as ``receive`` does: no thread pool for one rank
            self.members[0].broadcast(buffers[0], 0)
            return
        with ThreadPoolExecutor(len(self.members), thread_name_prefix="sluice-tp-rank") as pool:
            for future in [pool.submit(m.broadcast, b, 0) for m, b in zip(self.members, buffers, strict=True)]:
                future.result()

    def close(self) -> None:
        self._probe = None
        for member in self.members:
            member.close()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # Compared as bytes: NaN payloads are weights too, and NaN != NaN as floats.
    return t.contiguous().reshape(-1).view(torch.uint8)
