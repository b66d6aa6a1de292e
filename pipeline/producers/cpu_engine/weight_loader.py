"""Loading weights received over the weight group into the engine's model, by HF parameter name.

Names are the ones SGLang loads: the checkpoint names ``save_pretrained`` writes. For Qwen3-MoE these address one
expert each (``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``), while transformers 5 keeps the experts
fused in memory (``experts.gate_up_proj`` ``[E, 2I, H]`` with gate first, ``experts.down_proj`` ``[E, H, I]``); the
per-expert names are therefore mapped onto views of the fused tensors. The in-memory names are accepted too.

Every announced name and shape is checked before the first byte is received (a gloo broadcast into a wrong-sized
buffer aborts the process). Then a bucket is received one of two ways:

- **into a buffer** (a reused pool buffer for a flat bucket, fresh tensors for the per-tensor wire), and copied into
  the model by ``apply`` between forward passes. A transfer that fails leaves the model untouched;
- **in place** (``receive_in_place``), straight into the parameter's memory, when a flat bucket holds exactly one
  tensor whose target is contiguous and of the announced dtype and shape, and the caller has made sure no forward
  pass runs meanwhile (the engine does it while generation is paused for the push). No buffer, no copy. A transfer
  that fails leaves that one tensor undefined, as a push that fails after some buckets leaves a mix of old and new
  weights; either way the engine keeps its old version label until a whole push lands.

A load from disk (``/update_weights_from_disk``) replaces the whole model, so besides names and shapes it checks that
the folder's tensors write every element of every parameter: a folder of another architecture, or one missing a
shard, is refused before anything is written rather than leaving a model that is half old, half new.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from pipeline.errors import EngineError, SyncError
from pipeline.producers.cpu_engine.fp8 import EngineFp8
from pipeline.producers.cpu_engine.lora import EngineAdapters, LoRAServe
from pipeline.sync.base import TensorMeta, check_announcement, dtype_name, validate_metas
from pipeline.sync.lora_names import adapted_weight
from pipeline.sync.weights import WeightGroup, receive_flat, receive_tensors


def _fused_expert_views(prefix: str, experts: nn.Module) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint names mapped to views into a fused experts module (transformers 5 layout)."""
    gate_up = experts.get_parameter("gate_up_proj").data
    down = experts.get_parameter("down_proj").data
    inter = gate_up.shape[1] // 2
    views: dict[str, torch.Tensor] = {}
    for e in range(gate_up.shape[0]):
        views[f"{prefix}.{e}.gate_proj.weight"] = gate_up[e, :inter]
        views[f"{prefix}.{e}.up_proj.weight"] = gate_up[e, inter:]
        views[f"{prefix}.{e}.down_proj.weight"] = down[e]
    return views


def weight_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every name an update may address, mapped to the tensor (or view) it writes into."""
    # keep_vars=True yields the Parameters themselves, including tied aliases such as lm_head.weight.
    targets: dict[str, torch.Tensor] = {name: t.data for name, t in model.state_dict(keep_vars=True).items()}
    for name, module in model.named_modules():
        if (
            hasattr(module, "gate_up_proj")
            and hasattr(module, "down_proj")
            and isinstance(module.down_proj, nn.Parameter)
        ):
            targets.update(_fused_expert_views(name, module))
    return targets


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


class WeightLoader:
    """Checks weight-update announcements against the model and writes received tensors into it."""

    def __init__(self, model: nn.Module, lora: LoRAServe = "merge", *, fp8: bool = False) -> None:
        self._targets = weight_targets(model)
        self.fp8 = EngineFp8(model, self._targets) if fp8 else None
        """FP8 copies of the projection weights (``--weight-dtype fp8``): pushes of those names land there."""
        self.adapters = EngineAdapters(model, self._targets, lora)
        """LoRA adapters pushed by a trainer that trains them (``pipeline.producers.cpu_engine.lora``)."""
        self._expected = {
            name: TensorMeta(name=name, dtype=dtype_name(t.dtype), shape=tuple(t.shape))
            for name, t in self._targets.items()
            if t.is_floating_point()
        }
        if self.fp8 is not None:
            self._expected.update(self.fp8.metas())
        self._free: list[torch.Tensor] = []
        self._lent: list[torch.Tensor] = []
        self._pool_lock = threading.Lock()
        self.bytes_in_place = 0
        """Bytes received straight into the model's tensors (``receive_in_place``)."""
        self.bytes_buffered = 0
        """Bytes received into buffers and copied into the model afterwards, summed over every TP rank's receive."""
        # Elements per parameter storage: a full load must write all of them (views of one fused tensor add up).
        self._param_numel: dict[int, int] = {}
        self._param_name: dict[int, str] = {}
        for name, param in model.named_parameters():
            self._param_numel.setdefault(_storage(param), param.numel())
            self._param_name.setdefault(_storage(param), name)

    @property
    def names(self) -> list[str]:
        """Every loadable name."""
        return sorted(self._expected)

    def check(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        """Raise EngineError if the announcement does not fit the model; nothing is received or changed."""
        try:
            metas = check_announcement(names, dtypes, shapes)
            adapters = [m for m in metas if adapted_weight(m.name) is not None]
            problems = [p for m in adapters if (p := self.adapters.problem(m.name, m.shape)) is not None]
            if problems:
                raise SyncError("; ".join(problems[:3]))
            # The engine casts on load (a bf16 push into an fp32 engine is fine), so only names and shapes must match.
            validate_metas([m for m in metas if adapted_weight(m.name) is None], self._expected, match_dtype=False)
        except SyncError as exc:
            raise EngineError(str(exc)) from exc

    def receive(
        self, group: WeightGroup, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive the announced tensors into fresh buffers (the model is not touched); ``check`` must pass first."""
        self.check(names, dtypes, shapes)
        tensors = list(receive_tensors(group, names, dtypes, shapes))
        with self._pool_lock:
            self.bytes_buffered += sum(t.numel() * t.element_size() for _, t in tensors)
        return tensors

    def receive_flat(
        self, group: WeightGroup, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> list[tuple[str, torch.Tensor]]:
        """``receive`` for a flat bucket (one uint8 broadcast of every announced byte) into a buffer from the pool;
        give it back with ``recycle`` once the tensors are applied."""
        self.check(names, dtypes, shapes)
        total = sum(m.nbytes for m in check_announcement(names, dtypes, shapes))
        buffer = self._take(total)
        try:
            tensors = receive_flat(group, names, dtypes, shapes, buffer)
        except BaseException:
            self._give_back(buffer)
            raise
        with self._pool_lock:
            self.bytes_buffered += total
        return tensors

    def in_place_targets(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                         flat: bool) -> list[torch.Tensor] | None:
        """The model tensors an announcement can be received straight into, or None. Every announced tensor needs a
        target that is contiguous and of exactly the announced dtype and shape (anything else needs a cast or a
        reshape, which ``apply`` does from a buffer). A flat bucket must announce one tensor: its bytes are one
        broadcast, which lands in one tensor's memory. The per-tensor wire may announce several, one broadcast each,
        which is how the pusher sends a run of large tensors from their own memory under one announcement."""
        if not names or not len(names) == len(dtypes) == len(shapes) or (flat and len(names) != 1):
            return None
        targets = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            if adapted_weight(name) is not None:
                return None  # kept apart and merged or hooked by ``apply``
            target = self._target(name)
            if target is None or name not in self._expected or dtype != dtype_name(target.dtype):
                return None
            if tuple(target.shape) != tuple(int(d) for d in shape) or not target.is_contiguous():
                return None
            if target.numel() == 0:
                return None
            targets.append(target)
        return targets

    def receive_in_place(
        self, group: WeightGroup, names: list[str], dtypes: list[str], shapes: list[list[int]], *, flat: bool = True,
        on_issued: Callable[[], None] | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive an announcement straight into its targets' memory (``in_place_targets`` must give them): a flat
        bucket of one tensor, or the per-tensor wire's broadcasts, each into its own tensor. Returns
        ``(name, target)`` pairs, which need no ``apply``. The caller keeps forward passes off the model until this
        returns; if the transfer fails, the tensors not yet received keep their old values and the one in flight is
        undefined until a later update writes it. ``on_issued`` is called once every receive has started (the
        group's next receives may start from then on, ``WeightGroup.issue``), before their bytes are in."""
        self.check(names, dtypes, shapes)
        targets = self.in_place_targets(names, dtypes, shapes, flat=flat)
        if targets is None:
            raise EngineError(f"{names} cannot be received in place: every tensor needs a target that is contiguous "
                              "and of the announced dtype and shape, and a flat bucket must hold one tensor")
        if flat:
            # The uint8 view is the parameter's own memory: gloo writes the broadcast there, nothing in between.
            works = group.issue([targets[0].view(-1).view(torch.uint8)], src=0)
        else:
            works = group.issue(targets, src=0)  # the announced order is the order of the sender's broadcasts
        if on_issued is not None:
            on_issued()
        group.wait(works)
        for name in names:
            self.adapters.written(name)
            if self.fp8 is not None:
                self.fp8.written(name)
        with self._pool_lock:
            self.bytes_in_place += sum(t.numel() * t.element_size() for t in targets)
        return list(zip(names, targets))

    def _target(self, name: str) -> torch.Tensor | None:
        if self.fp8 is not None and self.fp8.handles(name):
            return self.fp8.storage(name)
        return self._targets.get(name)

    def recycle(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """The buffer behind tensors from ``receive_flat`` is free again (no-op for others)."""
        if tensors:
            ptr = _storage(tensors[0][1])
            for buffer in self._lent:
                if _storage(buffer) == ptr:
                    self._give_back(buffer)
                    return

    def _take(self, nbytes: int) -> torch.Tensor:
        # Receive buffers are reused from bucket to bucket and push to push: a fresh 64 MB buffer costs more in page
        # faults than its transfer's copy. Kept: two per TP rank (one being received while the other is applied).
        with self._pool_lock:
            for i, buffer in enumerate(self._free):
                if buffer.numel() >= nbytes:
                    self._lent.append(self._free.pop(i))
                    return self._lent[-1]
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            self._lent.append(buffer)
            return buffer

    def _give_back(self, buffer: torch.Tensor) -> None:
        with self._pool_lock:
            self._lent = [b for b in self._lent if b is not buffer]
            self._free.append(buffer)
            self._free = sorted(self._free, key=lambda b: -b.numel())[:4]

    def apply(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy received tensors into the model (casting to the model's dtype), and serve received LoRA adapters;
        call between forward passes."""
        touched: set[str] = set()
        with torch.no_grad():
            for name, tensor in tensors:
                if adapted_weight(name) is not None:
                    touched.add(self.adapters.receive(name, tensor))
                    continue
                if self.fp8 is not None and self.fp8.handles(name):
                    self.fp8.load(name, tensor)  # a float weight is quantized; FP8 bytes are kept as they came
                    continue
                self._targets[name].copy_(tensor)
                self.adapters.written(name)
        self.adapters.refresh(touched)

    def check_complete(self, names: Iterable[str]) -> None:
        """Raise EngineError unless tensors of these (known) names write every element of every model parameter."""
        written: dict[int, int] = {}
        for name in set(names):
            target = self._targets.get(name)
            if target is None:
                continue  # an FP8 weight's scale: its weight counts for it
            written[_storage(target)] = written.get(_storage(target), 0) + target.numel()
        missing = [self._param_name[ptr] for ptr, numel in self._param_numel.items() if written.get(ptr, 0) < numel]
        if missing:
            shown = ", ".join(sorted(missing)[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise EngineError(f"the checkpoint does not cover every parameter of the model (missing {shown})")

    def read_folder(self, folder: str | Path) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of an HF folder's ``*.safetensors`` files, checked to replace the whole model; model untouched.

        Raises EngineError naming the problem: no such folder, no safetensors, unknown names or shapes, or
        parameters the folder does not cover.
        """
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(folder)
        if not path.is_dir():
            raise EngineError(f"model_path {folder} is not a folder; give an HF model folder (config.json and "
                              "*.safetensors)")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise EngineError(f"model_path {folder} holds no *.safetensors file (sluice loads safetensors only, "
                              "never pickled .bin weights)")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                part = load_file(str(f))
            except (SafetensorError, OSError) as exc:
                raise EngineError(f"cannot read {f.name} in {folder}: {exc}") from exc
            twice = sorted(set(part) & set(tensors))
            if twice:
                raise EngineError(f"tensors {twice[:5]} appear in more than one safetensors file of {folder}")
            tensors.update(part)
        names = list(tensors)
        try:
            dtypes = [dtype_name(t.dtype) for t in tensors.values()]
        except SyncError as exc:
            raise EngineError(f"{folder}: {exc}") from exc
        self.check(names, dtypes, [list(t.shape) for t in tensors.values()])
        self.check_complete(names)
        return list(tensors.items())
