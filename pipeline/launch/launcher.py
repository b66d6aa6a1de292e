"""``sluice run``: every process of a run on Ray, placed by Ray, supervised by the launcher.

The launcher owns the run folder, the embedded Redis and the run's lock. It connects to Ray (a private instance for
the run by default, or the cluster of ``ray.address``), then starts each process of the run as a ``HostedProcess``
(``pipeline.launch.cluster``) with the resources the recipe gives its role: the warm start, the CPU engines (or it
connects to SGLang servers), the producers, the trainer ranks (one placement group), the evaluator and the
archiver. It restarts what dies: engines, producers, the evaluator and the archiver come back by themselves under a
restart budget per window; the trainer ranks restart together from the last checkpoint. It stops when the trainer
finishes its steps, or on SIGINT, SIGTERM or SIGHUP (docs/launcher.md: the stop, the lock, the hosting).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis

from pipeline.config import RoleResources, SluiceConfig, public_dict
from pipeline.consumers.warmstart.config import format_summary, read_done
from pipeline.errors import EngineError, SluiceError
from pipeline.launch.cluster import ProcessSpec, RestartBudget, check_resources
from pipeline.launch.control import Interrupted, RedisWatch, RunLock, RunLockedError, StopRequest
from pipeline.launch.supervisor import Supervisor
from pipeline.models.spec import engine_patch_args
from pipeline.observe.live import LiveView
from pipeline.observe.report import format_curve, format_heldout, learning_curve
from pipeline.queue.archive_parts import archive_parts, check_archive_layout
from pipeline.queue.connection import check_fsync_always, connect, has_secret, redact_url
from pipeline.queue.credentials import ENV_URL, remove_secret_url, write_secret_url
from pipeline.queue.redis_server import EmbeddedRedis
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.rundir import RunHandle, open_run
from pipeline.rundir import (
    RUN_FILE,
    archive_dir,
    base_model_folder,
    config_path,
    engines_path,
    eval_metrics_path,
    latest_checkpoint,
    log_path,
    model_folder,
    placements_path,
    plugins_path,
    port_path,
    redis_dir,
    trainer_metrics_path,
    warmstart_dir,
)

__all__ = ["RunLock", "RunLockedError", "run", "prepare_run", "ensure_base_model"]

log = logging.getLogger(__name__)

# How long the orderly stop waits for the trainer ranks' last step, push and commit (a checkpoint save) before it
# kills them; the data is safe either way (the entries stay pending), only the uncommitted steps are redone.
TRAINER_STOP_S = 120.0
CHILD_STOP_S = 30.0  # the same for every other process, once the trainer ranks are gone
# Passed on to every process: on a cluster a process's environment is its node's, not the launcher's.
_PASSED_ENV_PREFIXES = ("SLUICE_", "HF_", "TRANSFORMERS_", "TORCH_")
_PASSED_ENV = ("PYTHONPATH", "OMP_NUM_THREADS")


def prepare_run(cfg: SluiceConfig, handle: RunHandle | None = None) -> tuple[RunHandle, Path]:
    """Create the run folder, start (or reuse) its Redis, write the resolved config, and make sure a model exists.

    Returns the folder engines and trainer start from (``model_folder``). With ``warmstart.enabled`` that is the
    warm start's output, which exists only once ``warm_start`` has run. ``sluice run`` passes the handle it opened to
    take the run's lock, so that nothing here touches a live run.
    """
    run_dir = Path(cfg.run.run_dir)
    handle = handle or open_run_folder(cfg)
    ensure_base_model(cfg)
    # Credentials redacted: the run's processes read the secret from the launcher's private file instead.
    config_path(run_dir).write_text(json.dumps(public_dict(cfg), indent=1))
    # What user code the run executes, down to the byte: a result can be traced to the plug-ins that made it.
    plugins_path(run_dir).write_text(json.dumps(cfg.plugin_records(), indent=1) + "\n")
    if has_secret(handle.url):
        write_secret_url(run_dir, handle.url)
    for name in ("trainer", *archive_groups(cfg, handle.queue), *([cfg.eval.group] if cfg.eval.enabled else [])):
        handle.queue.create_group(name, "0")
    return handle, model_folder(cfg)


def archive_groups(cfg: SluiceConfig, queue: SampleQueue) -> list[str]:
    """The consumer groups of the run's archivers, once the run's archive is known to keep its split: checked before
    any group is created, since the groups of another split would hold the stream's trim back for good."""
    if not cfg.queue.archive.enabled:
        return []
    check_archive_layout(cfg.queue.archive.processes, queue.group_names(), archive_dir(Path(cfg.run.run_dir)))
    return [p.group for p in archive_parts(cfg.queue.archive.processes)]


def archiver_specs(cfg: SluiceConfig) -> list[ProcessSpec]:
    """One process per archiver, each supervised and restarted on its own; a lone archiver keeps the name and
    command line it always had."""
    if not cfg.queue.archive.enabled:
        return []
    run_dir = Path(cfg.run.run_dir).resolve()
    return [_spec(cfg, "archiver", p.process_name, ["archiver", str(run_dir), *([] if p.alone else [str(p.index)])])
            for p in archive_parts(cfg.queue.archive.processes)]


def _start_embedded_redis(cfg: SluiceConfig) -> EmbeddedRedis | None:
    """Start the run's embedded Redis, if it uses one and none runs, tied to this launcher: a SIGKILLed launcher
    takes it along (``EmbeddedRedis.owner_pid``), as its reapers take the rest of the run. Started here, before
    ``open_run_folder`` reuses it, because a server that process started untied would have to be started again to be
    tied, and a resumed run's AOF read twice."""
    run_dir = Path(cfg.run.run_dir)
    if cfg.queue.redis_url is not None or os.environ.get(ENV_URL):
        return None
    run_file = run_dir / RUN_FILE
    if run_file.exists() and json.loads(run_file.read_text()).get("redis_url"):
        return None  # the folder's run uses an external server
    return EmbeddedRedis(redis_dir(run_dir), appendfsync=cfg.queue.appendfsync, owner_pid=os.getpid()).start()


def open_run_folder(cfg: SluiceConfig) -> RunHandle:
    """The run's queue, the run folder created and the embedded Redis started (or reused) where needed."""
    return open_run(run_dir=Path(cfg.run.run_dir), redis_url=cfg.queue.redis_url, run=cfg.run.name, create=True,
                    appendfsync=cfg.queue.appendfsync, capacity=cfg.queue.capacity)


def ensure_base_model(cfg: SluiceConfig) -> Path:
    """The base model folder; with model.path unset, the tiny model is written into the run folder first."""
    model_dir = base_model_folder(cfg)
    if not (model_dir / "config.json").exists():
        if cfg.model.path is not None:
            raise SluiceError(f"model.path {model_dir} has no config.json; point it at an HF model folder")
        from pipeline.models.tiny import init_tiny_model

        init_tiny_model(cfg.model.init_tiny, model_dir, seed=cfg.model.init_seed, **cfg.model.init_overrides)
    return model_dir


def _env(**extra: str) -> dict[str, str]:
    # The Redis URL stays behind: it may hold a password, and a spec's environment travels through Ray. The
    # processes read it from the launcher's private file (pipeline.queue.credentials).
    env = {k: v for k, v in os.environ.items()
           if (k.startswith(_PASSED_ENV_PREFIXES) or k in _PASSED_ENV) and k != ENV_URL}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def _spec(cfg: SluiceConfig, role: str, name: str, args: list[str], *, env: dict[str, str] | None = None,
          port_file: Path | None = None, module: str = "pipeline.launch.processes") -> ProcessSpec:
    want: RoleResources = getattr(cfg.ray, role)
    run_dir = Path(cfg.run.run_dir).resolve()
    return ProcessSpec(name, [sys.executable, "-m", module, *args], str(log_path(run_dir, name)),
                       env=_env(**(env or {})), num_cpus=want.num_cpus, num_gpus=want.num_gpus,
                       resources=dict(want.resources), port_file=None if port_file is None else str(port_file),
                       cwd=os.getcwd())


def _starts_engines(cfg: SluiceConfig) -> bool:
    return cfg.engine.type == "cpu" or cfg.engine.launch


def _cpus_needed(cfg: SluiceConfig) -> float:
    """What the run's processes reserve in all: the CPUs a private instance offers (the OS shares the cores)."""
    r = cfg.ray
    total = (cfg.engine.count * r.engine.num_cpus * _starts_engines(cfg) + cfg.producers * r.producer.num_cpus
             + cfg.trainer.world_size * r.trainer.num_cpus + r.evaluator.num_cpus
             + cfg.queue.archive.processes * r.archiver.num_cpus
             + r.trainer.num_cpus)  # the warm start, whose exit overlaps the engines' start
    return float(max(math.ceil(total), os.cpu_count() or 1))


def warm_start(cfg: SluiceConfig, run_dir: Path, sup: Supervisor,
               pause: Callable[[float], None] = time.sleep) -> None:
    """Run the recipe's warm start as a process with the trainer's resources (its time counts in the run's), unless
    one has finished.

    Returns once the process has written its done marker, which it writes last: its own exit (interpreter teardown,
    a few seconds) then overlaps the engines' start-up. It reads RUN_DIR/config.json, so ``prepare_run`` must have
    written it.
    """
    done = read_done(run_dir)
    if done is not None:
        if done.get("config") != cfg.warmstart.model_dump(mode="json"):
            log.warning("[warmstart] changed since the warm start in %s ran; keeping the finished one (delete that "
                        "folder to train it again)", warmstart_dir(run_dir))
        print(f"warm start skipped, already done ({format_summary(done)})", flush=True)
        return
    spec = _spec(cfg, "trainer", "warmstart", ["sft", str(run_dir)])
    ws = cfg.warmstart
    stops = ([] if ws.until_loss is None else [f"mean loss <= {ws.until_loss}"]) + (
        [] if ws.until_exact_match is None else [f"exact match >= {ws.until_exact_match}"])
    until = f", or until a {ws.log_every}-step window's {' or '.join(stops)}" if stops else ""
    print(f"warm start: {ws.steps} steps of SFT{until} (log: {spec.log_path})", flush=True)
    sup.start([spec], restartable=False)
    while (done := read_done(run_dir)) is None:
        code = sup.exit_code("warmstart")
        if code is not None:
            # Read once more: the marker may have landed between the two checks.
            if (done := read_done(run_dir)) is not None:
                break
            raise SluiceError(f"the warm start failed (exit code {code}); see {spec.log_path}")
        pause(0.2)
    print(format_summary(done), flush=True)


def wait_healthy(urls: list[str], timeout_s: float, pause: Callable[[float], None] = time.sleep) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        for url in list(pending):
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    pending.remove(url)
            except httpx.HTTPError:
                pass
        pause(0.2)
    if pending:
        raise EngineError(f"engines {pending} did not answer /health within {timeout_s:.0f}s; see their logs")


def launch_engines(cfg: SluiceConfig, sup: Supervisor, model_dir: Path, run_dir: Path,
                   pause: Callable[[float], None] = time.sleep, *, hold: bool = False) -> Callable[[], list[str]]:
    """Set the CPU engines (or managed SGLang servers) going, each to bind a port of its own choosing on the node Ray
    put it on; the returned call waits until they run and answer, and gives their URLs. Other processes start
    meanwhile.

    ``hold``: they serve nothing until the trainer's first push (a resumed run's trainer pushes its weights at once;
    until then the engines hold only the starting model's). A restarted engine always holds.
    """
    if cfg.engine.type == "sglang" and not cfg.engine.launch:
        def external() -> list[str]:
            wait_healthy(list(cfg.engine.urls), cfg.engine.startup_timeout_s, pause)
            return list(cfg.engine.urls)

        return external
    managed = cfg.engine.type == "sglang"
    specs = [(_sglang_spec if managed else _cpu_engine_spec)(cfg, i, model_dir, run_dir, hold)
             for i in range(cfg.engine.count)]
    pending = sup.launch(specs, stop_last=True)

    def finish() -> list[str]:
        infos = pending.wait(pause)
        urls = [_url(info) for info in infos]
        for i, info in enumerate(infos):
            child = sup.children[f"engine-{i}"]
            # A restart binds the port it had, wherever it lands: on the same node its URL then stays what producers
            # and the trainer know. Only on another node (its node was lost) does the URL change.
            # And it serves nothing before the trainer's next push has re-synced it.
            # (An SGLang server has no such hold: a restarted one serves its starting weights, labelled version 0,
            # until the push re-syncs it, and the staleness policy drops what it makes meanwhile.)
            cmd = [str(info["port"]) if a == "0" and child.process.spec.cmd[j - 1] == "--port" else a
                   for j, a in enumerate(child.process.spec.cmd)]
            if not managed and "--hold-until-update" not in cmd:
                cmd.append("--hold-until-update")
            child.process.spec = dataclasses.replace(child.process.spec, cmd=cmd)
            child.on_restart = lambda new, i=i: _engine_restarted(sup, run_dir, i, _url(new))
        wait_healthy(urls, cfg.engine.startup_timeout_s, pause)
        return urls

    return finish


def serving_model_dir(cfg: SluiceConfig, model_dir: Path, run_dir: Path) -> Path:
    """The folder SGLang engines start from (and are reloaded from at adoption): the model's own, or with
    ``engine.weight_dtype = "fp8"`` an FP8 checkpoint of it in the run folder, since SGLang serves block FP8 only from
    a checkpoint that says so (``pipeline.quant.checkpoint``). CPU engines quantize on load and take the model's."""
    if cfg.engine.type != "sglang" or cfg.engine.weight_dtype != "fp8":
        return model_dir
    from pipeline.quant.checkpoint import ensure_fp8_checkpoint

    return ensure_fp8_checkpoint(model_dir, run_dir / "engine-model-fp8")


def _cpu_engine_spec(cfg: SluiceConfig, i: int, model_dir: Path, run_dir: Path, hold: bool) -> ProcessSpec:
    port_file = port_path(run_dir, f"engine-{i}")
    args = [str(model_dir.resolve()), "--host", "{node_ip}", "--port", "0", "--port-file", str(port_file),
            "--dtype", cfg.engine.dtype, "--max-batch", str(cfg.engine.max_batch), "--seed", str(cfg.run.seed + i),
            "--log-level", "warning"]
    if cfg.producer.return_routed_experts:
        args.append("--enable-return-routed-experts")
    if hold:
        args.append("--hold-until-update")
    if cfg.trainer.lora is not None:
        args += ["--lora", cfg.trainer.lora.serve]
    if cfg.engine.weight_dtype == "fp8":
        args += ["--weight-dtype", "fp8"]
    args += engine_patch_args(cfg.model.engine_patch, cfg.plugins.paths)
    return _spec(cfg, "engine", f"engine-{i}", args, port_file=port_file, module="pipeline.producers.cpu_engine")


def _sglang_spec(cfg: SluiceConfig, i: int, model_dir: Path, run_dir: Path, hold: bool) -> ProcessSpec:
    """A managed SGLang server (``engine.launch``): its node picks the port (``pipeline.producers.sglang_launch``).

    It starts labelled version 0, an integer (SGLang's own default label is "default", which no sample may carry);
    adoption then relabels or re-syncs it like any engine. ``hold`` has no SGLang counterpart: a resumed run's
    trainer pushes its weights first thing, and samples made before that are stale and dropped.
    """
    port_file = port_path(run_dir, f"engine-{i}")
    server = ["--model-path", str(model_dir.resolve()), "--weight-version", "0"]
    if cfg.producer.return_routed_experts:
        server.append("--enable-return-routed-experts")
    lora = cfg.trainer.lora
    if lora is not None and "--enable-lora" not in cfg.engine.launch_args:
        # No adapter at start (version 0 is the base): SGLang then needs the rank and modules to size its buffers.
        server += ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *lora.targets,
                   "--max-loras-per-batch", str(lora.keep_loaded + 1)]
    args = ["--module", cfg.engine.launch_module, "--host", "{node_ip}", "--port", "0", "--port-file", str(port_file)]
    if cfg.engine.python is not None:
        args += ["--python", cfg.engine.python]
    args += ["--", *server, *cfg.engine.launch_args]
    return _spec(cfg, "engine", f"engine-{i}", args, port_file=port_file, module="pipeline.producers.sglang_launch")


def _url(info: dict[str, Any]) -> str:
    return f"http://{info['node_ip']}:{info['port']}"


def _engine_restarted(sup: Supervisor, run_dir: Path, index: int, url: str) -> None:
    path = engines_path(run_dir)
    urls = json.loads(path.read_text())
    if urls[index] == url:
        return
    log.warning("engine-%d moved to %s; restarting the producers so that they use it", index, url)
    urls[index] = url
    write_engines(run_dir, urls)
    # Producers read engines.json when they start; the trainer's push rereads it before each push
    # (pipeline.sync.rotation) and re-syncs the engine at its new address.
    for name in [n for n in sup.children if n.startswith("producer-")]:
        sup.children[name].process.discard()


def write_engines(run_dir: Path, urls: list[str]) -> None:
    """``RUN_DIR/engines.json``, whole or not at all: trainer rank 0 reads it the moment it appears, producers when
    they start."""
    final = engines_path(run_dir)
    partial = final.with_name(final.name + ".tmp")
    partial.write_text(json.dumps(urls))
    partial.rename(final)


def start_trainers(cfg: SluiceConfig, sup: Supervisor, run_dir: Path, placement: Any) -> list[str]:
    """The trainer ranks in their placement group. Rank 0 binds the world's store on a port of its choosing and
    reports it; the other ranks then join it at rank 0's node."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world = cfg.trainer.world_size
    names = [f"trainer-{r}" for r in range(world)]
    port_file = port_path(run_dir, "trainer-0")
    strategy = [PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=r) for r in range(world)]
    env = {"WORLD_SIZE": str(world), "LOCAL_RANK": "0"}  # Ray gives each rank its own GPUs, as device 0
    rank0 = _spec(cfg, "trainer", names[0], ["trainer", str(run_dir)], port_file=port_file,
                  env={**env, "RANK": "0", "SLUICE_MASTER_PORT_FILE": str(port_file)})
    info = sup.start([rank0], restartable=False, scheduling=strategy[:1])[0]
    rest = [_spec(cfg, "trainer", names[r], ["trainer", str(run_dir)],
                  env={**env, "RANK": str(r), "MASTER_ADDR": info["node_ip"], "MASTER_PORT": str(info["port"])})
            for r in range(1, world)]
    if rest:
        sup.start(rest, restartable=False, scheduling=strategy[1:])
    return names


def trainer_placement(cfg: SluiceConfig) -> Any:
    """One bundle per trainer rank, placed as ``ray.trainer_strategy`` says; waits until Ray has placed them."""
    import ray
    from ray.util.placement_group import placement_group

    want = cfg.ray.trainer
    bundle = {k: v for k, v in {"CPU": want.num_cpus, "GPU": want.num_gpus, **want.resources}.items() if v > 0}
    group = placement_group([dict(bundle) for _ in range(cfg.trainer.world_size)],
                            strategy=cfg.ray.trainer_strategy, name=f"sluice-{cfg.run.name}-trainer")
    try:
        ray.get(group.ready(), timeout=cfg.ray.startup_timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise SluiceError(f"Ray could not place the trainer's {cfg.trainer.world_size} bundles of {bundle} "
                          f"({cfg.ray.trainer_strategy}) within {cfg.ray.startup_timeout_s:.0f}s; the cluster offers "
                          f"{ray.cluster_resources()}") from None
    return group


def _check_resources(cfg: SluiceConfig) -> None:
    """Refuse, before any process starts, a role whose resources no node offers."""
    from pipeline.launch.ray_runtime import cluster_resources

    offered = cluster_resources()
    roles = ["trainer", "producer", *(["engine"] if _starts_engines(cfg) else []),
             *(["evaluator"] if cfg.eval.enabled or cfg.eval.heldout.enabled and cfg.eval.heldout.live else []),
             *(["archiver"] if cfg.queue.archive.enabled else [])]
    for role in roles:
        want: RoleResources = getattr(cfg.ray, role)
        check_resources(ProcessSpec(f"ray.{role}", [], "", num_cpus=want.num_cpus, num_gpus=want.num_gpus,
                                    resources=dict(want.resources)), offered)


def run(cfg: SluiceConfig) -> int:
    """The whole job; returns the exit code (128 + the signal's number after a stop by signal)."""
    from pipeline.launch.ray_runtime import PrivateHead, connected, start_private_head

    started = time.monotonic()
    run_dir = Path(cfg.run.run_dir)
    # Every process of the run inherits it (Ray's too): what finds them all, wherever Ray put them.
    os.environ["SLUICE_RUN_DIR"] = str(run_dir.resolve())
    sup = Supervisor(budget=lambda: RestartBudget(cfg.ray.restart_limit, cfg.ray.restart_window_s),
                     start_timeout_s=cfg.ray.startup_timeout_s, placements=placements_path(run_dir))
    stop = StopRequest(on_force=sup.force)
    stop.install()  # first: from here on a signal leads to the orderly stop, whatever is starting
    try:
        tied = _start_embedded_redis(cfg)
        handle = open_run_folder(cfg)  # reuses the server just started
        try:
            lock = RunLock.acquire(handle.queue.redis, handle.queue.keys.launcher, f"run {handle.run!r} in {run_dir}",
                                   on_lost=stop.request)
        except BaseException:
            handle.close(stop_server=True)  # stops the embedded Redis only if this launcher started it
            if tied is not None and tied.started_here:
                tied.stop()
            raise
        if handle.server is not None:
            # The run's embedded Redis is the live launcher's, even one a killed launcher left, and it dies with this
            # launcher however the launcher ends: one that runs untied (left by an older sluice) is restarted tied.
            handle.server.adopt(owner_pid=os.getpid())
        head: PrivateHead | None = None
        try:
            if cfg.ray.address is None:  # it starts while the run folder is prepared
                head = start_private_head(run_dir, num_cpus=_cpus_needed(cfg), dashboard=cfg.ray.dashboard)
            _, model_dir = prepare_run(cfg, handle)
            _check_durability(cfg, handle)
            stop.pause(0)
            with connected(run_dir, head if head is not None else str(cfg.ray.address)) as ray_instance:
                head = None  # stopped by ``connected`` from here on
                stop.reinstall()
                where = "a private Ray instance" if ray_instance.head else f"the Ray cluster at {ray_instance.address}"
                dashboard = f", dashboard {ray_instance.dashboard_url}" if ray_instance.dashboard_url else ""
                print(f"processes on {where}{dashboard}", flush=True)
                try:
                    _check_resources(cfg)
                    placement = _start_children(cfg, sup, handle, model_dir, stop.pause)
                    _supervise(cfg, sup, handle, placement, stop.pause)
                    print(format_curve(learning_curve(trainer_metrics_path(run_dir))))
                    if cfg.eval.heldout.enabled and cfg.eval.heldout.live:
                        _wait_for_heldout(sup, run_dir, cfg.eval.heldout.final_wait_s, stop.pause)
                        print(format_heldout(eval_metrics_path(run_dir)))
                    from pipeline.observe.plots import write_plots  # matplotlib: only now

                    print(f"plots: {', '.join(str(p) for p in write_plots(run_dir).values())}")
                    print(f"run folder: {run_dir}  (sluice queue audit --run-dir {run_dir})")
                    return 0
                finally:
                    stop.begin_stop()  # a signal from here on forces the stop
                    stop.killed = sup.stop_all(TRAINER_STOP_S, CHILD_STOP_S)
        except Interrupted:  # a stop signal, or the lock lost; whatever had started is stopped by now
            if lock.lost:
                raise RunLockedError(f"another launcher took the lock of {run_dir} while this one ran (see the log "
                                     "above); this launcher stopped whatever it had started") from None
            assert stop.signum is not None
            return 128 + stop.signum
        finally:
            if head is not None:
                head.stop()  # stopped before it was ever connected to
            lock.release()
            remove_secret_url(run_dir)  # no credential stays in the folder once its processes are gone
            handle.close(stop_server=True)  # the embedded Redis flushes its AOF and exits
            if stop.signum is not None:
                print(_stopped_summary(run_dir, stop), flush=True)
            print(f"wall time: {time.monotonic() - started:.0f} s, warm start and shutdown included")
    finally:
        stop.uninstall()


def _start_children(cfg: SluiceConfig, sup: Supervisor, handle: RunHandle, model_dir: Path,
                    pause: Callable[[float], None]) -> Any:
    """Warm start, engines, producers, trainer ranks, evaluator and archiver; returns the trainer's placement
    group."""
    run_dir = Path(cfg.run.run_dir).resolve()
    if cfg.warmstart.enabled:
        warm_start(cfg, run_dir, sup, pause)
    placement = trainer_placement(cfg)
    # A trainer that started before (``Trainer.resume``) may have left the engines half-pushed: not a fresh start.
    resuming = (latest_checkpoint(run_dir) is not None or handle.queue.policy_version() > 0
                or handle.queue.trainer_started_before())
    # The trainer ranks build their model while the engines load theirs: rank 0 waits for engines.json only when it
    # first needs the engines, and a file an earlier launch left must not be taken for this one's.
    engines_path(run_dir).unlink(missing_ok=True)
    serve_dir = serving_model_dir(cfg, model_dir, run_dir)
    engines_up = launch_engines(cfg, sup, serve_dir, run_dir, pause, hold=resuming)
    start_trainers(cfg, sup, run_dir, placement)
    others = []
    if cfg.eval.enabled or (cfg.eval.heldout.enabled and cfg.eval.heldout.live):
        others.append(_spec(cfg, "evaluator", "evaluator", ["evaluator", str(run_dir)]))
    others += archiver_specs(cfg)
    others_up = sup.launch(others) if others else None  # they need Redis only
    urls = engines_up()
    # Engines sluice did not start may hold another run's weights or SGLang's "default" label;
    # settle that before any producer samples from them, or the trainer pushes to them (pipeline.sync.lifecycle).
    from pipeline.producers.sglang_client import adopt_engine_urls

    adopt_engine_urls(urls, version=handle.queue.policy_version(), fresh=not resuming,
                      model_path=str(serve_dir.resolve()))
    write_engines(run_dir, urls)
    pause(0)
    sup.start([_spec(cfg, "producer", f"producer-{i}", ["producer", str(run_dir), f"producer-{i}"])
               for i in range(cfg.producers)])
    if others_up is not None:
        others_up.wait(pause)
    return placement


# Each tick asks every process's Ray host for its state (an actor call each, in the launcher and in the hosts), which
# at 2 Hz cost about a tenth of a core on the cores the run trains on; once a second still restarts a crash within the
# second and refreshes the live panel as often, and a stop signal ends the pause at once.
_SUPERVISE_TICK_S = 1.0


def _supervise(cfg: SluiceConfig, sup: Supervisor, handle: RunHandle, placement: Any,
               pause: Callable[[float], None]) -> None:
    """Restart what dies and trim the stream until every trainer rank has finished its steps."""
    run_dir = Path(cfg.run.run_dir)
    trainers = {f"trainer-{r}" for r in range(cfg.trainer.world_size)}
    budget = RestartBudget(cfg.ray.restart_limit, cfg.ray.restart_window_s)
    redis_watch = _redis_watch(cfg, sup, handle)
    finished: set[str] = set()
    last_trim = time.monotonic()
    # The view reads Redis on a client of its own that does not retry: while the embedded Redis is down, a refresh
    # fails at once and is skipped, and this loop goes on to the watch that restarts it (the run's client would retry
    # for about 15 s, and the other processes' retries could run out meanwhile).
    view_queue = SampleQueue(connect(handle.url, retry=None, socket_timeout=5.0, socket_connect_timeout=2.0),
                             handle.run)
    with view_queue.redis, LiveView(run_dir, view_queue, cfg.trainer.steps) as progress:
        while not trainers <= finished:
            if redis_watch is not None:
                redis_watch.check(pause)
            finished.update(sup.poll())
            if _trainer_group_failed(sup, trainers):
                _restart_trainer_group(cfg, sup, trainers, budget, placement, pause)
                finished -= trainers
            now = time.monotonic()
            if now - last_trim > 10:
                try:
                    handle.queue.trim()  # drops only what every group has acked
                except redis.ConnectionError as e:  # the embedded Redis died this moment: watched above, trimmed later
                    log.warning("could not trim the stream (%s); trying again in 10 s", e)
                last_trim = now
            progress.tick()
            pause(_SUPERVISE_TICK_S)


def _redis_watch(cfg: SluiceConfig, sup: Supervisor, handle: RunHandle) -> RedisWatch | None:
    """The embedded Redis's watch (an external server is its owner's to keep up)."""
    if handle.server is None:
        return None

    def restart_producers() -> None:
        for name in sorted(n for n in sup.children if n.startswith("producer-")):
            sup.children[name].process.discard()  # the supervisor restarts it at its next poll

    # No backoff: every process waits on the server, and its clients give up after about 15 s of tries.
    return RedisWatch(handle.server, RestartBudget(cfg.ray.restart_limit, cfg.ray.restart_window_s, backoff_s=0.0),
                      on_restart=restart_producers)


def _check_durability(cfg: SluiceConfig, handle: RunHandle) -> None:
    """queue.durability = 'safe' on an external server: it must fsync its AOF before every reply."""
    if cfg.queue.durability != "safe" or handle.server is not None:
        return
    if not check_fsync_always(handle.queue.redis, handle.url):
        log.warning("queue.durability = 'safe': the Redis server at %s does not let this user read its config, so "
                    "sluice cannot check that it runs with appendonly yes and appendfsync always; make sure it does",
                    redact_url(handle.url))


CONFIG_EXIT_CODE = 3
"""Exit code of a run's process that raised ConfigError: restarting cannot help, so the launcher stops the run."""
REFUSED = "refused the run's config:"
"""What such a process logs before the error's message (the launcher quotes the message from the log)."""


def _refusal(log_path: str | Path) -> str:
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    found = [line.split(REFUSED, 1)[1].strip() for line in lines if REFUSED in line]
    return found[-1] if found else ""


def _trainer_group_failed(sup: Supervisor, trainers: set[str]) -> bool:
    return any(sup.exit_code(n) not in (None, 0) for n in sorted(trainers))


def _restart_trainer_group(cfg: SluiceConfig, sup: Supervisor, trainers: set[str], budget: RestartBudget,
                           placement: Any, pause: Callable[[float], None]) -> None:
    """Trainer ranks live and die together: once one failed, the others can finish no collective, so all are
    killed at once and the whole group starts again from the last checkpoint, after the budget's backoff."""
    failed = sorted(n for n in trainers if sup.exit_code(n) not in (None, 0))
    log_path = sup.children[failed[0]].log_path
    refused = [n for n in failed if sup.exit_code(n) == CONFIG_EXIT_CODE]
    if refused:
        refused_log = sup.children[refused[0]].log_path
        raise SluiceError(f"{refused[0]} {REFUSED} {_refusal(refused_log) or '(no message)'} (not restarted: only a "
                          f"change of the recipe fixes this; log: {refused_log})")
    up_since = min(sup.children[n].process.up_since for n in trainers)
    try:
        delay = budget.next_delay(time.monotonic(), up_since)
    except SluiceError as e:
        raise SluiceError(f"the trainer failed again: {e}; see {log_path}") from None
    log.warning("%s failed; restarting the trainer group from its last checkpoint in %.0f s (log: %s)",
                ", ".join(failed), delay, log_path)
    sup.kill_group(sorted(trainers))
    for name in trainers:
        del sup.children[name]
    pause(delay)
    start_trainers(cfg, sup, Path(cfg.run.run_dir).resolve(), placement)


def _stopped_summary(run_dir: Path, stop: StopRequest) -> str:
    latest = latest_checkpoint(run_dir)
    committed = "no checkpoint yet" if latest is None else f"last checkpoint {latest.name}"
    if stop.forced:
        how = "forced"
    elif stop.killed:
        how = f"stopped; {', '.join(stop.killed)} outlived the stop's timeout and were SIGKILLed"
    else:
        how = "stopped in order"
    return (f"{how} after {signal.Signals(stop.signum or signal.SIGTERM).name} ({committed}); run the same command "
            "again to resume")


def _wait_for_heldout(sup: Supervisor, run_dir: Path, timeout_s: float,
                      pause: Callable[[float], None] = time.sleep) -> None:
    """Keep the evaluator supervised until it has evaluated the final snapshot, or ``timeout_s`` passed."""
    from pipeline.heldout.evaluate import caught_up

    deadline = time.monotonic() + timeout_s
    while not caught_up(run_dir):
        if time.monotonic() > deadline:
            log.warning("the final snapshot was not evaluated within %.0fs (eval.heldout.final_wait_s); run "
                        "`sluice eval --run-dir %s --heldout` to evaluate it", timeout_s, run_dir)
            return
        sup.poll()
        pause(0.5)

