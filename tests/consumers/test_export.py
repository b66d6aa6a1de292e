"""``sluice export``: a run's Megatron dist-checkpoint as an HF folder that transformers loads as it is, with the
trainer's logits. Real megatron-core checkpoints (saved by the trainer's own ``save_checkpoint``), a real CLI
subprocess, real ``AutoModelForCausalLM.from_pretrained``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from pipeline.config import load_config  # noqa: E402

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.slow
TOLERANCE = 1e-4  # fp32 on both sides; the conversion itself is exact, only the kernels differ


def _sluice(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)


def _perturbed(mg: object, seed: int) -> None:
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in mg.parameters():  # type: ignore[attr-defined]
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def test_export_loads_in_transformers_with_the_trainers_logits(model_dir: Path, tmp_path: Path) -> None:
    from pipeline.consumers.megatron.checkpoint import save_checkpoint
    from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig
    from pipeline.consumers.megatron.convert import load_hf_into_megatron
    from pipeline.consumers.megatron.model import build_gpt_model, forward_logits, init_parallel

    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"model.path={json.dumps(str(model_dir))}", f"run.run_dir={json.dumps(str(run_dir))}"])
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(mode="json")))

    model_cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    init_parallel(ParallelConfig())
    mg = build_gpt_model(model_cfg, ParallelConfig(), r3=True).eval()
    load_hf_into_megatron(mg, model_dir, model_cfg)
    ids = torch.tensor([[3, 17, 5, 9, 22, 40, 11, 8, 30, 2, 14, 6]])
    mask = torch.ones_like(ids)
    trainer_logits = {}
    for step, seed in ((3, 1), (6, 2)):
        _perturbed(mg, seed)
        with torch.no_grad():
            trainer_logits[step] = forward_logits(mg, ids, mask).float()
        opt = torch.optim.AdamW(mg.parameters(), lr=1e-3)  # the trainer's checkpoints hold optimizer state too
        save_checkpoint(run_dir / "checkpoints" / f"step-{step:08d}", mg, opt,
                        meta={"step": step, "policy_version": step + 10})

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(ids).logits.float()
    for step, extra in ((6, []), (3, ["--step", "3"])):
        out = tmp_path / f"hf-{step}"
        r = _sluice("export", "--run-dir", str(run_dir), "--to", str(out), "--json", *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads(r.stdout) == {"folder": str(out), "checkpoint": f"step-{step:08d}", "step": step,
                                        "policy_version": step + 10}
        hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()  # as it is: no dtype, no options
        tok = transformers.AutoTokenizer.from_pretrained(out)
        assert tok.vocab_size == transformers.AutoTokenizer.from_pretrained(model_dir).vocab_size
        with torch.no_grad():
            logits = hf(ids).logits.float()
        diff = (logits - trainer_logits[step]).abs().max().item()
        moved = (trainer_logits[step] - base_logits).abs().max().item()
        print(f"step {step}: max |HF export - trainer| logits = {diff:.2e} (tolerance {TOLERANCE:.0e}); "
              f"the checkpoint moved the logits by {moved:.2e} from the starting model")
        assert diff < TOLERANCE
        assert moved > 100 * TOLERANCE  # the comparison would catch an export of the starting weights
        assert not (tmp_path / f"hf-{step}.tmp").exists()

    # Bad input: clear errors before anything heavy is built (in-process: these need no megatron world).
    from pipeline.consumers.export import export_run
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="already exists"):
        export_run(run_dir, tmp_path / "hf-6")
    with pytest.raises(ConfigError, match=r"no checkpoint of step 4; steps with one: 3, 6"):
        export_run(run_dir, tmp_path / "x", step=4)
    with pytest.raises(ConfigError, match="not the folder of a `sluice run`"):
        export_run(tmp_path, tmp_path / "x")
    r = _sluice("export", "--run-dir", str(run_dir), "--to", str(tmp_path / "x"), "--step", "4")
    assert r.returncode == 2 and "sluice: error:" in r.stderr and "no checkpoint of step 4" in r.stderr
