"""The LoRA push to SGLang engines: each version's adapters as a PEFT folder, loaded beside the base by name.

SGLang 0.5.23 serves adapters beside its base weights (``--enable-lora``) and loads one from a folder
(``/load_lora_adapter``) or from pickled tensors (``/load_lora_adapter_from_tensors``, which sluice's no-pickle rule
excludes). A loaded adapter cannot be replaced under its name, and a request names the adapter it runs under
(``lora_path``). So each push writes version N's adapters to ``ADAPTER_DIR/vN`` and has every engine load them as
``sluice-vN`` (``adapter_name``), then moves the engine's label to N. Producers name the adapter of the label they
read just before each request (``SGLangClient(adapters=True)``), and label 0 is the base alone (the adapters start at
B = 0, so the base is version 0's policy).

The consistency rule differs from the paused-in-place push of full weights: **a request runs whole under the adapter
it named**, so every token of a sequence has one version, generation is never paused, and SGLang's radix cache,
which keys prefixes by adapter, never hands a request KV computed under another version. The price is that a
request started before a push finishes under the old adapter; its tokens carry that version and the staleness
policy treats them as it treats any lagging token.

Old adapters are unloaded once ``keep`` newer ones are loaded. SGLang's unload waits for the requests still running
under the adapter and holds its LoRA update lock meanwhile, so the next load waits too; ``unload_timeout_s`` bounds
that wait, and an engine whose unload timed out keeps the adapter (it is tried again at the next push) rather than
stalling the trainer. An unloaded adapter's folder is deleted at once: SGLang reloads an unloaded adapter from its
path when a request names it, so a request that read an old label would otherwise bring that version back to stay.
Without its folder the request is refused and the client asks again under the engine's current version.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pipeline.errors import EngineError, SyncError
from pipeline.sync.base import EngineReply, WeightSource, WeightUpdateEngine
from pipeline.sync.lifecycle import Adoption, ManagedEngine, adopt_engines
from pipeline.sync.lora_names import adapted_weight, adapter_name, is_adapter_a
from pipeline.sync.packing import PackedBucket
from pipeline.sync.pusher import PushStats

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_KEEP = 3
"""Adapters each engine keeps loaded: the newest and the two before it, which requests started before the last two
pushes may still be running under."""


@runtime_checkable
class AdapterEngine(Protocol):
    """The endpoints the adapter push drives (``SGLangClient`` has them)."""

    @property
    def name(self) -> str: ...

    async def load_lora_adapter(self, name: str, path: str) -> EngineReply: ...

    async def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> EngineReply: ...

    async def update_weight_version(self, new_version: str | int, *, abort_all_requests: bool = False) -> EngineReply:
        ...

    async def continue_generation(self) -> EngineReply: ...

    async def close(self) -> None: ...


def write_adapter_folder(named: Iterable[tuple[str, torch.Tensor]], out: Path, *, base_dir: Path | None) -> int:
    """The pushed adapters (PEFT names without the prefix, B already scaled) as a PEFT LoRA folder SGLang loads:
    ``lora_alpha`` equals the rank, so the scale SGLang applies (alpha / r) is 1. Written under a temporary name and
    renamed, so an engine never reads half a folder. Returns the bytes of the tensors."""
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    modules: set[str] = set()
    rank = 0
    for name, tensor in named:
        weight = adapted_weight(name)
        if weight is None:
            raise SyncError(f"the LoRA push to SGLang carries adapters only, and {name!r} is not one; is "
                            "[trainer.lora] set for the trainer that exports these weights?")
        modules.add(weight.removesuffix(".weight").rsplit(".", 1)[-1])
        if is_adapter_a(name):
            rank = max(rank, int(tensor.shape[0]))
        tensors[f"base_model.model.{name}"] = tensor.detach().contiguous().clone()
    if not tensors:
        raise SyncError("a LoRA push needs at least one adapter tensor")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
              "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "base_model_name_or_path": None if base_dir is None else str(base_dir.resolve()),
              "use_rslora": False, "use_dora": False}
    (partial / "adapter_config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    save_file(tensors, str(partial / "adapter_model.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return sum(t.numel() * t.element_size() for t in tensors.values())


class AdapterPush:
    """``WeightPush`` for LoRA on SGLang engines (see the module docstring). An engine that fails a load is left out
    of that push and tried again at the next; its label stays behind, so what it samples meanwhile is stale and the
    staleness policy drops it. A push fails only when no engine took it."""

    def __init__(self, engines: Sequence[AdapterEngine], adapter_dir: Path, *, base_dir: Path | None = None,
                 keep: int = DEFAULT_KEEP, timeout_s: float = 600.0, unload_timeout_s: float = 30.0,
                 discover: Callable[[list[Any]], list[Any]] | None = None) -> None:
        if keep < 1:
            raise SyncError(f"an engine must keep at least the newest adapter loaded, not {keep}")
        self._engines: list[Any] = list(engines)
        self._clients: dict[str, Any] = {e.name: e for e in self._engines}
        self.adapter_dir = adapter_dir
        self.base_dir = base_dir
        self.keep = keep
        self.timeout_s = timeout_s
        self.unload_timeout_s = unload_timeout_s
        self._discover = discover
        self._loaded: dict[str, list[int]] = {}
        """Per engine: the versions it has loaded, oldest first (as this trainer knows; SGLang is the truth)."""
        self.loads = 0
        self.unloads = 0
        self.unload_timeouts = 0
        self.failed_loads = 0

    @property
    def engines(self) -> Sequence[WeightUpdateEngine]:
        return self._engines

    @property
    def all(self) -> Sequence[WeightUpdateEngine]:
        return list(self._clients.values())

    @property
    def dtype(self) -> str | None:
        return None  # the adapters go in the trainer's dtype; SGLang casts them to its own as it loads them

    def counters(self) -> dict[str, float]:
        return {"adapter_loads": self.loads, "adapter_unloads": self.unloads,
                "adapter_unload_timeouts": self.unload_timeouts, "adapter_failed_loads": self.failed_loads}

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[Any]:
        return [(name, tensor.detach().clone()) for name, tensor in named_tensors]

    async def adopt(self, version: int, *, fresh: bool, model_path: str | None = None) -> list[Adoption]:
        managed: list[ManagedEngine] = [e for e in self._engines if hasattr(e, "update_weight_version")]
        return await adopt_engines(managed, version=version, fresh=fresh, model_path=model_path)

    async def push_once(self, weights: WeightSource, weight_version: str | int) -> PushStats | None:
        named = weights() if callable(weights) else weights
        return await self.push(list(named), weight_version)  # type: ignore[arg-type]

    async def push(self, weights: Sequence[PackedBucket] | Sequence[tuple[str, torch.Tensor]],
                   weight_version: str | int) -> PushStats:
        start = time.perf_counter()
        version = int(weight_version)
        named = _named(weights)
        folder = self.adapter_dir / f"v{version}"
        nbytes = write_adapter_folder(named, folder, base_dir=self.base_dir)
        self._refresh()
        outcomes = await asyncio.gather(*(self._push_one(e, version, folder) for e in self._engines),
                                        return_exceptions=True)
        failed = [(e.name, o) for e, o in zip(self._engines, outcomes) if isinstance(o, BaseException)]
        for name, error in failed:
            self.failed_loads += 1
            log.warning("engine %s did not take the adapters of version %d (it is tried again at the next push): %s",
                        name, version, error)
        if len(failed) == len(self._engines):
            raise SyncError(f"no engine took the adapters of version {version}: "
                            + "; ".join(f"{n}: {e}" for n, e in failed))
        self._prune_folders(version)
        return PushStats(weight_version=str(version), tensors=len(named), buckets=1, bytes=nbytes,
                         seconds=time.perf_counter() - start)

    async def _push_one(self, engine: Any, version: int, folder: Path) -> None:
        name = adapter_name(version)
        reply = await asyncio.wait_for(engine.load_lora_adapter(name, str(folder.resolve())), self.timeout_s)
        if not reply.success and "already loaded" in reply.message:
            # Left by an earlier run on an engine that outlived it: that run's version N is not this one's.
            await self._unload(engine, name)
            reply = await asyncio.wait_for(engine.load_lora_adapter(name, str(folder.resolve())), self.timeout_s)
        if not reply.success:
            raise SyncError(f"/load_lora_adapter {name}: {reply.message}")
        self.loads += 1
        loaded = self._loaded.setdefault(engine.name, [])
        loaded.append(version)
        # The label moves only once the adapter is there: a producer names the adapter of the label it reads.
        reply = await engine.update_weight_version(str(version), abort_all_requests=False)
        if not reply.success:
            raise SyncError(f"/update_weight_version {version}: {reply.message}")
        reply = await engine.continue_generation()  # an engine held at adoption (a resumed run) serves from now on
        if not reply.success:
            raise SyncError(f"/continue_generation: {reply.message}")
        while len(loaded) > self.keep:
            if not await self._unload(engine, adapter_name(loaded[0])):
                break
            loaded.pop(0)

    async def _unload(self, engine: Any, name: str) -> bool:
        try:
            reply = await engine.unload_lora_adapter(name, timeout=self.unload_timeout_s)
        except (TimeoutError, EngineError, SyncError, OSError) as exc:
            reply = EngineReply(False, f"no answer within {self.unload_timeout_s:.0f} s ({exc!r})")
        if reply.success or "does not exist" in reply.message:
            self.unloads += int(reply.success)
            return True
        self.unload_timeouts += 1
        log.warning("engine %s did not unload adapter %s: %s. It stays loaded and is tried again at the next push; "
                    "an unload that never returns is SGLang's usage-counter bug (sglang issue 36894), which wedges "
                    "the engine's LoRA updates until it restarts", engine.name, name, reply.message)
        return False

    def _refresh(self) -> None:
        """Engines the launcher restarted elsewhere (engines.json) replace their old clients."""
        if self._discover is None:
            return
        self._engines = self._discover(self._engines)
        for engine in self._engines:
            self._clients.setdefault(engine.name, engine)

    def _prune_folders(self, version: int) -> None:
        oldest_kept = version - self.keep + 1
        for folder in self.adapter_dir.glob("v*"):
            suffix = folder.name[1:]
            if suffix.isdigit() and int(suffix) < oldest_kept:
                shutil.rmtree(folder, ignore_errors=True)

    async def close(self) -> None:
        """Nothing to leave: the adapter push holds no weight group. The engines keep their adapters."""


def _named(weights: Sequence[PackedBucket] | Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    if weights and isinstance(weights[0], PackedBucket):
        return [t for bucket in weights for t in bucket.tensors()]  # type: ignore[union-attr]
    return list(weights)  # type: ignore[arg-type]
