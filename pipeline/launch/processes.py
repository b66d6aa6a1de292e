"""Entry points of the processes ``sluice run`` starts: ``python -m pipeline.launch.processes ROLE RUN_DIR [NAME]``.

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
import time
from pathlib import Path

from pipeline.errors import ConfigError, SluiceError
from pipeline.launch.launcher import CONFIG_EXIT_CODE, REFUSED
from pipeline.queue.credentials import resolve_url
from pipeline.rundir import archive_dir, base_model_folder, engines_path, load_run_config, model_folder

log = logging.getLogger("sluice")


def producer_main(run_dir: Path, name: str) -> None:
    """One producer: prompts -> engines -> rewards -> queue, until SIGTERM."""
    from pipeline.producers.producer import PacingConfig, ProducerSpec, open_producer
    from pipeline.producers.reporting import ProducerReporter
    from pipeline.queue.rundir import open_run

    cfg = load_run_config(run_dir, resolve_url)
    # The embedded Redis's URL, when it is one (the launcher's server: never started here).
    handle = open_run(run_dir=run_dir, redis_url=cfg.queue.redis_url, start_server=False)
    handle.close()
    spec = ProducerSpec(
        name=name, run=handle.run, redis_url=handle.url, engine_urls=json.loads(engines_path(run_dir).read_text()),
        model_dir=model_folder(cfg), producer=cfg.producer, prompts=cfg.prompts,
        pacing=PacingConfig(max_lag=cfg.staleness.max_lag, batch_groups=cfg.trainer.batch_groups),
        queue_capacity=cfg.queue.capacity, routing_codec=cfg.queue.routing_codec,
        adapters=cfg.trainer.lora is not None and cfg.engine.type == "sglang",
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with open_producer(spec) as producer:
            reporter = ProducerReporter(producer, run_dir, cfg.metrics, cfg.run.name)
            reported = asyncio.Event()
            reporting = asyncio.create_task(reporter.run(reported))
            try:
                stats = await producer.run(stop=stop)
            except BaseException:
                reporting.cancel()
                await asyncio.gather(reporting, return_exceptions=True)
                raise
            reported.set()
            await reporting
        log.info("producer %s stopped: %s", name, stats)

    asyncio.run(main())


def trainer_main(run_dir: Path) -> None:
    """One trainer rank (RANK/WORLD_SIZE/MASTER_* come from the launcher's environment)."""
    import torch.distributed as dist

    from pipeline.consumers.trainer.main import run_trainer
    from pipeline.producers.sglang_client import SGLangClient

    bind_rank0_store()  # before the heavy imports, so that the other ranks can start joining at once
    cfg = load_run_config(run_dir, resolve_url)
    rank = int(os.environ.get("RANK", "0"))

    def engines() -> list[SGLangClient]:
        if rank != 0:
            return []
        # As long as the launcher may take to place the engines, bind them and see them answer, and then some.
        urls = wait_for_engines(run_dir, cfg.ray.startup_timeout_s + cfg.engine.startup_timeout_s + 180)
        return [SGLangClient(u) for u in urls]

    try:
        run_trainer(run_dir, model_folder(cfg), engines=engines, run=cfg.run, model=cfg.model, engine=cfg.engine,
                    trainer=cfg.trainer, staleness=cfg.staleness, filters=cfg.filters, queue=cfg.queue, sync=cfg.sync,
                    heldout=cfg.eval.heldout, metrics=cfg.metrics, hooks=cfg.hooks)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def wait_for_engines(run_dir: Path, timeout_s: float, poll_s: float = 0.2) -> list[str]:
    """The engines' URLs from ``RUN_DIR/engines.json``, which the launcher writes once they answer and were adopted
    (the trainer starts while they load)."""
    path = engines_path(run_dir)
    start = time.monotonic()
    while not path.exists():
        if time.monotonic() - start > timeout_s:
            raise SluiceError(f"{path} did not appear within {timeout_s:.0f} s: the launcher writes it once the "
                              "engines answer; see the engines' logs in RUN_DIR/logs/")
        time.sleep(poll_s)
    log.info("the engines are up (engines.json), after %.1f s of waiting for them", time.monotonic() - start)
    urls = json.loads(path.read_text())
    return [str(u) for u in urls]


def evaluator_main(run_dir: Path) -> None:
    """The evaluator consumers of the run (stream aggregates, held-out generation), until SIGTERM."""
    from pipeline.heldout.evaluate import serve_evaluators

    cfg = load_run_config(run_dir, resolve_url)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    serve_evaluators(run_dir, stop, evaluation=cfg.eval, producer=cfg.producer, prompts=cfg.prompts, model=cfg.model,
                     engine=cfg.engine, run=cfg.run, plugins=cfg.plugins, metrics=cfg.metrics)


def bind_rank0_store() -> None:
    """Rank 0 of a launcher-started world binds the world's store on a port of its own choosing and writes it to
    ``SLUICE_MASTER_PORT_FILE``, which its host reports to the launcher; the other ranks get it as MASTER_PORT."""
    port_file = os.environ.pop("SLUICE_MASTER_PORT_FILE", None)
    if port_file is None or int(os.environ.get("RANK", "0")) != 0:
        return
    from pipeline.consumers.megatron.model import bind_world_store

    port = bind_world_store(int(os.environ.get("WORLD_SIZE", "1")))
    partial = Path(port_file + ".tmp")
    partial.write_text(str(port))
    partial.rename(port_file)


def archiver_main(run_dir: Path, index: str = "0") -> None:
    """Archiver ``index`` of ``queue.archive.processes``: its share of the run's stream into Parquet segments, until
    SIGTERM."""
    from pipeline.queue.archive import Archiver
    from pipeline.queue.archive_parts import ArchivePart
    from pipeline.queue.rundir import open_run

    cfg = load_run_config(run_dir, resolve_url)
    try:
        part = ArchivePart(int(index), cfg.queue.archive.processes)
    except ValueError:
        raise ConfigError(f"archiver index {index!r} is not an integer; the launcher passes 0 .. "
                          "queue.archive.processes - 1") from None
    handle = open_run(run_dir=run_dir, redis_url=cfg.queue.redis_url, start_server=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        Archiver(handle.queue, archive_dir(run_dir), part=part, segment_samples=cfg.queue.archive.segment_samples,
                 flush_interval_s=cfg.queue.archive.flush_interval_s).run(stop=stop)
    finally:
        handle.close()


def sft_main(run_dir: Path) -> None:
    """The run's warm start (SFT of the base model into RUN_DIR/warmstart), then exit; the launcher waits for it."""
    from pipeline.consumers.warmstart.sft import run_warmstart

    cfg = load_run_config(run_dir, resolve_url)
    run_warmstart(run_dir, base_model_folder(cfg), warmstart=cfg.warmstart, prompts=cfg.prompts, run=cfg.run,
                  model=cfg.model)


ROLES = {"producer": producer_main, "trainer": trainer_main, "evaluator": evaluator_main, "archiver": archiver_main,
         "sft": sft_main}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] not in ROLES:
        print(f"usage: python -m pipeline.launch.processes {{{','.join(ROLES)}}} RUN_DIR [NAME]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args[0]} %(levelname)s %(name)s: %(message)s")
    role, run_dir, rest = args[0], Path(args[1]), args[2:]
    try:
        ROLES[role](run_dir, *rest)  # type: ignore[operator]
    except KeyboardInterrupt:
        return 0
    except ConfigError as e:
        # Only a change of the recipe can fix this (a model.spec whose weights the engines cannot take, say), so a
        # distinct exit code tells the launcher to stop the run with the message rather than restart into it again.
        log.exception("%s %s %s", role, REFUSED, e)
        logging.shutdown()
        return CONFIG_EXIT_CODE
    except Exception:
        log.exception("%s crashed", role)
        logging.shutdown()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
