"""``sluice bench gpu``: one prepared command that measures the trainer, its memory plan, R3 and the engine on a GPU,
and runs the same path on CPU with the tiny models, so that CI keeps it from rotting.

Parts, run in this order, each written to ``OUT/<part>.json`` as soon as it ends; a part that raises is recorded
there with its error and the next part runs. ``OUT/summary.json`` holds every headline figure, the failed parts
and the software versions; while a part runs it names that part under ``running``, so that after a crash of the
process ``--resume`` records the part as failed and runs the rest (``scripts/gpu-check.sh`` does this).

- **trainer**: a Qwen3-MoE built locally from a config (CUDA: 16 layers, hidden 1024, 64 experts top-8, about 1.2B
  parameters and 0.5B active; CPU: the tiny model's config), megatron-core's ``GPTModel`` from sluice's builders, and
  the trainer's own ``TrainStep`` (megatron's DDP and distributed optimizer over bf16 parameters on CUDA, torch AdamW
  on CPU), with the GRPO/PPO loss, R3 and the GPU recipe's icepop correction, on one fixed batch of synthetic prompt
  groups shaped like the GPU recipe's (groups of 16, micro-batches of 4 samples and at most 4096 tokens). The
  samples carry the routing the model itself chooses for them and, as behaviour log-probs, its own log-probs before
  the first step, as an engine holding these weights would report them. Per step: wall time, tokens/s, model FLOP
  utilization, the loss (which must fall: the importance weight of each token follows the policy away from the
  behaviour one), the gradient norm and R3's agreement. On CUDA also the memory after each stage of the build and
  each step's peak.
- **dense**: the same path with a dense Qwen3 whose MLPs make as many FLOPs per token as the MoE's active experts, so
  that a failure of the MoE parts can be told apart from one of the trainer itself.
- **memory** (CUDA only): the measured parameters, gradients, optimizer state and activations of both models against
  ``plan_memory`` (what ``sluice run --dry-run`` prints) for the same layout and largest micro-batch.
- **r3**: routing recorded by megatron's router replay, replayed (agreement with the record must be 1.0), and the
  same after perturbing every weight by 5% of its spread, with and without replay; k3 between the log-probs.
- **engine**: the CPU engine's generator (``producers/cpu_engine``) on the device, over an HF model with the weights
  the trainer loads (sampling, log-probs and routing as the engine serves them); the trainer's log-probs of the same
  tokens with and without replaying the engine's routing, k3 between the two, the trainer's own routing agreement
  with the engine's, and the decode rate.
- **tests** (CUDA only): ``pytest -m gpu`` over the test files in ``GPU_TESTS``, the checks of paths that only a GPU
  reaches (megatron's DDP and distributed optimizer in the trainer's updater); the part fails when any test fails.

FLOPs (``forward_flops``): 2 per multiply-add of every weight a token passes through (its top-k experts only, the
output layer included, the input embedding not, being a lookup), plus causal attention's two products, counted over
the real tokens only (padding is not useful work). A training step counts 3 forwards for the trained pass (forward
and backward), 1 for the proximal pass and, for a MoE model, 1 for R3's measuring pass. Utilization divides by
790 TFLOP/s, the bf16 matmul rate measured on the H200 (and H100) machines this check is for.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pipeline.models.config import ModelConfig
    from pipeline.queue.sample import Sample

PARTS: tuple[str, ...] = ("trainer", "dense", "memory", "r3", "engine", "tests")
PEAK_BF16_FLOPS = 790e12
GIB = 1 << 30
PERTURBATION = 0.05  # relative noise on every weight in the R3 part: "the trainer has moved on since generation"


@dataclass
class GpuCheckParams:
    """What one ``sluice bench gpu`` runs."""

    out: str = "gpu-check"
    """Folder for the JSON files: one per part and summary.json."""
    device: str = "auto"
    """cuda, cpu, or auto (cuda when torch sees a GPU)."""
    parts: str = ",".join(PARTS)
    """Comma-separated parts to run, in the order of PARTS."""
    steps: int = 0
    """Training steps of the MoE trainer part (the dense part runs half as many); 0: 20."""
    resume: bool = False
    """Keep the parts already written in ``out`` and run only the others (after the process died in one)."""


@dataclass(frozen=True)
class Sizes:
    """The models and batches of one device."""

    moe: dict[str, Any]
    """HF config values of the Qwen3-MoE model (over the tiny model's)."""
    dense: dict[str, Any]
    """HF config values of the dense Qwen3 model."""
    dtype: str
    groups: int
    group_size: int
    prompt_len: int
    response_len: tuple[int, int]
    """Response lengths are drawn uniformly from this closed range."""
    micro_batch_samples: int
    micro_batch_tokens: int | None
    lr: float
    steps: int
    r3_rows: int
    r3_len: int
    engine_groups: int
    engine_prompt_len: int
    engine_new_tokens: int
    temperature: float = 1.0


_ARCH_CUDA: dict[str, Any] = dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                                  num_key_value_heads=4, head_dim=128, max_position_embeddings=4096,
                                  initializer_range=0.02)


def sizes_for(device: str, steps: int = 0) -> Sizes:
    """The check's sizes on ``device``: on CUDA about two minutes of training; on CPU the tiny models, seconds."""
    if device == "cuda":
        # intermediate_size 2048 = 8 experts of 256: the dense model makes the MoE's active FLOPs per token.
        return Sizes(moe={**_ARCH_CUDA, "num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 256,
                          "intermediate_size": 2048},
                     dense={**_ARCH_CUDA, "intermediate_size": 2048}, dtype="bfloat16", groups=4, group_size=16,
                     prompt_len=256, response_len=(256, 768), micro_batch_samples=4, micro_batch_tokens=4096,
                     lr=1e-5, steps=steps or 20, r3_rows=8, r3_len=512, engine_groups=8, engine_prompt_len=128,
                     engine_new_tokens=128)
    return Sizes(moe={"vocab_size": 128}, dense={"vocab_size": 128}, dtype="float32", groups=2, group_size=4,
                 prompt_len=8, response_len=(4, 12), micro_batch_samples=4, micro_batch_tokens=None, lr=2e-4,
                 steps=steps or 20, r3_rows=4, r3_len=24, engine_groups=2, engine_prompt_len=8, engine_new_tokens=8)


@dataclass
class Context:
    """What every part is given."""

    out: Path
    device: str
    sizes: Sizes
    seed: int = 0


# ------------------------------------------------------------------------------------------------------- the runner


def run_gpu_check(params: GpuCheckParams) -> dict[str, Any]:
    """Run the parts, writing each one's JSON as it ends; returns the summary (also written to summary.json)."""
    out = Path(params.out)
    out.mkdir(parents=True, exist_ok=True)
    device = _resolve_device(params.device)
    parts = _parse_parts(params.parts)
    ctx = Context(out=out, device=device, sizes=sizes_for(device, params.steps))
    summary_path = out / "summary.json"
    if params.resume:
        _record_death(out, summary_path)
    for part in parts:
        path = out / f"{part}.json"
        if params.resume and path.exists():
            continue
        _write_json(summary_path, {**summarize(out, parts, device), "running": part})
        result = _run_part(part, ctx)
        _write_json(path, result)
        print(_part_line(part, result), flush=True)
    summary = summarize(out, parts, device)
    _write_json(summary_path, summary)
    _shutdown()
    return summary


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: choose cpu, cuda or auto")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but torch sees no CUDA device; run with --device cpu on this machine")
    return device


def _parse_parts(text: str) -> list[str]:
    wanted = [p.strip() for p in text.split(",") if p.strip()]
    unknown = sorted(set(wanted) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    return [p for p in PARTS if p in wanted]


def _record_death(out: Path, summary_path: Path) -> None:
    """After the process died inside a part, record that part as failed so the resumed run goes past it."""
    if not summary_path.exists():
        return
    running = json.loads(summary_path.read_text()).get("running")
    if running and not (out / f"{running}.json").exists():
        _write_json(out / f"{running}.json", {
            "ok": False, "error": "the process died during this part (killed, a fatal CUDA error or out of host "
                                  "memory; the log has its last words); the run resumed after it"})


def _run_part(part: str, ctx: Context) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        result = {"ok": True, **_PART_FUNCS[part](ctx)}
    except Exception as err:  # the check's purpose: record what failed, then measure the other parts
        result = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
    result["seconds"] = round(time.perf_counter() - start, 2)
    _free(ctx.device)
    return result


def summarize(out: Path, parts: Sequence[str], device: str) -> dict[str, Any]:
    """Headline figures of every part written so far, the failed ones with their errors, and the versions."""
    headline: dict[str, Any] = {}
    failed: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for part in parts:
        path = out / f"{part}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        seconds[part] = data.get("seconds", 0.0)
        if data.get("ok"):
            headline[part] = data.get("headline", {})
        else:
            failed[part] = data.get("error", "unknown")
    missing = [p for p in parts if p not in headline and p not in failed]
    return {"device": device, "headline": headline, "failed": failed, "not_run": missing, "seconds": seconds,
            "environment": environment(device)}


def _part_line(part: str, result: dict[str, Any]) -> str:
    if not result["ok"]:
        return f"{part:8s} FAILED after {result['seconds']:.1f} s: {result['error']}"
    shown = ", ".join(f"{k} {_fmt(v)}" for k, v in result.get("headline", {}).items())
    return f"{part:8s} {result['seconds']:6.1f} s  {shown}"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} {_fmt(v)}" for k, v in value.items()) + "}"
    return str(value)


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary for a person: one line per part, then the failures."""
    lines = [f"gpu check on {summary['environment'].get('gpu') or summary['device']}"]
    for part, figures in summary["headline"].items():
        lines.append(f"  {part:8s} " + ", ".join(f"{k} {_fmt(v)}" for k, v in figures.items()))
    for part, error in summary["failed"].items():
        lines.append(f"  {part:8s} FAILED: {error}")
    if summary["not_run"]:
        lines.append(f"  not run: {', '.join(summary['not_run'])}")
    return lines


def environment(device: str) -> dict[str, Any]:
    """Versions and the device, so that figures from different machines are never compared unawares."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("megatron-core", "transformers", "pydantic", "numpy"):
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            info[dist] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GIB, 1), cuda=torch.version.cuda)
        try:
            import transformer_engine  # noqa: F401

            info["transformer_engine"] = True
        except ImportError:
            info["transformer_engine"] = False
    return info


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    tmp.replace(path)


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        from pipeline.consumers.megatron.model import shutdown_parallel

        shutdown_parallel()


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------- models and batches


def model_config(arch: str, values: dict[str, Any], dtype: str) -> tuple[Any, ModelConfig]:
    """(the transformers config, sluice's ModelConfig) of a Qwen3 (``arch`` "qwen3") or Qwen3-MoE ("qwen3-moe")
    with ``values`` over the tiny model's defaults: nothing is read from disk or a hub."""
    from pipeline.models.config import ModelConfig
    from pipeline.models.families import family_for_tiny

    hf = family_for_tiny(arch).tiny_config(arch, dict(values))
    return hf, ModelConfig.from_hf(hf.to_dict(), dtype=dtype)  # type: ignore[arg-type]


def _megatron(cfg: ModelConfig, device: str, *, r3: bool, seed: int) -> Any:
    from pipeline.consumers.megatron.config import ParallelConfig
    from pipeline.consumers.megatron.model import build_gpt_model, init_parallel

    parallel = ParallelConfig(device=device)  # type: ignore[arg-type]
    init_parallel(parallel, seed=seed)
    return build_gpt_model(cfg, parallel, r3=r3)


def synthetic_groups(cfg: ModelConfig, sizes: Sizes, seed: int) -> list[list[Sample]]:
    """Prompt groups of random tokens (one prompt per group, responses of random lengths) and random rewards; their
    log-probs and routing are filled in by the model afterwards."""
    import numpy as np

    from pipeline.queue.sample import Sample, SamplingInfo

    rng = np.random.default_rng(seed)
    low, high = sizes.response_len
    groups = []
    for g in range(sizes.groups):
        prompt = rng.integers(4, cfg.vocab_size, sizes.prompt_len).astype(np.int32)
        group = []
        for i in range(sizes.group_size):
            r = int(rng.integers(low, high + 1))
            group.append(Sample(
                prompt_ids=prompt, response_ids=rng.integers(4, cfg.vocab_size, r).astype(np.int32),
                rollout_logprobs=np.zeros(r, np.float32), token_versions=np.zeros(r, np.int32),
                reward=float(rng.random()), group_id=f"g{g}", index=i,
                sampling=SamplingInfo(temperature=sizes.temperature, max_new_tokens=high),
            ))  # fmt: skip
        groups.append(group)
    return groups


def record_own_routing(model: Any, cfg: ModelConfig, samples: Sequence[Sample], rows: int) -> None:
    """Give every sample the routing the model itself chooses for its tokens, as an engine holding these weights
    would report it (``[P + R - 1, layers, topk]``)."""
    import torch

    from pipeline.consumers.megatron.model import forward_logits, model_device
    from pipeline.consumers.megatron.router_replay import RouterReplay
    from pipeline.consumers.rl.batch import collate
    from pipeline.queue.sample import compact_routing

    replay = RouterReplay.for_model(cfg)
    device = model_device(model)
    for start in range(0, len(samples), rows):
        chunk = list(samples[start : start + rows])
        batch = collate([chunk])  # ids and mask only: no routing shape
        replay.record()
        with torch.no_grad():
            forward_logits(model, batch.input_ids.to(device), batch.attention_mask.to(device))
        routing = replay.recorded(len(chunk))
        replay.off()
        for b, sample in enumerate(chunk):
            fed = sample.num_prompt_tokens + sample.num_response_tokens - 1
            sample.routed_experts = compact_routing(routing[b, :fed].numpy(), cfg.num_experts)


def forward_flops(cfg: ModelConfig, lengths: Sequence[int]) -> float:
    """Model FLOPs of one forward over rows of these real lengths (see the module docstring)."""
    from pipeline.consumers.megatron.plan import Layout, count_parameters

    active = count_parameters(cfg, Layout(world_size=1, tp=1, ep=1)).active
    weights = active - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    attention = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_layers * pairs
    return 2.0 * weights * sum(lengths) + attention


def _step_config(sizes: Sizes, *, r3: bool) -> Any:
    from pipeline.config.trainer import CorrectionConfig, LossConfig, TrainStepConfig

    return TrainStepConfig(r3=r3, micro_batch_samples=sizes.micro_batch_samples,
                           micro_batch_tokens=sizes.micro_batch_tokens, lr=sizes.lr,
                           loss=LossConfig(correction=CorrectionConfig(type="icepop")))


# --------------------------------------------------------------------------------------------------- trainer, dense


class MemoryProbe:
    """Allocated bytes on the device at named moments, and each step's peak (CUDA; nothing on CPU)."""

    def __init__(self, device: str) -> None:
        self.on = device == "cuda"
        self.marks: dict[str, int] = {}
        self.peaks: list[int] = []
        self.mark("start")

    def mark(self, name: str) -> None:
        if self.on:
            import torch

            torch.cuda.synchronize()
            self.marks[name] = torch.cuda.memory_allocated()

    def before_step(self) -> int:
        if not self.on:
            return 0
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def after_step(self, at_start: int) -> None:
        if self.on:
            import torch

            torch.cuda.synchronize()
            self.peaks.append(torch.cuda.max_memory_allocated() - at_start)


def _train(ctx: Context, arch: str, values: dict[str, Any], steps: int) -> dict[str, Any]:
    """Build ``arch`` with the trainer's own builders and train it ``steps`` steps on one fixed batch."""
    import numpy as np

    from pipeline.consumers.rl.train_step import TrainStep

    sizes, device = ctx.sizes, ctx.device
    _, cfg = model_config(arch, values, sizes.dtype)
    memory = MemoryProbe(device)
    model = _megatron(cfg, device, r3=cfg.is_moe, seed=ctx.seed)
    memory.mark("model")
    step = TrainStep(model, cfg, _step_config(sizes, r3=cfg.is_moe), total_steps=steps)
    memory.mark("optimizer_built")
    groups = synthetic_groups(cfg, sizes, ctx.seed)
    samples = [s for g in groups for s in g]
    if cfg.is_moe:
        record_own_routing(model, cfg, samples, sizes.micro_batch_samples)
    for sample, logprobs in zip(samples, step.compute_logprobs(groups, replay=cfg.is_moe), strict=True):
        sample.rollout_logprobs = np.asarray(logprobs, np.float32)
    lengths = [s.num_prompt_tokens + s.num_response_tokens for s in samples]
    passes = 3 + 1 + (1 if cfg.is_moe and step.cfg.measure_r3 else 0)
    flops = passes * forward_flops(cfg, lengths)
    rows = []
    for index in range(steps):
        rows.append(_timed_step(step, groups, memory, device, flops, sum(lengths)))
        if index == 0:
            memory.mark("after_first_step")  # Adam's moments exist from the first optimizer step on
    step.close()
    result = _train_result(cfg, rows, step, groups, device)
    result["flops_per_step"] = flops
    if memory.on:
        result["memory"] = memory_figures(memory.marks, memory.peaks, _ddp_grad_bytes(step.updater), groups,
                                          step.cfg)
    del step, model
    return result


def _timed_step(step: Any, groups: list[list[Sample]], memory: MemoryProbe, device: str, flops: float,
                tokens: int) -> dict[str, Any]:
    at_start = memory.before_step()
    _sync(device)
    start = time.perf_counter()
    metrics = step.step(groups)
    _sync(device)
    seconds = time.perf_counter() - start
    memory.after_step(at_start)
    row = {"step_s": seconds, "tokens_per_s": tokens / seconds,
           "mfu": flops / seconds / PEAK_BF16_FLOPS if device == "cuda" else None}
    for key in ("loss", "pg_loss", "grad_norm", "mismatch_k3", "is_weight_mean", "r3/agreement_train",
                "r3/agreement_no_replay", "time/proximal_s", "time/train_s", "tokens_per_s", "skipped_step"):
        if key in metrics:
            row["loss_tokens_per_s" if key == "tokens_per_s" else key] = metrics[key]
    return row


def _train_result(cfg: ModelConfig, rows: list[dict[str, Any]], step: Any, groups: list[list[Sample]],
                  device: str) -> dict[str, Any]:
    from pipeline.consumers.megatron.plan import Layout, count_parameters

    steady = rows[2:] if len(rows) > 4 else rows  # the first steps grow the allocator and warm the kernels
    step_s = statistics.median(r["step_s"] for r in steady)
    losses = [r["loss"] for r in rows]
    counts = count_parameters(cfg, Layout(world_size=1, tp=1, ep=1))
    headline: dict[str, Any] = {
        "step_s": step_s,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady) if device == "cuda" else None,
        "loss_first": losses[0], "loss_last": losses[-1], "loss_fell": losses[-1] < losses[0],
        "optimizer": type(step.updater).__name__,
    }
    if cfg.is_moe:
        headline["r3_agreement_train"] = min(r["r3/agreement_train"] for r in rows)
    return {
        "headline": headline,
        "model_config": cfg.model_dump(),
        "parameters": {"total": counts.total, "active_per_token": counts.active},
        "batch": {"samples": sum(len(g) for g in groups), "tokens": sum(s.num_prompt_tokens + s.num_response_tokens
                                                                      for g in groups for s in g)},
        "steps": rows,
        "memory": None,
    }


def _ddp_grad_bytes(updater: Any) -> int:
    """Bytes of megatron DDP's gradient buffers (0 for the local updater, whose gradients live and die per step)."""
    ddp = getattr(updater, "ddp", None)
    buffers = [] if ddp is None else list(ddp.buffers) + list(ddp.expert_parallel_buffers)
    return sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)


def memory_figures(marks: dict[str, int], peaks: list[int], grads: int, groups: list[list[Sample]],
                   cfg: Any) -> dict[str, Any]:
    """Bytes of each kind of state from the allocated bytes at the marks (``start``, ``model``, ``after_first_step``)
    and each step's peak over its start, and the largest micro-batch's padded tokens (the plan's input)."""
    from pipeline.consumers.rl.batch import collate, split_rows

    batch = collate(groups)
    lengths = batch.attention_mask.sum(-1).tolist()
    micro = split_rows(batch, max_samples=cfg.micro_batch_samples, max_tokens=cfg.micro_batch_tokens)
    settled = marks["after_first_step"]
    return {
        "marks": marks,
        "params": marks["model"] - marks["start"],
        "grads": grads,
        # The distributed optimizer's fp32 masters exist once it is built, Adam's moments from its first step on.
        "optimizer": settled - marks["model"] - grads,
        # The first step's peak also holds Adam's moments being made; later steps' peaks are the activations alone.
        "activations": max(peaks[1:] or peaks),
        "peak_total": max(peaks) + settled - marks["start"],
        "micro_batch_tokens": max(len(rows) * max(int(lengths[r]) for r in rows) for rows in micro),
    }


def trainer_part(ctx: Context) -> dict[str, Any]:
    return _train(ctx, "qwen3-moe", ctx.sizes.moe, ctx.sizes.steps)


def dense_part(ctx: Context) -> dict[str, Any]:
    return _train(ctx, "qwen3", ctx.sizes.dense, max(ctx.sizes.steps // 2, 3))


# ----------------------------------------------------------------------------------------------------------- memory


def memory_part(ctx: Context) -> dict[str, Any]:
    """Measured memory of the trainer and dense parts against the dry run's plan, term by term."""
    if ctx.device != "cuda":
        return {"skipped": "cpu", "headline": {"skipped": "cpu"}}
    from pipeline.consumers.megatron.plan import Layout, plan_memory
    from pipeline.models.config import ModelConfig

    models: dict[str, Any] = {}
    for part in ("trainer", "dense"):
        path = ctx.out / f"{part}.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        measured = data.get("memory")
        if not measured:
            models[part] = {"error": f"the {part} part measured no memory (it failed or was not run)"}
            continue
        cfg = ModelConfig(**data["model_config"])
        plan = plan_memory(cfg, Layout(world_size=1, tp=1, ep=1), device="cuda",
                           tokens=measured["micro_batch_tokens"], kl_reference=False)
        planned = {"params": plan.params, "grads": plan.grads, "optimizer": plan.optimizer,
                   "activations": plan.activations, "peak_total": plan.training}
        models[part] = {term: {"measured_gib": measured[term] / GIB, "plan_gib": planned[term] / GIB,
                               "ratio": measured[term] / planned[term] if planned[term] else None}
                        for term in planned}
    if all("error" in m for m in models.values()):
        raise RuntimeError("; ".join(m["error"] for m in models.values()))
    headline = {part: {term: round(v["ratio"], 3) for term, v in terms.items() if v["ratio"] is not None}
                for part, terms in models.items() if "error" not in terms}
    return {"headline": {"measured_over_plan": headline}, "models": models}


# --------------------------------------------------------------------------------------------------------------- R3


def r3_part(ctx: Context) -> dict[str, Any]:
    """Record, replay, perturb: megatron's router replay on the MoE model of the trainer part."""
    import torch

    from pipeline.consumers.megatron.router_replay import RouterReplay, topk_agreement
    from pipeline.consumers.megatron.scoring import RouterProbe

    sizes = ctx.sizes
    _, cfg = model_config("qwen3-moe", sizes.moe, sizes.dtype)
    model = _megatron(cfg, ctx.device, r3=True, seed=ctx.seed)
    replay, probe = RouterReplay.for_model(cfg), RouterProbe(model, cfg.moe_topk)
    gen = torch.Generator().manual_seed(ctx.seed)
    ids = torch.randint(4, cfg.vocab_size, (sizes.r3_rows, sizes.r3_len), generator=gen)
    run = _probed_forward(model, probe, ids)

    replay.record()
    base_lp, base_used = run()
    recorded = replay.recorded(sizes.r3_rows)
    replay.off()
    again_lp, again_used = run()
    replay.replay_forward(recorded)
    replay_lp, replay_used = run()
    replay.off()
    _perturb(model, PERTURBATION, ctx.seed + 1)
    free_lp, free_used = run()
    replay.replay_forward(recorded)
    moved_lp, moved_used = run()
    replay.off()
    probe.close()
    figures = {
        "agreement_recorded_vs_dispatched": topk_agreement(base_used, recorded),
        "agreement_free_rerun": topk_agreement(again_used, recorded),
        "agreement_replay": topk_agreement(replay_used, recorded),
        "max_abs_logprob_diff_replay_same_weights": float((replay_lp - base_lp).abs().max()),
        "agreement_perturbed_free": topk_agreement(free_used, recorded),
        "agreement_perturbed_replay": topk_agreement(moved_used, recorded),
        "k3_perturbed_free": _k3(base_lp, free_lp),
        "k3_perturbed_replay": _k3(base_lp, moved_lp),
        "max_abs_logprob_diff_free_rerun": float((again_lp - base_lp).abs().max()),
    }
    keys = ("agreement_replay", "agreement_perturbed_free", "agreement_perturbed_replay", "k3_perturbed_free",
            "k3_perturbed_replay")
    return {"headline": {k: figures[k] for k in keys}, "figures": figures,
            "tokens": sizes.r3_rows * sizes.r3_len, "perturbation": PERTURBATION}


def _probed_forward(model: Any, probe: Any, ids: torch.Tensor) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """A no-grad forward of ``ids`` giving (token log-probs [B, T-1] on CPU, dispatched experts [B, T, layers, k])."""
    import torch

    from pipeline.consumers.megatron.model import forward_logits, model_device
    from pipeline.consumers.megatron.scoring import score_tokens

    device = model_device(model)
    mask = torch.ones_like(ids)
    temperatures = torch.ones(ids.shape[0])

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        probe.start()
        with torch.no_grad():
            logits = forward_logits(model, ids.to(device), mask.to(device))
            logprobs, _ = score_tokens(logits, ids[:, 1:], temperatures)
        return logprobs.float().cpu(), probe.take(ids.shape[0])

    return run


def _perturb(model: Any, scale: float, seed: int) -> None:
    import torch

    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=gen, device=param.device, dtype=torch.float32)
            param.add_((scale * param.float().std() * noise).to(param.dtype))


def _k3(behaviour: torch.Tensor, current: torch.Tensor) -> float:
    """Token mean of k3, KL(behaviour || current), as the trainer's mismatch metric computes it; in float64, since
    two fp32 models with the same weights differ by about 1e-7 a token, whose k3 float32 rounds to exactly 0."""
    from pipeline.consumers.rl.loss import kl_penalty

    return float(kl_penalty(behaviour.double(), current.double(), "k3").mean())


# ----------------------------------------------------------------------------------------------------------- engine


def engine_part(ctx: Context) -> dict[str, Any]:
    """The CPU engine's generator on the device, and the trainer scoring what it generated, from the same weights."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.consumers.megatron.adapter import torch_dtype
    from pipeline.consumers.megatron.convert import load_hf_into_megatron
    from pipeline.consumers.rl.train_step import TrainStep

    sizes, device = ctx.sizes, ctx.device
    hf_config, cfg = model_config("qwen3-moe", sizes.moe, sizes.dtype)
    torch.manual_seed(ctx.seed)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch_dtype(cfg))
    hf.eval().requires_grad_(False)
    model = _megatron(cfg, device, r3=True, seed=ctx.seed)
    load_hf_into_megatron(model, hf, cfg)
    samples, rates = generate(hf, cfg, sizes, device, ctx.seed)
    del hf
    _free(device)
    groups = [samples[i : i + sizes.group_size] for i in range(0, len(samples), sizes.group_size)]
    step = TrainStep(model, cfg, _step_config(sizes, r3=True))
    behaviour = torch.from_numpy(np.concatenate([s.rollout_logprobs for s in samples]))
    replayed = torch.from_numpy(np.concatenate(step.compute_logprobs(groups, replay=True)))
    free = torch.from_numpy(np.concatenate(step.compute_logprobs(groups, replay=False)))
    metrics = step.step(groups)  # the trainer's own measurements of these samples, as in a run
    step.close()
    figures = {
        "k3_replay": _k3(behaviour, replayed), "k3_free": _k3(behaviour, free),
        "max_abs_logprob_diff_replay": float((replayed - behaviour).abs().max()),
        "agreement_no_replay": metrics.get("r3/agreement_no_replay"),
        "agreement_train": metrics.get("r3/agreement_train"),
        "step_mismatch_k3": metrics.get("mismatch_k3"),
        **rates,
    }
    keys = ("k3_replay", "k3_free", "agreement_no_replay", "decode_tokens_per_s")
    return {"headline": {k: figures[k] for k in keys}, "figures": figures,
            "engine_dtype": sizes.dtype, "trainer_dtype": sizes.dtype, "samples": len(samples)}


def generate(hf: Any, cfg: ModelConfig, sizes: Sizes, device: str, seed: int) -> tuple[list[Sample], dict[str, float]]:
    """Groups of samples from the CPU engine's ``BatchGenerator`` (one prompt per group, its prefill shared, as the
    engine serves ``n > 1``), with their log-probs and routing, and the prefill and decode rates."""
    import numpy as np
    import torch

    from pipeline.producers.cpu_engine.generator import BatchGenerator, Sequence
    from pipeline.producers.cpu_engine.sampling import SamplingSettings
    from pipeline.queue.sample import Sample, SamplingInfo, compact_routing

    rng = np.random.default_rng(seed + 2)
    prompts = [rng.integers(4, cfg.vocab_size, sizes.engine_prompt_len).tolist() for _ in range(sizes.engine_groups)]
    settings = SamplingSettings(temperature=sizes.temperature, top_p=1.0, top_k=-1)
    torch.manual_seed(seed + 2)
    # The engine makes its tensors with torch's defaults, which this points at the device.
    with torch.device(device):
        gen = BatchGenerator(hf, eos_ids=frozenset(), pad_id=0, logprob_mode="temperature", record_routing=True,
                             max_context_len=sizes.engine_prompt_len + sizes.engine_new_tokens + 1, version="0")
        seqs = [Sequence(p, sizes.engine_new_tokens, settings, frozenset(), True, None)
                for p in prompts for _ in range(sizes.group_size)]
        _sync(device)
        start = time.perf_counter()
        gen.admit(seqs)
        _sync(device)
        prefilled = time.perf_counter()
        while gen.rows:
            gen.step()
        _sync(device)
        end = time.perf_counter()
    if gen.recorder is not None:
        gen.recorder.close()
    samples = []
    for seq in seqs:
        assert seq.routing is not None  # a MoE model with record_routing
        samples.append(Sample(
            prompt_ids=np.array(seq.prompt_ids, np.int32), response_ids=np.array(seq.output_ids, np.int32),
            rollout_logprobs=np.array(seq.output_logprobs, np.float32),
            token_versions=np.zeros(len(seq.output_ids), np.int32),
            routed_experts=compact_routing(seq.routing.cpu().numpy(), cfg.num_experts), reward=float(rng.random()),
            sampling=SamplingInfo(temperature=sizes.temperature, max_new_tokens=sizes.engine_new_tokens),
        ))  # fmt: skip
    decoded = gen.tokens_generated - len(seqs)  # the first token of each comes from the prefill
    return samples, {
        "prefill_tokens_per_s": sizes.engine_groups * sizes.engine_prompt_len / (prefilled - start),
        "decode_tokens_per_s": decoded / (end - prefilled),
        "decode_batch": len(seqs),
        "decode_steps": gen.forward_passes - 1,
    }


# --------------------------------------------------------------------------------------------------- the gpu tests


GPU_TESTS: tuple[str, ...] = ("tests/consumers/test_megatron_updater.py",)
"""Test files whose ``gpu``-marked tests the ``tests`` part runs (paths of this checkout)."""
_TESTS_TIMEOUT_S = 600


def tests_part(ctx: Context) -> dict[str, Any]:
    """``pytest -m gpu`` over :data:`GPU_TESTS` in a child process; fails when any of them fails or none ran. On
    CPU they would only skip."""
    if ctx.device != "cuda":
        return {"skipped": "cpu", "headline": {"skipped": "cpu"}}
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    # --noconftest: the shared conftest imports redis, which the GPU image lacks; these files use none of its
    # fixtures, and its other task, skipping gpu tests without CUDA, does not arise here.
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "--noconftest", "-p", "no:cacheprovider", *GPU_TESTS]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=_TESTS_TIMEOUT_S)
    tail = (proc.stdout + proc.stderr)[-6000:]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", tail)}
    if proc.returncode != 0 or not counts.get("passed"):
        raise RuntimeError(f"pytest -m gpu on {', '.join(GPU_TESTS)} exited {proc.returncode} ({counts}):\n{tail}")
    return {"headline": {"passed": counts["passed"], "skipped": counts.get("skipped", 0)}, "files": list(GPU_TESTS),
            "output_tail": tail}


_PART_FUNCS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "trainer": trainer_part,
    "dense": dense_part,
    "memory": memory_part,
    "r3": r3_part,
    "engine": engine_part,
    "tests": tests_part,
}


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.benchmarks.gpu_check``: the check without the ``sluice`` CLI (the GPU machine runs it
    from a checkout, with the carried wheels on ``PYTHONPATH``)."""
    import argparse
    from dataclasses import fields

    parser = argparse.ArgumentParser(prog="python -m pipeline.benchmarks.gpu_check",
                                     description=(__doc__ or "").splitlines()[0])
    # Not pipeline.cli's add_dataclass_args: importing pipeline.cli imports every command group, and the GPU image
    # lacks some packages they may import (redis, ray).
    for f in fields(GpuCheckParams):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(flag, dest=f.name, type=type(f.default), default=f.default)
    args = parser.parse_args(argv)
    summary = run_gpu_check(GpuCheckParams(**{f.name: getattr(args, f.name) for f in fields(GpuCheckParams)}))
    print("\n".join(summary_lines(summary)), flush=True)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
