"""Four patches that let stock megatron-core 0.16 train on a machine without CUDA, and one more for multi-head latent
attention without TransformerEngine.

Each patch is applied only when CUDA is absent, only on the megatron-core versions it was checked against, and at
most once per process. On a GPU machine ``apply_cpu_shim`` does nothing. ``patch_mla_without_te`` applies whenever
MLA runs on megatron's local spec (no TE), under the same version check.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from importlib.metadata import version as _dist_version
from typing import Any

import torch
from packaging.version import Version

from pipeline.errors import ConfigError

_log = logging.getLogger(__name__)

# Versions whose internals the patches below were written against. 0.19 fixed patch 3 upstream; anything newer must be
# re-checked before it is trusted, so it fails loudly instead of half-patching.
_MIN_VERSION = Version("0.16.0")
_MAX_VERSION_EXCLUSIVE = Version("0.17.0")

_applied = False


def megatron_core_version() -> Version:
    """The installed megatron-core version."""
    return Version(_dist_version("megatron-core"))


def cpu_shim_needed() -> bool:
    """True when there is no usable CUDA device, so megatron-core needs the CPU patches."""
    return not torch.cuda.is_available()


def _check_version() -> None:
    found = megatron_core_version()
    if not (_MIN_VERSION <= found < _MAX_VERSION_EXCLUSIVE):
        raise ConfigError(
            f"sluice's CPU patches for megatron-core were checked against {_MIN_VERSION} <= version < "
            f"{_MAX_VERSION_EXCLUSIVE}, but {found} is installed. Install megatron-core==0.16.1 for CPU runs, "
            "or run on a CUDA machine."
        )


def apply_cpu_shim() -> bool:
    """Patch megatron-core for CPU when CUDA is absent; return whether the patches are in place.

    Idempotent: a second call is a no-op. Must run before any megatron model or process group is built.
    """
    global _applied
    if _applied:
        return True
    if not cpu_shim_needed():
        return False
    _check_version()
    found = megatron_core_version()
    _patch_cuda_device_queries()
    _install_cpu_rng_tracker()
    _define_missing_te_gemm()
    _bypass_alltoall_cuda_streams()
    _applied = True
    _log.info("megatron-core %s patched for CPU (no CUDA device found)", found)
    return True


# --- patch 1: torch.cuda.current_device / synchronize ------------------------------------------------------------


def _patch_cuda_device_queries() -> None:
    # megatron allocates buffers with device=torch.cuda.current_device() in ~250 places (attention, router gate,
    # TP/EP comm buffers). Returning "cpu" sends all of them to host memory; this is only done when CUDA is absent,
    # where the original would raise anyway.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]


# --- patch 2: an RNG tracker on CPU generator states --------------------------------------------------------------


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    tracker = _make_cpu_tracker(mrandom.CudaRNGStatesTracker)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _make_cpu_tracker(base: type) -> Any:
    """Build an instance of a ``CudaRNGStatesTracker`` subclass whose named states are CPU generator states."""

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """megatron's RNG tracker, but ``add``/``fork`` swap the CPU default generator's state.

        Attention dropout forks the tracker even with dropout 0, so a tracker must exist; on CPU the ops draw from
        the default CPU generator, which is therefore the state to swap.
        """

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"RNG seed {seed} is already tracked; each tracked state needs its own seed")
            if name in self.states_:
                raise ValueError(f"RNG state {name!r} is already tracked")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            if name not in self.states_:
                raise ValueError(f"RNG state {name!r} was never added; seed the tracker first (seed_cpu_rng)")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker()


def seed_cpu_rng(seed: int, tp_rank: int, ep_rank: int, etp_rank: int = 0) -> None:
    """Seed the tracked RNG states the way ``model_parallel_cuda_manual_seed`` does, on CPU generators."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    # Same offsets as megatron: TP ranks differ (dropout inside TP regions), EP ranks differ (expert init).
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


# --- patch 3: moe_utils.te_general_gemm -------------------------------------------------------------------------


def _define_missing_te_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    # 0.16.1 imports te_general_gemm only inside its TE try-block but tests `is not None` unconditionally, so every
    # MoE router forward raises NameError without TE. None selects the plain matmul path.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


# --- patch 4: alltoall dispatcher's CUDA side stream ------------------------------------------------------------


def _bypass_alltoall_cuda_streams() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    # __init__ creates a torch.cuda.Stream() only while this class attribute is None; any non-None sentinel skips it.
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _host_dtoh_and_synchronize  # type: ignore[method-assign]


class _NoStream:
    """Placeholder for the dispatcher's device-to-host stream; never used on CPU."""


def _as_numpy(value: Any) -> Any:
    return value.numpy() if torch.is_tensor(value) else value


def _host_dtoh_and_synchronize(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> Any:
    # The GPU version copies the split sizes to host (as numpy) on a side stream at cuda_dtoh_point and waits on an
    # event at cuda_sync_point. On CPU the tensors already live on the host; only the numpy conversion matters, so
    # the all-to-all receives plain split sizes exactly as on GPU.
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        self.input_splits = _as_numpy(self.input_splits)
        self.output_splits = _as_numpy(self.output_splits)
        self.output_splits_tp = _as_numpy(self.output_splits_tp)
    return tokens_per_expert


# --- patch 5: MLA's TransformerEngine checks without TransformerEngine ---------------------------------------------


def patch_mla_without_te() -> bool:
    """Tell megatron's MLA module that TE is absent, when it is; return whether the flag was changed.

    0.16.1's ``multi_latent_attention`` sets ``HAVE_TE = True`` although TE is not installed (its TE names are then
    placeholders), and ``isinstance(x, TELinear)`` on a placeholder raises in every MLA layer's constructor.
    """
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        pass
    else:
        return False
    _check_version()
    from megatron.core.transformer import multi_latent_attention

    changed = bool(multi_latent_attention.HAVE_TE)
    multi_latent_attention.HAVE_TE = False
    return changed
