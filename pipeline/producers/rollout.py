"""Rollout functions: the user code that turns one prompt into the trajectories of its group.

A rollout function is ``async def rollout(ctx: RolloutContext) -> list[Trajectory]``, named in the recipe as
``producer.rollout = "package.module:function"`` (the default, ``pipeline.producers.rollout:single_turn``, is the
built-in one-request generation written as such a function). The producer calls it once per prompt group and turns
each returned trajectory into one ``Sample``.

**Per group, not per sample**, because the first turn of every sample starts from the same prompt: one request with
``n = group_size`` lets the engine prefill the prompt once for the whole group (the single-turn path is exactly the
request the producer always made). Later turns differ per sample; a function continues them concurrently
(``asyncio.gather`` over ``ctx.extend``), and the engine batches concurrent requests anyway.

A trajectory is a list of turns after the prompt:

- **model turns** (``ModelTurn``): tokens the engine sampled, with their log-probs, the weight version of each token
  and the routing of the positions this engine call was the first to process. They are trained on
  (``loss_mask = 1``).
- **environment turns** (``EnvTurn``): tokens the function appended (a tool's output, a user's reply). They are
  context only: ``loss_mask = 0``; their log-prob is a placeholder 0 and their version that of the model token
  before them, so they never move a sample's version range (staleness) and never reach the loss.

**Routing (R3) across turns.** The trainer replays one routing row per position of the final sequence
(``[P + R - 1, layers, topk]``). Each row here comes from the engine call that first processed that position: the
prompt and the first turn's tokens from the first call, an environment turn's tokens and the next model turn's from
the next call (it prefills them), and so on; ``extend`` asks the engine only for those new rows
(``routed_experts_start_len``). That is the routing under which each model token's log-prob was computed whenever
the engine reuses its earlier work (SGLang's radix cache returns the cached rows); an engine that recomputes the
prefix (the CPU engine) routes it again with the same weights, which agrees up to float rounding (tests check it
position by position). A weight push between two turns is the exception: the next call routes the earlier positions
with the new weights, and its tokens were sampled under that routing, while the sample keeps the first one (under
which the earlier turn's tokens were sampled); one row per position cannot serve both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from pipeline.data.prompts import Prompt
from pipeline.errors import EngineError, SampleError
from pipeline.producers.base import EngineClient, GenerateResult

# Later turns of a seeded trajectory get seeds of their own, far from every sample's first-turn seed (seed + j).
_TURN_SEED_STRIDE = 1_000_003
_SEED_MOD = 2**31


class TextCodec(Protocol):
    """Text <-> token ids with the served model's tokenizer (no special tokens added; special tokens not shown)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class ModelTurn:
    """Tokens the engine sampled in one call: trained on."""

    ids: np.ndarray
    """int32[R], the sampled tokens (a stop token or the tokens of a matched stop string included)."""
    logprobs: np.ndarray
    """float32[R], their log-probs under the engine's sampling distribution."""
    versions: tuple[str, ...]
    """The engine's weight version of each token (a generation can span a weight push)."""
    routing: np.ndarray | None
    """int32[rows, layers, topk]: the rows of the positions this call was the first to process; None without MoE."""
    finish_reason: str
    """``stop``, ``length`` or ``abort``."""
    finish_detail: Mapping[str, Any]
    """The engine's whole finish reason (``matched`` names a stop token or string)."""
    text: str
    """The tokens' text, stop string included (the producer's tokenizer decodes them)."""
    engine_text: str
    """The text the engine returned (SGLang cuts it before a matched stop string)."""
    engine: str
    """Base URL of the engine that served the call."""


@dataclass(frozen=True)
class EnvTurn:
    """Tokens the rollout function appended (tool output, a user reply): context, never trained on."""

    ids: np.ndarray
    """int32[E]."""
    text: str


@dataclass
class Trajectory:
    """One sample in the making: the prompt, then model and environment turns in order."""

    prompt_ids: np.ndarray
    turns: list[ModelTurn | EnvTurn] = field(default_factory=list)
    seed: int | None = None
    """The sampling seed of its first turn (later turns derive theirs from it); None: unseeded."""
    text_override: str | None = None
    """The response text the reward sees, when not the turns' texts joined (the built-in path keeps the engine's)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Small JSON-able facts about the rollout (tool calls, turns), merged into the sample's reward_info."""

    @property
    def ids(self) -> list[int]:
        """The whole sequence so far (prompt and every turn): what the next model turn continues."""
        out = [int(t) for t in self.prompt_ids]
        for turn in self.turns:
            out.extend(int(t) for t in turn.ids)
        return out

    @property
    def model_turns(self) -> list[ModelTurn]:
        return [t for t in self.turns if isinstance(t, ModelTurn)]

    @property
    def text(self) -> str:
        """The response's text: every turn after the prompt, in order."""
        if self.text_override is not None:
            return self.text_override
        return "".join(t.text for t in self.turns)

    @property
    def routing_rows(self) -> int:
        """Routing rows recorded so far (the next call's ``routed_experts_start_len``)."""
        return sum(len(t.routing) for t in self.model_turns if t.routing is not None)

    @property
    def finish_reason(self) -> str:
        """The last model turn's finish reason (``abort`` for a trajectory with none)."""
        turns = self.model_turns
        return turns[-1].finish_reason if turns else "abort"

    @property
    def engine(self) -> str:
        turns = self.model_turns
        return turns[-1].engine if turns else ""

    def add_model(self, turn: ModelTurn) -> ModelTurn:
        """Append a model turn generated from exactly ``self.ids`` (what ``RolloutContext.extend`` does)."""
        self.turns.append(turn)
        return turn

    def add_env(self, ids: Sequence[int], text: str) -> EnvTurn:
        """Append environment tokens (masked out of the loss); ``RolloutContext.add_env_text`` tokenizes for you."""
        turn = EnvTurn(np.asarray(ids, dtype=np.int32), text)
        if len(turn.ids):
            self.turns.append(turn)
        return turn

    def flatten(self) -> FlatTrajectory:
        """The response as the per-token arrays a ``Sample`` holds; SampleError when its routing does not cover
        exactly the final sequence's P + R - 1 positions.

        Environment turns after the last model turn are left out of the sample (the reward still sees their text):
        no model token comes after them, so they condition nothing that is trained, and no engine call ever
        processed them, so they have no routing to replay.
        """
        if not self.model_turns:
            raise SampleError("the trajectory has no model turn; a rollout must generate at least once")
        last_model = max(i for i, t in enumerate(self.turns) if isinstance(t, ModelTurn))
        ids, logprobs, mask, versions = [], [], [], []
        last_version = self.model_turns[0].versions[0] if self.model_turns[0].versions else "0"
        for turn in self.turns[: last_model + 1]:
            ids.append(turn.ids)
            if isinstance(turn, ModelTurn):
                logprobs.append(turn.logprobs)
                mask.append(np.ones(len(turn.ids), dtype=np.uint8))
                versions.extend(turn.versions)
                last_version = turn.versions[-1] if turn.versions else last_version
            else:
                # Placeholders: masked tokens never reach the loss. The version is the preceding model token's, so
                # version_min/max (staleness, pacing) are those of the model's own tokens.
                logprobs.append(np.zeros(len(turn.ids), dtype=np.float32))
                mask.append(np.zeros(len(turn.ids), dtype=np.uint8))
                versions.extend([last_version] * len(turn.ids))
        response = np.concatenate(ids).astype(np.int32)
        routing = None
        chunks = [t.routing for t in self.model_turns]
        if all(c is not None for c in chunks):
            routing = np.concatenate([c for c in chunks if c is not None])
            expected = len(self.prompt_ids) + len(response) - 1
            if len(routing) != expected:
                raise SampleError(f"the trajectory's routing has {len(routing)} rows but its sequence needs "
                                  f"P + R - 1 = {expected}; a model turn was not generated from the whole "
                                  "trajectory so far (use RolloutContext.extend)")
        return FlatTrajectory(
            response_ids=response,
            logprobs=np.concatenate(logprobs).astype(np.float32),
            loss_mask=np.concatenate(mask),
            versions=tuple(versions),
            routing=routing,
        )


@dataclass(frozen=True)
class FlatTrajectory:
    """A trajectory's response as per-token arrays (what the producer puts in a ``Sample``)."""

    response_ids: np.ndarray
    logprobs: np.ndarray
    loss_mask: np.ndarray
    versions: tuple[str, ...]
    routing: np.ndarray | None


class RolloutEngine:
    """The engines, as a rollout function sees them: each call returns the model turns it generated."""

    def __init__(self, client: EngineClient, codec: TextCodec | None, *, routing: bool) -> None:
        self._client = client
        self._codec = codec
        self.routing = routing
        """Whether routing is asked for (an MoE model and ``producer.return_routed_experts``)."""
        self.errors: list[BaseException] = []
        """What the engine calls raised: the producer tells an engine's failure (try the prompt again) from the
        rollout function's own (skip it) by these."""

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], *, n: int = 1,
                       routing_from: int = 0) -> list[ModelTurn]:
        """``n`` continuations of ``input_ids`` in one request; ``routing_from`` skips that many leading routing
        rows (positions an earlier call already recorded)."""
        try:
            results = await self._client.generate_many(
                [list(input_ids)], {**sampling_params, "n": n}, return_logprob=True,
                return_routed_experts=self.routing, routed_experts_start_len=routing_from,
            )  # fmt: skip
        except Exception as e:
            self.errors.append(e)
            raise
        return [self._turn(r) for r in results]

    def raised(self, error: BaseException) -> bool:
        """Whether ``error`` (or what it was raised from) came out of one of this handle's engine calls."""
        seen: BaseException | None = error
        while seen is not None:
            if any(seen is e for e in self.errors):
                return True
            seen = seen.__cause__ or seen.__context__
        return False

    def _turn(self, r: GenerateResult) -> ModelTurn:
        if r.output_logprobs is None:
            raise SampleError(f"engine {r.engine} returned no output logprobs; sluice needs return_logprob")
        ids = np.asarray(r.output_ids, dtype=np.int32)
        # The engine's text may be cut before a matched stop string; a multi-turn text needs every token's.
        text = self._codec.decode(ids.tolist()) if self._codec is not None else r.text
        return ModelTurn(ids=ids, logprobs=np.asarray(r.output_logprobs, dtype=np.float32),
                         versions=tuple(r.token_versions()), routing=r.routed_experts,
                         finish_reason=r.finish_reason, finish_detail=dict(r.finish_detail), text=text,
                         engine_text=r.text, engine=r.engine)


@dataclass
class RolloutContext:
    """What a rollout function gets for one prompt group."""

    prompt: Prompt
    """The prompt (its text, answer and metadata)."""
    prompt_ids: tuple[int, ...]
    n: int
    """Trajectories to return: the group size."""
    engine: RolloutEngine
    codec: TextCodec | None
    """The served model's tokenizer (None when the producer has none: token-id prompts only)."""
    sampling: dict[str, Any]
    """The recipe's SGLang ``sampling_params`` (without ``n`` and ``sampling_seed``)."""
    seed: int | None
    """The group's base seed: sample j's first turn uses seed + j. None: unseeded."""

    async def start(self, **overrides: Any) -> list[Trajectory]:
        """The group's first turn: ``n`` samples of the prompt in one request (``overrides`` change sampling
        params, e.g. ``stop=["</calc>"]``)."""
        params = {**self.sampling, **overrides}
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        turns = await self.engine.generate(self.prompt_ids, params, n=self.n)
        if len(turns) != self.n:
            raise EngineError(f"asked for {self.n} samples of one prompt, the engine returned {len(turns)}")
        prompt = np.asarray(self.prompt_ids, dtype=np.int32)
        out = []
        for j, turn in enumerate(turns):
            traj = Trajectory(prompt, seed=None if self.seed is None else self.seed + j)
            traj.add_model(turn)
            out.append(traj)
        return out

    async def extend(self, traj: Trajectory, **overrides: Any) -> ModelTurn:
        """Generate the next model turn of ``traj`` from everything in it so far, and append it."""
        params = {**self.sampling, **overrides}
        if traj.seed is not None:
            k = len(traj.model_turns)
            params["sampling_seed"] = (traj.seed + k * _TURN_SEED_STRIDE) % _SEED_MOD
        (turn,) = await self.engine.generate(traj.ids, params, n=1, routing_from=traj.routing_rows)
        return traj.add_model(turn)

    def add_env_text(self, traj: Trajectory, text: str) -> EnvTurn:
        """Tokenize ``text`` and append it to ``traj`` as an environment turn."""
        if self.codec is None:
            raise SampleError("add_env_text needs the model's tokenizer; the producer has none (use add_env)")
        return traj.add_env(self.codec.encode(text), text)


RolloutFn = Callable[[RolloutContext], Awaitable[list[Trajectory]]]


async def single_turn(ctx: RolloutContext) -> list[Trajectory]:
    """The built-in rollout: one request of ``n`` samples, each one model turn, the reward seeing the engine's
    text."""
    trajectories = await ctx.start()
    for traj in trajectories:
        traj.text_override = traj.model_turns[0].engine_text
    return trajectories
