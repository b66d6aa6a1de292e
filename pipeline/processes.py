"""Entry points of the processes ``sluice run`` starts: ``python -m pipeline.processes ROLE RUN_DIR [NAME]``.

Each reads the run's resolved config (``RUN_DIR/config.json``), wires its stage from the library, and installs one
crash handler: log, close, exit non-zero, so the launcher restarts it. This module sits at the package root because
it is where stages meet (the trainer's weight push needs the engines' HTTP client).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from pipeline.launch import base_model_folder, load_run_config, model_folder

log = logging.getLogger("sluice")


def producer_main(run_dir: Path, name: str) -> None:
    """One producer: prompts -> engines -> rewards -> queue, until SIGTERM."""
    from transformers import AutoTokenizer

    from pipeline.producers.producer import Pacing, Producer, read_num_experts
    from pipeline.producers.prompts import setup_prompts
    from pipeline.producers.rewards import resolve_reward
    from pipeline.producers.sglang_client import NO_RETRY, EnginePool, SGLangClient
    from pipeline.queue.rundir import open_run

    cfg = load_run_config(run_dir)
    model_dir = model_folder(cfg)
    urls = json.loads((run_dir / "engines.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    handle = open_run(run_dir=run_dir, redis_url=cfg.queue.redis_url, capacity=cfg.queue.capacity,
                      routing_codec=cfg.queue.routing_codec)

    hf = json.loads((model_dir / "config.json").read_text())
    num_experts = read_num_experts(model_dir)
    # SGLang's /model_info does not report the MoE shape that routed_experts must be reshaped to; the model does.
    moe_layers = hf["num_hidden_layers"] - len(hf.get("mlp_only_layers") or [])
    shape = (moe_layers, int(hf["num_experts_per_tok"])) if num_experts else None

    async def main() -> None:
        pool = EnginePool([SGLangClient(u, retry=NO_RETRY, routed_experts_shape=shape) for u in urls])
        producer = Producer(
            cfg.producer, name=name, queue=handle.queue, engine=pool, prompts=setup_prompts(cfg.prompts),
            tokenize=lambda text: tokenizer.encode(text, add_special_tokens=False),
            reward_fn=resolve_reward(cfg.producer.reward),
            pacing=Pacing(max_lag=cfg.staleness.max_lag, batch_groups=cfg.trainer.batch_groups),
            num_experts=num_experts,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            stats = await producer.run(stop=stop)
            log.info("producer %s stopped: %s", name, stats)
        finally:
            await pool.close()

    asyncio.run(main())


def trainer_main(run_dir: Path) -> None:
    """One trainer rank (RANK/WORLD_SIZE/MASTER_* come from the launcher's environment)."""
    import torch.distributed as dist

    from pipeline.consumers.train_main import run_trainer
    from pipeline.producers.sglang_client import SGLangClient

    cfg = load_run_config(run_dir)
    rank = int(os.environ.get("RANK", "0"))
    urls = json.loads((run_dir / "engines.json").read_text()) if rank == 0 else []
    try:
        run_trainer(run_dir, cfg, model_folder(cfg), engines=[SGLangClient(u) for u in urls])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def evaluator_main(run_dir: Path) -> None:
    """The evaluator consumers of the run (stream aggregates, held-out generation), until SIGTERM."""
    from pipeline.consumers.heldout import serve_evaluators

    cfg = load_run_config(run_dir)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    serve_evaluators(run_dir, cfg, stop)


def sft_main(run_dir: Path) -> None:
    """The run's warm start (SFT of the base model into RUN_DIR/warmstart), then exit; the launcher waits for it."""
    from pipeline.consumers.sft import run_warmstart

    cfg = load_run_config(run_dir)
    run_warmstart(cfg, run_dir, base_model_folder(cfg))


ROLES = {"producer": producer_main, "trainer": trainer_main, "evaluator": evaluator_main, "sft": sft_main}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] not in ROLES:
        print(f"usage: python -m pipeline.processes {{{','.join(ROLES)}}} RUN_DIR [NAME]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args[0]} %(levelname)s %(name)s: %(message)s")
    role, run_dir, rest = args[0], Path(args[1]), args[2:]
    try:
        ROLES[role](run_dir, *rest)  # type: ignore[operator]
    except KeyboardInterrupt:
        return 0
    except Exception:
        log.exception("%s crashed", role)
        logging.shutdown()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
