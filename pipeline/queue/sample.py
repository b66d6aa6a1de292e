"""The Sample: one trajectory, with everything the trainer needs to train on it off-policy."""

from __future__ import annotations

import enum
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.errors import SampleError

#: Field name -> the dtypes it may hold. Arrays are always little-endian on the wire and in the archive.
ARRAY_DTYPES: dict[str, tuple[np.dtype[Any], ...]] = {
    "prompt_ids": (np.dtype("<i4"),),
    "response_ids": (np.dtype("<i4"),),
    "rollout_logprobs": (np.dtype("<f4"),),
    "loss_mask": (np.dtype("u1"),),
    "token_versions": (np.dtype("<i4"),),
    "routed_experts": (np.dtype("u1"), np.dtype("<u2")),
}

#: Reward info must stay small: it rides in every queue entry.
MAX_REWARD_INFO_BYTES = 16 * 1024


class SampleStatus(str, enum.Enum):
    """How a generation ended. Only ``completed`` and ``truncated`` samples carry a trainable outcome."""

    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


def routing_dtype(num_experts: int) -> np.dtype[Any]:
    """The compact dtype for expert ids: uint8 up to 256 experts, uint16 up to 65536."""
    if num_experts < 1:
        raise SampleError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 256:
        return np.dtype("u1")
    if num_experts <= 65536:
        return np.dtype("<u2")
    raise SampleError(f"num_experts={num_experts} does not fit uint16 routing ids; at most 65536 experts are supported")


def compact_routing(routed_experts: np.ndarray, num_experts: int) -> np.ndarray:
    """Convert engine routing ids (int32 from SGLang) to the compact dtype, checking every id is < num_experts."""
    ids = np.asarray(routed_experts)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise SampleError(
            f"routed_experts holds ids in [{int(ids.min())}, {int(ids.max())}], outside [0, {num_experts}); "
            "is num_experts the model's expert count?"
        )
    return np.ascontiguousarray(ids, dtype=routing_dtype(num_experts))


@dataclass(frozen=True)
class SamplingInfo:
    """The sampling parameters a sample was generated with (provenance; replay and eval read them)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 0
    seed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingInfo:
        unknown = set(d) - {"temperature", "top_p", "top_k", "max_new_tokens", "seed"}
        if unknown:
            raise SampleError(f"sampling: unknown keys {sorted(unknown)}")
        seed = d.get("seed")
        return cls(
            temperature=float(d.get("temperature", 1.0)),
            top_p=float(d.get("top_p", 1.0)),
            top_k=int(d.get("top_k", -1)),
            max_new_tokens=int(d.get("max_new_tokens", 0)),
            seed=None if seed is None else int(seed),
        )


def _new_id() -> str:
    return uuid.uuid4().hex


@dataclass(eq=False)
class Sample:
    """One trajectory: prompt and response tokens, behaviour log-probs, per-token policy versions, routing, reward.

    Arrays are numpy, little-endian, in the dtypes of ``ARRAY_DTYPES``. ``routed_experts`` has shape
    ``[P + R - 1, moe_layers, topk]`` in SGLang's order (every position whose next token the model predicted) and is
    ``None`` for dense models. Construction validates everything, so an invalid Sample never reaches the queue.
    Arrays decoded from the queue are read-only views of the payload; copy one before writing to it.
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    rollout_logprobs: np.ndarray
    token_versions: np.ndarray
    loss_mask: np.ndarray | None = None
    routed_experts: np.ndarray | None = None
    reward: float = 0.0
    reward_info: dict[str, Any] = field(default_factory=dict)
    status: SampleStatus = SampleStatus.COMPLETED
    finish_reason: str = ""
    sample_id: str = field(default_factory=_new_id)
    group_id: str = ""
    prompt_id: str = ""
    index: int = 0
    producer: str = ""
    engine: str = ""
    created_at: float = field(default_factory=time.time)
    sampling: SamplingInfo = field(default_factory=SamplingInfo)

    def __post_init__(self) -> None:
        self.prompt_ids = _as_array("prompt_ids", self.prompt_ids)
        self.response_ids = _as_array("response_ids", self.response_ids)
        self.rollout_logprobs = _as_array("rollout_logprobs", self.rollout_logprobs)
        self.token_versions = _as_array("token_versions", self.token_versions)
        if self.loss_mask is None:
            self.loss_mask = np.ones(len(self.response_ids), dtype="u1")
        self.loss_mask = _as_array("loss_mask", self.loss_mask)
        if self.routed_experts is not None:
            self.routed_experts = _as_array("routed_experts", self.routed_experts)
        if isinstance(self.status, str) and not isinstance(self.status, SampleStatus):
            try:
                self.status = SampleStatus(self.status)
            except ValueError:
                raise SampleError(
                    f"status: {self.status!r} is not one of {[s.value for s in SampleStatus]}"
                ) from None
        if isinstance(self.sampling, dict):
            self.sampling = SamplingInfo.from_dict(self.sampling)
        self.validate()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)

    @property
    def version_min(self) -> int | None:
        """Oldest policy version that produced any response token; None for an empty response."""
        return int(self.token_versions.min()) if len(self.token_versions) else None

    @property
    def version_max(self) -> int | None:
        """Newest policy version that produced any response token; None for an empty response."""
        return int(self.token_versions.max()) if len(self.token_versions) else None

    def validate(self) -> None:
        """Raise SampleError naming the first field that is inconsistent."""
        for name in ("prompt_ids", "response_ids", "rollout_logprobs", "loss_mask", "token_versions"):
            arr = getattr(self, name)
            if arr.ndim != 1:
                raise SampleError(f"{name}: expected a 1-D array, got shape {arr.shape}")
        r = len(self.response_ids)
        for name in ("rollout_logprobs", "loss_mask", "token_versions"):
            n = len(getattr(self, name))
            if n != r:
                raise SampleError(f"{name}: has {n} entries but response_ids has {r}; they must be one per token")
        p = len(self.prompt_ids)
        if p == 0:
            raise SampleError("prompt_ids: empty; a sample needs at least one prompt token")
        if r and int(self.token_versions.min()) < 0:
            raise SampleError(f"token_versions: negative version {int(self.token_versions.min())}; versions start at 0")
        if r and not np.all(self.loss_mask <= 1):
            raise SampleError("loss_mask: values must be 0 or 1")
        if r and not np.all(self.rollout_logprobs <= 1e-4):
            # Tiny positive values come from fp rounding of log(1); anything larger is not a log-probability.
            raise SampleError(f"rollout_logprobs: max {float(self.rollout_logprobs.max())} > 0; not a log-probability")
        if r and np.isnan(self.rollout_logprobs).any():
            raise SampleError("rollout_logprobs: contains NaN")
        if self.routed_experts is not None:
            re = self.routed_experts
            if re.ndim != 3:
                raise SampleError(f"routed_experts: expected shape [P+R-1, layers, topk], got {re.shape}")
            if re.shape[0] != p + r - 1:
                raise SampleError(
                    f"routed_experts: has {re.shape[0]} rows but P+R-1 = {p}+{r}-1 = {p + r - 1}; "
                    "it must hold one row per position whose next token the model predicted"
                )
        if not isinstance(self.reward, (int, float)) or isinstance(self.reward, bool):
            raise SampleError(f"reward: expected a float, got {type(self.reward).__name__}")
        self.reward = float(self.reward)
        if math.isnan(self.reward):
            raise SampleError("reward: is NaN; a reward function that fails should mark the sample 'failed'")
        _check_info(self.reward_info)
        for name in ("sample_id", "group_id", "prompt_id", "finish_reason", "producer", "engine"):
            if not isinstance(getattr(self, name), str):
                raise SampleError(f"{name}: expected a string, got {type(getattr(self, name)).__name__}")
        if not self.sample_id:
            raise SampleError("sample_id: empty; it is the idempotency key and must be unique")
        if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
            raise SampleError(f"index: expected an int >= 0, got {self.index!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        for name in ARRAY_DTYPES:
            a, b = getattr(self, name), getattr(other, name)
            if (a is None) != (b is None):
                return False
            if a is not None and (a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b, equal_nan=True)):
                return False
        scalars = ("reward", "reward_info", "status", "finish_reason", "sample_id", "group_id", "prompt_id", "index",
                   "producer", "engine", "created_at", "sampling")
        return all(getattr(self, n) == getattr(other, n) for n in scalars)


def _as_array(name: str, value: Any) -> np.ndarray:
    allowed = ARRAY_DTYPES[name]
    arr = np.asarray(value)
    if arr.dtype in allowed:
        return arr if arr.dtype.byteorder != ">" else arr.astype(arr.dtype.newbyteorder("<"))
    if arr.size == 0 and arr.dtype == np.float64:
        # An empty Python list has no dtype of its own.
        return arr.astype(allowed[0])
    target = allowed[0]
    if arr.dtype.kind in "iu" and target.kind in "iu":
        info = np.iinfo(target)
        if arr.size and (int(arr.min()) < info.min or int(arr.max()) > info.max):
            raise SampleError(f"{name}: values in [{int(arr.min())}, {int(arr.max())}] do not fit {target}")
        if name == "routed_experts":
            raise SampleError(
                f"routed_experts: dtype {arr.dtype}; convert engine ids with compact_routing(ids, num_experts) "
                "to uint8 (<= 256 experts) or uint16"
            )
        return arr.astype(target)
    if arr.dtype.kind == "f" and target.kind == "f":
        return arr.astype(target)
    raise SampleError(f"{name}: dtype {arr.dtype} is not allowed; expected one of {[str(d) for d in allowed]}")


def _check_info(info: Any) -> None:
    if not isinstance(info, dict):
        raise SampleError(f"reward_info: expected a dict, got {type(info).__name__}")
    _check_json_like(info, "reward_info")


def _check_json_like(value: Any, path: str) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_json_like(v, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise SampleError(f"{path}: keys must be strings, got {type(k).__name__} {k!r}")
            _check_json_like(v, f"{path}.{k}")
        return
    # The archive stores reward_info as JSON, so only JSON-shaped values round-trip exactly.
    raise SampleError(f"{path}: {type(value).__name__} is not allowed; use str, int, float, bool, None, list or dict")
