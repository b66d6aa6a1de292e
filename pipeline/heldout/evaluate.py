"""The held-out evaluator: it generates on the held-out prompt split with the trainer's weight snapshots and reports
pass@k per policy version.

What is measured
----------------
For every snapshot it evaluates (``RUN_DIR/snapshots/v{version:08d}``, see ``pipeline.consumers.trainer.snapshots``),
each held-out prompt gets one greedy response (temperature 0) and ``samples`` sampled ones (the producer's temperature,
top-p/top-k and ``max_new_tokens`` unless ``[eval.heldout]`` says otherwise). Responses are scored by the run's
reward function; a response passes by the stream evaluator's rule (``reward_info["pass"]``, else reward above
``eval.pass_threshold``). Per version: greedy pass@1, sampled pass@1 (the mean over all samples), pass@k for each
configured k with the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` averaged over prompts (n samples, c of them
passing), mean reward (sampled and greedy), prompt and sample counts, and the seconds taken. One JSON line per
evaluated version goes to ``RUN_DIR/eval/metrics.jsonl``, with ``"kind": "heldout"``, beside the stream
aggregator's ``"kind": "eval"`` lines. A version that already has a line is never evaluated again, so a restarted
evaluator adds no duplicate.

Generation is a real engine's, never a second sampler: by default the evaluator starts a private CPU engine process
(the rollout engines are never used, so evaluation cannot perturb the run's samples) and loads each snapshot into
it with SGLang's ``/update_weights_from_disk``, checking that every response carries the snapshot's version. With
``eval.heldout.engine_url`` the same calls go to that server (an SGLang server on GPU, which must see the run folder
at the same path). Prompt ``i``'s samples are seeded ``seed + i * samples + j``, so figures repeat run to run.

Never slowing the trainer
-------------------------
The evaluator is its own process at a lowered CPU priority (``os.nice``, inherited by its engine), its engine uses
one torch thread, and when it falls behind it jumps to the newest snapshot, marking (and logging) the ones it skipped
so the snapshot writer may prune them. ``sluice eval --run-dir DIR --heldout`` on a finished run evaluates every
snapshot present that has no line yet, skipped ones included; with ``--checkpoints`` it also converts the run's
Megatron checkpoints whose policy version has no line (``megatron_to_hf_state_dict``, one model built once, in this
process) and evaluates them, each line then saying ``"source": "checkpoint"`` and its ``step``.

This consumer drives an engine and scores with the run's reward, so it uses the producers' public pieces (engine
client, prompt split, reward) the way the launcher's processes do; nothing here is imported by the trainer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.config.engine import EngineConfig
from pipeline.config.eval import EvalConfig, EvaluatorConfig
from pipeline.config.metrics import MetricsConfig
from pipeline.config.model import ModelSource
from pipeline.config.producer import BUILTIN_ROLLOUT, ProducerConfig
from pipeline.config.prompts import PromptConfig
from pipeline.config.run import PluginsConfig, RunConfig
from pipeline.config.trainer import TrainStepConfig
from pipeline.consumers.evaluator import reward_passed
from pipeline.consumers.export import CheckpointExporter
from pipeline.consumers.trainer.snapshots import is_done, mark_done
from pipeline.errors import ConfigError, EngineError
from pipeline.metrics import ScalarSink, open_sinks
from pipeline.models.spec import engine_patch_args
from pipeline.rundir import (
    HELDOUT_KIND,
    base_model_source_dir,
    eval_metrics_path,
    heldout_export_path,
    list_snapshots,
    log_path,
    read_heldout,
    run_checkpoints,
    snapshot_name,
    snapshots_dir,
)

if TYPE_CHECKING:
    from pipeline.data.prompts import Prompt
    from pipeline.producers.base import GenerateResult
    from pipeline.producers.rewards import RewardFn, RewardScorer
    from pipeline.producers.rollout import RolloutContext, RolloutFn, TextCodec, Trajectory
    from pipeline.sync.base import EngineReply

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------------ pure figures
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` of ``n`` samples passing: ``1 - C(n-c, k) / C(n, k)``.

    The chance that k samples drawn without replacement from the n include a pass (Chen et al., 2021). Exact
    integer binomials, so no cancellation for large n.
    """
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every draw of k holds a pass
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class PromptOutcome:
    """What one held-out prompt got at one version."""

    prompt_id: str
    greedy_passed: bool
    greedy_reward: float
    passed: list[bool]
    rewards: list[float]
    reward_failures: int = 0
    truncated: int = 0
    response_tokens: int = 0


def _response_tokens(result: GenerateResult | Trajectory) -> int:
    """Tokens the model generated (a trajectory's environment turns are not the model's)."""
    turns = getattr(result, "model_turns", None)
    if turns is not None:
        return sum(len(t.ids) for t in turns)
    return len(result.output_ids)  # type: ignore[union-attr]


def summarize(outcomes: Sequence[PromptOutcome], ks: Sequence[int]) -> dict[str, Any]:
    """The per-version figures of the module docstring (JSON-ready)."""
    if not outcomes:
        raise ValueError("no held-out prompt was evaluated")
    samples = [p for o in outcomes for p in o.passed]
    rewards = [r for o in outcomes for r in o.rewards]
    responses = len(outcomes) + len(samples)  # one greedy per prompt, plus the sampled ones
    return {
        "prompts": len(outcomes),
        "samples": len(samples),
        "greedy_pass1": sum(o.greedy_passed for o in outcomes) / len(outcomes),
        "sampled_pass1": sum(samples) / len(samples) if samples else None,
        "pass_at_k": {str(k): sum(pass_at_k(len(o.passed), sum(o.passed), k) for o in outcomes) / len(outcomes)
                      for k in ks},
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "greedy_reward_mean": sum(o.greedy_reward for o in outcomes) / len(outcomes),
        "reward_failures": sum(o.reward_failures for o in outcomes),
        "truncated": sum(o.truncated for o in outcomes),
        "response_len_mean": sum(o.response_tokens for o in outcomes) / responses,
    }


def plan_live(present: Sequence[tuple[int, Path]], evaluated: set[int],
              marked: set[int]) -> tuple[tuple[int, Path] | None, list[tuple[int, Path]]]:
    """(snapshot to evaluate now, snapshots to skip): the newest one not yet done, and the others not yet done.

    ``evaluated`` are versions with a metrics line, ``marked`` those with a mark (evaluated or skipped before).
    """
    todo = [(v, p) for v, p in present if v not in evaluated and v not in marked]
    if not todo:
        return None, []
    return todo[-1], todo[:-1]


# ------------------------------------------------------------------------------------------------ metrics file
def append_line(path: Path, line: Mapping[str, Any]) -> None:
    """Append one JSON line in a single O_APPEND write (the stream aggregator appends to the same file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


def caught_up(run_dir: str | Path) -> bool:
    """Whether the newest snapshot of a run has its held-out line (True when there is no snapshot)."""
    present = list_snapshots(snapshots_dir(run_dir))
    return not present or present[-1][0] in read_heldout(eval_metrics_path(run_dir))


# --------------------------------------------------------------------------------------------------- the evaluator
@dataclass(frozen=True)
class HeldoutSettings:
    """The resolved sampling and scoring of a held-out evaluation (the recipe's defaults filled in)."""

    samples: int
    pass_k: tuple[int, ...]
    temperature: float
    max_new_tokens: int
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    pass_threshold: float = 0.0
    reward_timeout_s: float = 30.0
    concurrency: int = 16

    @classmethod
    def from_config(cls, evaluation: EvalConfig, producer: ProducerConfig) -> HeldoutSettings:
        """``[eval.heldout]`` with the producer's sampling and the evaluator's pass rule filled in."""
        h, sp = evaluation.heldout, producer.sampling
        return cls(samples=h.samples, pass_k=tuple(h.pass_k),
                   temperature=sp.temperature if h.temperature is None else h.temperature,
                   max_new_tokens=sp.max_new_tokens if h.max_new_tokens is None else h.max_new_tokens,
                   top_p=sp.top_p, top_k=sp.top_k, stop_token_ids=tuple(sp.stop_token_ids), seed=h.seed,
                   pass_threshold=evaluation.pass_threshold, reward_timeout_s=producer.reward_timeout_s,
                   concurrency=h.concurrency)


class HeldoutEngine(Protocol):
    """What the evaluator needs from an engine (``SGLangClient`` has it)."""

    async def generate_many(self, prompts: Sequence[Sequence[int]], sampling_params: Mapping[str, Any], *,
                            return_logprob: bool = True) -> list[GenerateResult]: ...

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | int | None = None,
                                       abort_all_requests: bool = False) -> EngineReply: ...


class HeldoutEvaluator:
    """Evaluates snapshots on the held-out prompts through one engine and appends their lines (module docstring)."""

    def __init__(self, settings: HeldoutSettings, *, engine: HeldoutEngine, prompts: Sequence[Prompt],
                 tokenize: Callable[[str], Sequence[int]], reward_fn: RewardFn | RewardScorer,
                 metrics_path: str | Path,
                 run: str = "", scalars: ScalarSink | None = None, rollout_fn: RolloutFn | None = None,
                 codec: TextCodec | None = None) -> None:
        if not prompts:
            raise ConfigError("the held-out split is empty; set prompts.heldout or prompts.heldout_path")
        self.s = settings
        self.engine = engine
        self.prompts = list(prompts)
        self.prompt_ids = [list(p.input_ids) if p.input_ids is not None else [int(t) for t in tokenize(p.text or "")]
                           for p in self.prompts]
        empty = [p.prompt_id for p, ids in zip(self.prompts, self.prompt_ids) if not ids]
        if empty:
            raise ConfigError(f"held-out prompts {empty[:5]} tokenize to nothing; give them some text")
        self.reward_fn = reward_fn
        self.rollout_fn = rollout_fn
        """The recipe's rollout function (multi-turn, tools); None: one plain request per set of samples."""
        self.codec = codec
        self.metrics_path = Path(metrics_path)
        self.run = run
        self.scalars = scalars  # TensorBoard (and W&B) beside the JSONL, keyed by policy version

    def evaluated(self) -> set[int]:
        """Versions that have a held-out line already."""
        return set(read_heldout(self.metrics_path))

    async def evaluate(self, version: int, folder: str | Path, *, source: str = "snapshot",
                       extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Load ``folder`` into the engine as ``version``, generate, score, append and return the version's line."""
        start = time.perf_counter()
        path = Path(folder).resolve()
        reply = await self.engine.update_weights_from_disk(str(path), weight_version=str(version),
                                                           abort_all_requests=True)
        if not reply.success:
            raise EngineError(f"the evaluation engine could not load {path}: {reply.message}")
        gate = asyncio.Semaphore(self.s.concurrency)
        outcomes = await asyncio.gather(*(self._prompt(i, version, gate) for i in range(len(self.prompts))))
        line: dict[str, Any] = {"kind": HELDOUT_KIND, "time": time.time(), "run": self.run, "version": version,
                                "source": source, "snapshot": path.name, **summarize(outcomes, self.s.pass_k),
                                "samples_per_prompt": self.s.samples, "temperature": self.s.temperature,
                                "max_new_tokens": self.s.max_new_tokens, **(extra or {}),
                                "seconds": round(time.perf_counter() - start, 3)}
        append_line(self.metrics_path, line)
        if self.scalars is not None:
            self.scalars.add(line, version, prefix="heldout/")
        log.info("held-out v%d: greedy pass@1 %.3f, sampled pass@1 %.3f, %s (%d prompts, %.1fs)", version,
                 line["greedy_pass1"], line["sampled_pass1"] or 0.0, line["pass_at_k"], line["prompts"],
                 line["seconds"])
        return line

    async def _prompt(self, i: int, version: int, gate: asyncio.Semaphore) -> PromptOutcome:
        from pipeline.producers.rewards import RewardScorer, score

        s, ids, prompt = self.s, self.prompt_ids[i], self.prompts[i]
        common: dict[str, Any] = {"max_new_tokens": s.max_new_tokens}
        if s.stop_token_ids:
            common["stop_token_ids"] = list(s.stop_token_ids)
        greedy_params = {**common, "temperature": 0.0, "n": 1}
        sampled_params = {**common, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                          "n": s.samples, "sampling_seed": s.seed + i * s.samples}
        async with gate:
            if self.rollout_fn is None:
                greedy, sampled = await asyncio.gather(
                    self.engine.generate_many([ids], greedy_params, return_logprob=False),
                    self.engine.generate_many([ids], sampled_params, return_logprob=False))
                results: list[Any] = [*greedy, *sampled]
                versions = {r.weight_version for r in results}
            else:
                results = await self._rollouts(prompt, ids, greedy_params, sampled_params)
                versions = {v for t in results for turn in t.model_turns for v in turn.versions}
        wrong = versions - {str(version)}
        if wrong:
            raise EngineError(f"held-out responses for v{version} came from weight version(s) {sorted(wrong)}: "
                              "something else loads weights into the evaluation engine; give the evaluator an "
                              "engine of its own (eval.heldout.engine_url)")
        if isinstance(self.reward_fn, RewardScorer):  # a group judge or reward service: the producers' own scorer
            scored = await self.reward_fn.score_group(prompt, [r.text for r in results])
        else:
            scored = await asyncio.gather(*(score(self.reward_fn, prompt, r.text, s.reward_timeout_s)
                                            for r in results))
        verdicts = [not o.failed and reward_passed(o.reward, o.info, s.pass_threshold) for o in scored]
        return PromptOutcome(
            prompt_id=prompt.prompt_id, greedy_passed=verdicts[0], greedy_reward=scored[0].reward,
            passed=verdicts[1:], rewards=[o.reward for o in scored[1:]],
            reward_failures=sum(o.failed for o in scored), truncated=sum(r.finish_reason == "length" for r in results),
            response_tokens=sum(_response_tokens(r) for r in results))

    async def _rollouts(self, prompt: Prompt, ids: list[int], greedy: Mapping[str, Any],
                        sampled: Mapping[str, Any]) -> list[Trajectory]:
        """The greedy trajectory, then the sampled ones, from the recipe's rollout function (as the producer calls
        it, with the evaluation's sampling); a function that fails here fails the evaluation, loudly."""
        from pipeline.producers.rollout import RolloutContext, RolloutEngine

        engine = RolloutEngine(self.engine, self.codec, routing=False)  # type: ignore[arg-type]

        def context(params: Mapping[str, Any]) -> RolloutContext:
            rest = {k: v for k, v in params.items() if k not in ("n", "sampling_seed")}
            return RolloutContext(prompt=prompt, prompt_ids=tuple(ids), n=int(params["n"]), engine=engine,
                                  codec=self.codec, sampling=rest, seed=params.get("sampling_seed"))

        assert self.rollout_fn is not None
        first, rest = await asyncio.gather(self.rollout_fn(context(greedy)), self.rollout_fn(context(sampled)))
        return [*first, *rest]

    async def evaluate_pending(self, root: str | Path) -> list[dict[str, Any]]:
        """Evaluate every snapshot under ``root`` without a line yet, oldest first (a finished run)."""
        done = self.evaluated()
        lines = []
        for version, folder in list_snapshots(root):
            if version not in done:
                lines.append(await self.evaluate(version, folder))
                mark_done(folder, "evaluated")
        return lines

    async def evaluate_checkpoints(self, run_dir: str | Path, exporter: CheckpointExporter) -> list[dict[str, Any]]:
        """Evaluate each Megatron checkpoint of the run whose policy version has no line yet, oldest first."""
        import shutil

        from pipeline.consumers.megatron.checkpoint import read_checkpoint_meta

        done = self.evaluated()
        lines = []
        for ckpt in run_checkpoints(run_dir):
            meta = read_checkpoint_meta(ckpt)
            version = int(meta["policy_version"])
            if version in done:
                continue
            out = heldout_export_path(run_dir, version)
            exporter.export(ckpt, out)
            try:
                lines.append(await self.evaluate(version, out, source="checkpoint",
                                                 extra={"step": int(meta["step"]), "checkpoint": ckpt.name}))
            finally:
                shutil.rmtree(out, ignore_errors=True)  # a converted copy: the checkpoint itself stays the record
            done.add(version)
        return lines

    async def run_live(self, root: str | Path, stop: threading.Event, poll_s: float = 2.0) -> None:
        """Evaluate new snapshots as they appear, newest first when behind, until ``stop`` is set."""
        while not stop.is_set():
            present = list_snapshots(root)
            evaluated = self.evaluated()
            for version, folder in present:
                if version in evaluated and not is_done(folder):
                    mark_done(folder, "evaluated")  # the line was written but the evaluator died before the mark
            target, skipped = plan_live(present, evaluated, {v for v, p in present if is_done(p)})
            for _, folder in skipped:
                mark_done(folder, "skipped")
            if skipped:
                log.warning("held-out evaluation is behind: skipping %s to evaluate %s",
                            [snapshot_name(v) for v, _ in skipped], snapshot_name(target[0]))  # type: ignore[index]
            if target is None:
                await asyncio.to_thread(stop.wait, poll_s)
                continue
            version, folder = target
            task = asyncio.ensure_future(self.evaluate(version, folder))
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if stop.is_set() and not task.done():
                    task.cancel()  # shutting down: this version stays unevaluated and is taken up after a restart
            if task.cancelled():
                return
            try:
                task.result()
            except EngineError:
                if folder.exists():
                    raise
                log.warning("snapshot %s was removed while being evaluated; moving on", folder.name)
                continue
            mark_done(folder, "evaluated")


# ------------------------------------------------------------------------------------------ engine and wiring
@dataclass
class PrivateEngine:
    """A CPU engine process of the evaluator's own, stopped by its PID."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    _log: Any = field(repr=False, default=None)

    @classmethod
    def start(cls, model_dir: Path, log_path: Path, *, dtype: str = "float32", max_batch: int = 32,
              seed: int = 0, timeout_s: float = 120.0, extra_args: Sequence[str] = ()) -> PrivateEngine:
        import httpx

        log_path.parent.mkdir(parents=True, exist_ok=True)
        # The engine binds a port of the OS's choosing and writes it here: a port probed free and handed over could
        # be taken by another process of the run before the engine binds it.
        port_file = log_path.with_name(f".{log_path.stem}.port")
        port_file.unlink(missing_ok=True)
        out = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "pipeline.producers.cpu_engine", str(model_dir), "--host", "127.0.0.1",
               "--port", "0", "--port-file", str(port_file), "--dtype", dtype, "--max-batch", str(max_batch),
               "--num-threads", "1", "--seed", str(seed), "--log-level", "warning", *extra_args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                preexec_fn=_die_with_parent)
        engine = cls(proc, "", log_path, out)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if proc.poll() is not None:
                    raise EngineError(f"the evaluation engine exited with code {proc.returncode}; see {log_path}")
                if not engine.url and port_file.exists():
                    engine.url = f"http://127.0.0.1:{int(port_file.read_text())}"
                try:
                    if engine.url and httpx.get(f"{engine.url}/health", timeout=2.0).status_code == 200:
                        return engine
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise EngineError(f"the evaluation engine did not answer /health within {timeout_s:.0f}s "
                                      f"(eval.heldout.startup_timeout_s); see {log_path}")
                time.sleep(0.2)
        except BaseException:
            engine.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()


def _die_with_parent() -> None:
    # If the evaluator is killed outright (kill -9), its engine must not outlive it: Linux's PR_SET_PDEATHSIG. It
    # fires when the thread that started the engine ends, so start it from a thread that lives as long.
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def _model_dir(run_dir: Path, source: ModelSource) -> Path:
    """The folder the private engine starts from: the run's model, else its first snapshot (both HF folders)."""
    model = base_model_source_dir(run_dir, source)
    if (model / "config.json").is_file():
        return model
    present = list_snapshots(snapshots_dir(run_dir))
    if present:
        return present[0][1]
    raise ConfigError(f"no model to evaluate with: {model} has no config.json and {snapshots_dir(run_dir)} "
                      "holds no snapshot")


@asynccontextmanager
async def open_heldout(run_dir: str | Path, *, evaluation: EvalConfig, producer: ProducerConfig, prompts: PromptConfig,
                       model: ModelSource, engine: EngineConfig, run: RunConfig, plugins: PluginsConfig,
                       metrics: MetricsConfig) -> AsyncIterator[HeldoutEvaluator]:
    """A held-out evaluator of the run, with its engine (a private CPU engine unless ``eval.heldout.engine_url``)."""
    from pipeline.data.prompts import setup_heldout
    from pipeline.producers.producer import load_codec, load_tokenize, resolve_rollout
    from pipeline.producers.rewards import resolve_reward, setup_scorer
    from pipeline.producers.sglang_client import SGLangClient

    run_dir = Path(run_dir)
    h = evaluation.heldout
    held = setup_heldout(prompts)
    chosen = [held[i] for i in range(min(len(held), h.max_prompts or len(held)))]
    model_dir = _model_dir(run_dir, model)
    p = producer
    # The held-out split is scored as the producers score: a group judge sees each prompt's greedy and sampled
    # responses together, a reward service gets them in one request.
    scorer = setup_scorer(p) if p.group_reward is not None or p.reward_url is not None else None
    reward_fn = scorer or resolve_reward(p.reward)
    rollout_fn = None if p.rollout == BUILTIN_ROLLOUT else resolve_rollout(p.rollout)
    private = None
    url = h.engine_url
    if url is None:
        # Started from this (the loop's) thread, not a worker: PR_SET_PDEATHSIG fires when the creating thread ends.
        private = PrivateEngine.start(model_dir, log_path(run_dir, "heldout-engine"), dtype=engine.dtype,
                                      max_batch=h.max_batch, seed=run.seed, timeout_s=h.startup_timeout_s,
                                      extra_args=engine_patch_args(model.engine_patch, plugins.paths))
        url = private.url
    client = SGLangClient(url)
    scalars = open_sinks(run_dir, "evaluator", metrics, run.name)
    try:
        yield HeldoutEvaluator(HeldoutSettings.from_config(evaluation, producer), engine=client, prompts=chosen,
                               tokenize=load_tokenize(model_dir), reward_fn=reward_fn,
                               metrics_path=eval_metrics_path(run_dir), run=run.name, scalars=scalars,
                               rollout_fn=rollout_fn, codec=load_codec(model_dir) if rollout_fn else None)
    finally:
        scalars.close()
        await client.close()
        if scorer is not None:
            await scorer.close()
        if private is not None:
            private.stop()


def lower_priority(nice: int) -> None:
    """Yield the CPU to the trainer: a higher nice value for this process and every child it starts from now on."""
    if nice > 0:
        os.nice(nice)


def evaluate_run(run_dir: str | Path, *, evaluation: EvalConfig, producer: ProducerConfig, prompts: PromptConfig,
                 model: ModelSource, engine: EngineConfig, run: RunConfig, plugins: PluginsConfig,
                 metrics: MetricsConfig, trainer: TrainStepConfig, checkpoints: bool = False) -> list[dict[str, Any]]:
    """``sluice eval --run-dir DIR --heldout [--checkpoints]``: evaluate every snapshot (and, with ``checkpoints``,
    every Megatron checkpoint) whose version has no held-out line, then return the new lines. ``trainer`` gives
    the checkpoints' model its router-replay setting."""
    run_dir = Path(run_dir)
    root = snapshots_dir(run_dir)
    if not list_snapshots(root) and not (checkpoints and run_checkpoints(run_dir)):
        raise ConfigError(f"{root} holds no weight snapshot (a run writes them with eval.heldout.enabled = true)"
                          + ("" if checkpoints else "; add --checkpoints to evaluate the run's checkpoints")
                          + ("; and the run has no checkpoint" if checkpoints else ""))
    lower_priority(evaluation.heldout.nice)

    async def main() -> list[dict[str, Any]]:
        async with open_heldout(run_dir, evaluation=evaluation, producer=producer, prompts=prompts, model=model,
                                engine=engine, run=run, plugins=plugins, metrics=metrics) as evaluator:
            lines = await evaluator.evaluate_pending(root)
            if checkpoints:
                exporter = CheckpointExporter(_model_dir(run_dir, model), run=run, model=model, trainer=trainer)
                try:
                    lines += await evaluator.evaluate_checkpoints(run_dir, exporter)
                finally:
                    exporter.close()
            return lines

    return asyncio.run(main())


def serve_evaluators(run_dir: str | Path, stop: threading.Event, *, evaluation: EvalConfig, producer: ProducerConfig,
                     prompts: PromptConfig, model: ModelSource, engine: EngineConfig, run: RunConfig,
                     plugins: PluginsConfig, metrics: MetricsConfig) -> None:
    """The launcher's evaluator process: the stream aggregator in a thread, live held-out evaluation here.

    Either one failing stops the other and raises, so the process exits non-zero and the launcher restarts it.
    """
    from pipeline.consumers.evaluator import run_eval

    run_dir = Path(run_dir)
    h = evaluation.heldout
    live = h.enabled and h.live
    if live:
        lower_priority(h.nice)
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            fields = evaluation.model_dump(exclude={"enabled", "heldout"})
            scalars = open_sinks(run_dir, "eval-stream", metrics, run.name)
            try:
                run_eval(run_dir=run_dir, config=EvaluatorConfig(**fields), stop=stop, scalars=scalars,
                         start_server=False)
            finally:
                scalars.close()
        except BaseException as exc:  # handed to the main thread, which raises it
            errors.append(exc)
            stop.set()

    thread = threading.Thread(target=stream, name="stream-eval", daemon=True) if evaluation.enabled else None
    if thread is not None:
        thread.start()
    try:
        if live:
            async def main() -> None:
                async with open_heldout(run_dir, evaluation=evaluation, producer=producer, prompts=prompts,
                                        model=model, engine=engine, run=run, plugins=plugins,
                                        metrics=metrics) as evaluator:
                    await evaluator.run_live(snapshots_dir(run_dir), stop, h.poll_s)

            asyncio.run(main())
        else:
            while not stop.wait(0.5):
                pass
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=60)
    if errors:
        raise errors[0]
