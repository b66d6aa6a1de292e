"""``engine.launch = true``: sluice starts the SGLang servers itself, as supervised Ray processes.

SGLang needs a GPU, so the server here is the CPU engine run under SGLang's own command line
(``engine.launch_module``): ``--model-path``, ``--host``, ``--port``, ``--weight-version 0``,
``--enable-return-routed-experts`` and the recipe's ``launch_args``. What is tested is sluice's side: the port picked
on the engine's node and published, the launch command, the warm-started model served, weights pushed to the server,
and a killed server restarted on its port.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.net import free_port

ROOT = Path(__file__).resolve().parents[2]

RECIPE = """
[run]
name = "managed"
[engine]
type = "sglang"
launch = true
launch_module = "pipeline.producers.cpu_engine"
launch_args = ["--max-batch", "16", "--log-level", "warning"]
[producer]
group_size = 4
concurrency = 2
reward = "integer_match"
[producer.sampling]
temperature = 1.0
max_new_tokens = 3
[prompts]
type = "synthetic"
task = "increment"
digits = 1
size = 10
[trainer]
steps = 8
batch_groups = 2
checkpoint_every = 2
lr = 1e-5
[warmstart]
enabled = true
steps = 60
batch_size = 32
lr = 3e-3
log_every = 20
eval_prompts = 10
[eval]
enabled = false
[queue.archive]
enabled = false
"""


def test_launch_settings_are_checked_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="engine.launch = true starts the servers, engine.urls names running ones"):
        load_config(overrides=["engine.type=sglang", "engine.launch=true", 'engine.urls=["http://h:1"]'])
    with pytest.raises(ConfigError, match="engine.launch is for engine.type = 'sglang'"):
        load_config(overrides=["engine.launch=true"])
    with pytest.raises(ConfigError, match="or engine.launch = true"):
        load_config(overrides=["engine.type=sglang"])
    # A managed server is started after the warm start, on its output: the two go together.
    cfg = load_config(overrides=["engine.type=sglang", "engine.launch=true", "warmstart.enabled=true"])
    assert cfg.engine.launch_module == "sglang.launch_server"


def test_a_managed_server_of_a_lora_run_is_started_to_load_its_adapters(tmp_path: Path) -> None:
    from pipeline.launch.launcher import _sglang_spec

    overrides = ["engine.type=sglang", "engine.launch=true", 'trainer.lora={rank=4, serve="adapter", keep_loaded=2}']
    cmd = _sglang_spec(load_config(overrides=overrides), 0, tmp_path, tmp_path, False).cmd
    server = cmd[cmd.index("--") + 1:]
    at = server.index("--lora-target-modules")
    assert server[at + 1:at + 5] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert server[server.index("--max-lora-rank") + 1] == "4" and "--enable-lora" in server
    assert server[server.index("--max-loras-per-batch") + 1] == "3"  # requests under every kept version, and one
    # Flags the recipe gives itself are left as they are.
    own = load_config(overrides=[*overrides, 'engine.launch_args=["--enable-lora", "--max-lora-rank", "64"]'])
    server = (cmd := _sglang_spec(own, 0, tmp_path, tmp_path, False).cmd)[cmd.index("--") + 1:]
    assert server.count("--enable-lora") == 1 and "--lora-target-modules" not in server
    assert load_config(overrides=["engine.type=sglang", "engine.launch=true"]).trainer.lora is None
    assert "--enable-lora" not in _sglang_spec(load_config(overrides=["engine.type=sglang", "engine.launch=true"]),
                                               0, tmp_path, tmp_path, False).cmd


def test_the_wrapper_picks_a_free_port_on_its_host() -> None:
    port = free_port("127.0.0.1")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free: nothing holds it after the pick


def _of_run(run_dir: Path) -> list[psutil.Process]:
    """Live processes working in the run folder or naming it (the embedded Redis runs in RUN_DIR/redis)."""
    found = []
    for p in psutil.process_iter(["cmdline", "cwd"]):
        if str(run_dir) in " ".join(p.info["cmdline"] or []) or str(run_dir) in (p.info["cwd"] or ""):
            found.append(p)
    return found


@pytest.mark.slow
def test_sluice_starts_supervises_and_pushes_to_a_managed_server(tmp_path: Path) -> None:
    recipe = tmp_path / "managed.toml"
    recipe.write_text(RECIPE)
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(tmp_path / "launcher.log", "wb")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", str(recipe), "--run-dir", str(run_dir)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        engines = run_dir / "engines.json"
        metrics = run_dir / "metrics" / "trainer.jsonl"
        deadline = time.monotonic() + 400
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no third step in time"
            time.sleep(0.5)
        [url] = json.loads(engines.read_text())
        port = int(url.rsplit(":", 1)[1])
        first = (run_dir / "logs" / "engine-0.log").read_text()
        launch = re.search(r"sglang_launch: exec (.*)", first)
        assert launch is not None, first[-2000:]
        words = launch.group(1).split()
        # SGLang's command line, with the port the wrapper picked and published.
        assert words[words.index("--port") + 1] == str(port)
        assert words[words.index("--weight-version") + 1] == "0" and "--enable-return-routed-experts" in words
        assert words[words.index("--model-path") + 1].endswith(os.path.join("warmstart", "model"))
        assert words[-4:] == ["--max-batch", "16", "--log-level", "warning"]
        # The server itself (exec'd in place of the wrapper), not the reaper that watches it.
        server = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[1:3] == [
            "-m", "pipeline.producers.cpu_engine"] and str(run_dir) in " ".join(p.info["cmdline"])]
        assert len(server) == 1
        server[0].send_signal(signal.SIGKILL)  # the supervisor restarts it, on the same port (the URL stays valid)
        assert proc.wait(timeout=400) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for p in _of_run(run_dir):  # the launcher died before stopping them: the embedded Redis, say
                p.kill()
    assert not _of_run(run_dir), "processes of the run still alive after it ended"
    steps = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert steps[-1]["step"] == 8
    # The server sampled the warm-started weights (the untrained model almost never answers "8" to "7+1=").
    assert steps[0]["reward_mean"] > 0.5
    relaunched = (run_dir / "logs" / "engine-0.log").read_text().count("sglang_launch: exec")
    assert relaunched >= 2 and json.loads(engines.read_text()) == [url]
    for line in (run_dir / "logs" / "engine-0.log").read_text().splitlines():
        if line.startswith("sglang_launch: exec"):
            words = line.split()
            assert words[words.index("--port") + 1] == str(port)
    # The version advances only once every engine holds the step's weights: the server took all eight pushes.
    assert steps[-1]["policy_version"] == 8
