"""The megatron updater's gradients: reduced once per mini-batch whatever its number of micro-batches, the gradients
that each TP rank holds only part of summed over TP, and a step with a NaN or inf anywhere skipped on every rank.

On CPU, :class:`MegatronGrads` (megatron-core's ``DistributedDataParallel`` with the distributed optimizer's
reduce-scatter, over two gloo ranks; sluice's CPU shim puts its buckets in host memory) against plain autograd in
one process. megatron's distributed optimizer itself allocates on ``cuda``, so the whole updater (weights, Adam's
state) is compared with :class:`LocalUpdater` only on a GPU (the ``gpu`` tests, which the prepared GPU check runs).
TP = 2 needs two NCCL ranks on two GPUs, so it is checked on CPU only, with the dense Qwen3: megatron's MoE under TP
needs sequence parallelism, whose norms do not exist on CPU.

The workers run this file as a script and write safetensors/JSON; no pickle crosses the process boundary.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from pipeline.config.trainer import CorrectionConfig, LossConfig, TrainStepConfig  # noqa: E402
from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import load_hf_into_megatron  # noqa: E402
from pipeline.consumers.megatron.model import build_gpt_model, forward_logprobs, init_parallel  # noqa: E402
from pipeline.consumers.rl.optim import MegatronGrads  # noqa: E402
from pipeline.consumers.rl.train_step import TrainStep  # noqa: E402
from pipeline.models.tiny import init_tiny_model  # noqa: E402
from pipeline.net import free_port  # noqa: E402
from tests.helpers.train_samples import finish_ranks, start_ranks, synthetic_groups, tiny_moe  # noqa: E402

Tensor = torch.Tensor
MB_ROWS, MB_LEN = 2, 12
NORM = 64.0  # stands for the global token count the train step divides by: gradients are sums over ranks
TOLERANCE = 1e-5  # relative to the largest gradient element
MOVE_TOLERANCE = 1e-2  # two updaters' weights apart, relative to how far the weights moved
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE and dense Qwen3, each in a folder named after its architecture."""
    root = tmp_path_factory.mktemp("models")
    tiny_moe(root / "qwen3-moe")
    init_tiny_model("qwen3", root / "qwen3", seed=0)
    return root


# ------------------------------------------------------------------------------------------- shared by both sides


def _build(folder: Path, parallel: ParallelConfig) -> tuple[Any, ModelConfig]:
    model_cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), dtype="float32")
    init_parallel(parallel, seed=3)
    model = build_gpt_model(model_cfg, parallel, r3=False)
    load_hf_into_megatron(model, folder, model_cfg)
    return model, model_cfg


def _ids(vocab: int, step: int, rank: int, micro: int) -> Tensor:
    """The tokens of one micro-batch, different for every (step, rank, micro-batch)."""
    gen = torch.Generator().manual_seed(1_000_000 * step + 1_000 * rank + micro)
    return torch.randint(4, vocab, (MB_ROWS, MB_LEN), generator=gen)


def _loss(model: Any, ids: Tensor) -> Tensor:
    return -forward_logprobs(model, ids, torch.ones_like(ids)).sum() / NORM


def _rel_diff(got: Tensor, want: Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


# -------------------------------------------------------------------------------------- the 2-rank workers (CPU)


def _bucket_views(grads: MegatronGrads) -> Iterator[Tensor]:
    for buffer in grads.ddp.buffers + grads.ddp.expert_parallel_buffers:
        for bucket in buffer.buckets:
            yield bucket.grad_data


def _owned(grads: MegatronGrads) -> Tensor:
    """This data-parallel rank's shard of every bucket: what the reduce-scatter completes, and what the distributed
    optimizer steps here."""
    world, rank = dist.get_world_size(), dist.get_rank()
    return torch.cat([view.view(world, -1)[rank] for view in _bucket_views(grads)]).clone()


def _micro_batches(models: Path, out: Path, rank: int) -> None:
    """Two steps of 2 then 3 micro-batches, and of 3 then 2 (a fresh DDP each: its first step sets what it waits
    for), against the same micro-batches of both ranks summed by plain autograd."""
    diffs = {}
    for counts in ((2, 3), (3, 2)):
        model, model_cfg = _build(models / "qwen3-moe", ParallelConfig(device="cpu"))
        reference, _ = _build(models / "qwen3-moe", ParallelConfig(device="cpu"))
        grads = MegatronGrads(model)
        diffs[str(counts)] = []
        for step, count in enumerate(counts):
            grads.zero()
            for i in range(count):
                with grads.backward_of(last=i == count - 1):
                    _loss(model, _ids(model_cfg.vocab_size, step, rank, i)).backward()
            assert grads.finish()
            got = _owned(grads)
            reference.zero_grad()
            for peer in range(2):
                for i in range(count):
                    _loss(reference, _ids(model_cfg.vocab_size, step, peer, i)).backward()
            # The reference laid out in DDP's buffers, so that the same shard of it can be read.
            ref = dict(reference.named_parameters())
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.main_grad.copy_(ref[name].grad)
            diffs[str(counts)].append(_rel_diff(got, _owned(grads)))
            print(f"micro-batches {counts}, step {step}: max relative difference {diffs[str(counts)][-1]:.1e}",
                  flush=True)
    (out / f"micro.rank{rank}.json").write_text(json.dumps(diffs))


def _tensor_parallel(models: Path, out: Path, rank: int) -> None:
    """The dense Qwen3 at TP = 2: every gradient of a weight that TP does not split, after two micro-batches."""
    model, model_cfg = _build(models / "qwen3", ParallelConfig(tp=2, device="cpu"))
    grads = MegatronGrads(model)
    grads.zero()
    for i in range(2):
        with grads.backward_of(last=i == 1):
            _loss(model, _ids(model_cfg.vocab_size, 0, 0, i)).backward()
    assert grads.finish()
    replicated = {name: param.main_grad.clone() for name, param in model.named_parameters()
                  if not getattr(param, "tensor_model_parallel", False)}
    save_file(replicated, str(out / f"tp.rank{rank}.safetensors"))


def _non_finite(models: Path, out: Path, rank: int) -> None:
    """Three steps; in the second, rank 1 alone makes one gradient NaN, one that lies wholly in rank 1's own shard,
    so that rank 0's buffers stay finite and only the agreement between ranks can tell it."""
    model, model_cfg = _build(models / "qwen3-moe", ParallelConfig(device="cpu"))
    grads = MegatronGrads(model)
    target = _param_in_shard(model, grads, owner=1)
    answers, locally_finite = [], []
    for step in range(3):
        grads.zero()
        hook = None
        if step == 1 and rank == 1:
            hook = target.register_hook(lambda g: torch.full_like(g, math.nan))
        for i in range(2):
            with grads.backward_of(last=i == 1):
                _loss(model, _ids(model_cfg.vocab_size, step, rank, i)).backward()
        if hook is not None:
            hook.remove()
        answers.append(grads.finish())
        locally_finite.append(all(bool(torch.isfinite(view).all()) for view in _bucket_views(grads)))
    (out / f"nan.rank{rank}.json").write_text(json.dumps({"finite": answers, "locally_finite": locally_finite}))


def _param_in_shard(model: Any, grads: MegatronGrads, owner: int) -> Any:
    """A parameter whose ``main_grad`` lies wholly inside data-parallel rank ``owner``'s shard of its bucket."""
    world = dist.get_world_size()
    for param in model.parameters():
        for view in _bucket_views(grads):
            start = (param.main_grad.data_ptr() - view.data_ptr()) // view.element_size()
            if 0 <= start < view.numel():
                shard = view.numel() // world
                if owner * shard <= start and start + param.numel() <= (owner + 1) * shard:
                    return param
    raise AssertionError(f"no parameter lies wholly in rank {owner}'s shard")


SCENARIOS = {"micro": _micro_batches, "tp": _tensor_parallel, "nan": _non_finite}


def _worker(rank: int, scenario: str, port: int, models: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    SCENARIOS[scenario](Path(models), Path(out), rank)
    dist.destroy_process_group()


def _run(scenario: str, models: Path, out: Path) -> None:
    procs = start_ranks(__file__, [scenario, str(free_port()), str(models), str(out)])
    finish_ranks(procs, timeout_s=300)


# ---------------------------------------------------------------------------------------------------- CPU tests


@pytest.mark.slow
def test_a_changing_number_of_micro_batches_reduces_each_mini_batch_once(models: Path, tmp_path: Path) -> None:
    """DDP's first step sets how many gradient-ready events make a bucket's reduce start. Counted over every
    micro-batch, a step with more micro-batches than the first reduces before its last backward (that rank's last
    micro-batch never reaches the other), and one with fewer never starts the reduce (megatron asserts)."""
    _run("micro", models, tmp_path)
    for rank in range(2):
        diffs = json.loads((tmp_path / f"micro.rank{rank}.json").read_text())
        print(f"rank {rank}: max relative gradient difference per step, by micro-batch counts: {diffs}")
        assert all(d < TOLERANCE for steps in diffs.values() for d in steps), diffs


@pytest.mark.slow
def test_tensor_parallel_ranks_hold_the_whole_gradient_of_what_tp_does_not_split(models: Path,
                                                                                  tmp_path: Path) -> None:
    """Qwen3's q/k norms act on each TP rank's own heads, so each rank's gradient is a part of the whole; DDP
    reduces over DP only. Every weight TP does not split must end with TP = 1's gradient on both ranks."""
    _run("tp", models, tmp_path)
    model, model_cfg = _build(models / "qwen3", ParallelConfig(device="cpu"))
    for i in range(2):
        _loss(model, _ids(model_cfg.vocab_size, 0, 0, i)).backward()
    reference = {name: param.grad for name, param in model.named_parameters()}
    ranks = [load_file(str(tmp_path / f"tp.rank{r}.safetensors")) for r in range(2)]
    assert any("q_layernorm" in name for name in ranks[0]) and any("k_layernorm" in name for name in ranks[0])
    worst = {name: max(_rel_diff(got[name], reference[name]) for got in ranks) for name in ranks[0]}
    print("TP = 2 against TP = 1, max relative difference:",
          {name: f"{d:.1e}" for name, d in worst.items() if "layernorm" in name})
    assert all(d < TOLERANCE for d in worst.values()), {k: v for k, v in worst.items() if v >= TOLERANCE}


@pytest.mark.slow
def test_a_nan_on_one_rank_fails_the_finite_check_on_every_rank(models: Path, tmp_path: Path) -> None:
    _run("nan", models, tmp_path)
    seen = [json.loads((tmp_path / f"nan.rank{rank}.json").read_text()) for rank in range(2)]
    # The test's premise: in the poisoned step rank 0's own buffers are finite.
    assert seen[0]["locally_finite"] == [True, True, True] and seen[1]["locally_finite"] == [True, False, True]
    assert [s["finite"] for s in seen] == [[True, False, True]] * 2


# -------------------------------------------------------------------------- the whole updater (GPU; harness on CPU)


def _train_step(models: Path, device: str, optimizer: str) -> TrainStep:
    folder = models / "qwen3-moe"
    model_cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), dtype="float32")
    parallel = ParallelConfig(device=device)  # type: ignore[arg-type]
    init_parallel(parallel, seed=7)
    model = build_gpt_model(model_cfg, parallel, r3=True)
    load_hf_into_megatron(model, folder, model_cfg)
    # grad_clip so large it never clips, but every optimizer then reports the norm it computed.
    cfg = TrainStepConfig(lr=1e-3, micro_batch_samples=4, grad_clip=1e6, optimizer=optimizer,  # type: ignore[arg-type]
                          loss=LossConfig(correction=CorrectionConfig(type="none")))
    return TrainStep(model, model_cfg, cfg)


def _flat(model: Any) -> Tensor:
    return torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])


def _groups(model_cfg: ModelConfig, micro_batches: int, seed: int) -> list[list[Any]]:
    """Groups that make ``micro_batches`` micro-batches of at most 4 samples: 4 * micro_batches - 1 samples, all
    with routing (a sample without it goes to a micro-batch of its own)."""
    groups = synthetic_groups(model_cfg, [4] * micro_batches, seed=seed)
    groups[1] = groups[1][1:]  # the one sample synthetic_groups leaves without routing
    return groups


def _micro_batch_log(step: TrainStep) -> list[bool]:
    """Record the ``last`` flag of every micro-batch the updater is told of."""
    seen: list[bool] = []
    inner = step.updater.backward_of

    def spy(last: bool) -> Any:
        seen.append(last)
        return inner(last)

    step.updater.backward_of = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [(2, 3), (3, 2)])
def test_megatron_updater_matches_the_local_one_as_the_micro_batch_count_changes(models: Path,
                                                                                 counts: tuple[int, int]) -> None:
    model_cfg = ModelConfig.from_hf(json.loads((models / "qwen3-moe" / "config.json").read_text()))
    batches = [_groups(model_cfg, count, seed=s) for s, count in enumerate(counts)]
    weights, norms = {}, {}
    for optimizer in ("local", "megatron"):
        step = _train_step(models, "cuda", optimizer)
        assert type(step.updater).__name__ == ("LocalUpdater" if optimizer == "local" else "MegatronUpdater")
        flags = _micro_batch_log(step)
        start = _flat(step.model)
        norms[optimizer] = [step.step(groups)["grad_norm"] for groups in batches]
        weights[optimizer] = (start, _flat(step.model))
        step.close()
        assert flags == [i == c - 1 for c in counts for i in range(c)]
    start, local = weights["local"]
    moved = float((local - start).norm())
    apart = float((weights["megatron"][1] - local).norm())
    print(f"micro-batches {counts}: grad norms local {norms['local']}, megatron {norms['megatron']}; "
          f"|megatron - local| / |local - start| = {apart / moved:.2e}")
    assert norms["megatron"] == pytest.approx(norms["local"], rel=1e-4)
    # Adam's first step is the gradient's sign, so the norms above are what catches a gradient of the wrong size.
    # The margin is for CUDA's atomics (MoE token scatter): rounding-level gradient noise that Adam amplifies
    # where a gradient is near its eps.
    assert apart < MOVE_TOLERANCE * moved


@pytest.mark.parametrize("device", DEVICES)
def test_a_nan_in_the_loss_skips_the_step_and_leaves_weights_and_adam_state(models: Path, device: str) -> None:
    """On CUDA the megatron updater, on CPU the local one (the behaviour the megatron one must share). A NaN in the
    trained pass's logits of one step: that step is skipped, its weights unchanged, and the next step lands where
    it would have without the poisoned one (Adam's moments and step count untouched)."""
    model_cfg = ModelConfig.from_hf(json.loads((models / "qwen3-moe" / "config.json").read_text()))
    batches = [synthetic_groups(model_cfg, [4, 4], seed=s) for s in range(3)]

    poisoned = _train_step(models, device, "auto")
    poison = {"on": False}

    def nan_logits(module: Any, args: Any, output: Any) -> Any:
        if poison["on"] and torch.is_grad_enabled():  # the trained pass, not the proximal one
            return (output[0] * math.nan, *output[1:])
        return None

    poisoned.model.output_layer.register_forward_hook(nan_logits)
    first = poisoned.step(batches[0])
    before = _flat(poisoned.model)
    poison["on"] = True
    bad = poisoned.step(batches[1])
    poison["on"] = False
    after = _flat(poisoned.model)
    last = poisoned.step(batches[2])
    end = _flat(poisoned.model)
    poisoned.close()

    clean = _train_step(models, device, "auto")
    clean.step(batches[0])
    clean.step(batches[2])
    want = _flat(clean.model)
    clean.close()

    assert [first["skipped_step"], bad["skipped_step"], last["skipped_step"]] == [0.0, 1.0, 0.0]
    assert poisoned.samples_trained == clean.samples_trained
    assert torch.equal(before, after)
    assert bool(torch.isfinite(end).all())
    moved = float((want - before).norm())
    print(f"{device}: |poisoned run - clean run| / last step's move = {float((end - want).norm()) / moved:.2e}")
    assert float((end - want).norm()) < MOVE_TOLERANCE * moved


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
