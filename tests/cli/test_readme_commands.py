"""Every command README.md shows runs as written: the ```bash blocks are read from the README itself, so that a
changed command is what gets tested, and each runs in a fresh folder (``recipes/`` and ``examples/`` linked in, the
runs written under ``runs/`` there) against a short finished run of the quick start.

Commands that train get a few steps (``SHORT``); the few that cannot run here are in ``NOT_RUN`` with the reason.
The quick start's own run is the ``sluice run`` line of scripts/quickstart.sh, short too. It and the commands that
look into it run in order in one lane; the other commands, which need nothing of it, take turns in a second lane,
and in the first once it is done.
"""

from __future__ import annotations

import os
import queue
import shlex
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]

# Appended to every `sluice run` that trains: two steps, so that each run still goes through every stage (warm
# start, engine, producer, queue, trainer, push) in seconds.
SHORT = ["--set", "trainer.steps=2", "--set", "trainer.batch_groups=4"]
# The quick start's run keeps its warm start whole (a few seconds: it stops at its loss target), so that its samples
# are those of a policy that gets some sums right, as the replay of its archive expects, and its held-out evaluation
# (`sluice eval --heldout` looks at its snapshots), on a few prompts.
SHORT_QUICKSTART = ["--set", "prompts.heldout=8"]
# The other runs: a token warm start, and no held-out evaluation. A policy that has barely learnt answers every
# prompt of a group alike, so the zero-variance filter would hold a step back for dozens of batches: it is off.
SHORT_ELSEWHERE = ["--set", "warmstart.steps=5", "--set", "filters.zero_variance=false",
                   "--set", "eval.heldout.enabled=false"]
SHORT_REPLAY = ["--set", "trainer.steps=2"]

# README commands not run here, each with why; every entry must still match a command of the README.
NOT_RUN = {
    "bash scripts/quickstart.sh": "the quick start in full (it sets up .venv, then trains the recipe for minutes); "
                                  "its `sluice run` line runs here, short, as the run the other commands look into",
    "bash scripts/test.sh": "the test suite, which this test is part of",
    ". .venv/bin/activate": "sets up the shell; the test runs inside that environment",
    "tensorboard --logdir": "a server that runs until stopped, and not sluice's",
    "sluice bench pipeline": "a benchmark: two runs of the CPU recipe, each with its full warm start (close to two "
                             "minutes even at 3 steps per mode, more than this whole test); its figures are in "
                             "benchmarks/README.md",
    "--ray-address HEAD:6379": "needs a Ray cluster at HEAD and a Redis at HOST that every node reaches",
}


def readme_commands(text: str) -> list[str]:
    """The command lines of the ```bash blocks, in order, with continuation lines joined."""
    commands: list[str] = []
    in_bash, pending = False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_bash = not in_bash and line.strip() == "```bash"
            continue
        if not in_bash:
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if shlex.split(command, comments=True):
            commands.append(command)
    return commands


def why_not_run(command: str) -> str | None:
    for pattern, reason in NOT_RUN.items():
        if pattern in command:
            return reason
    argv = shlex.split(command, comments=True)
    if argv[:2] == ["sluice", "run"] and Path(argv[2]).name.startswith("gpu-") and "--dry-run" not in argv:
        return "trains on GPUs"
    return None


def quickstart_run() -> str:
    """The `sluice run` line of scripts/quickstart.sh, without the arguments it passes on."""
    lines = [x.strip() for x in (ROOT / "scripts" / "quickstart.sh").read_text().splitlines()]
    (line,) = [x for x in lines if x.startswith("sluice run ")]
    return line.replace('"$@"', "").strip()


@dataclass
class Ran:
    command: str
    argv: list[str]
    code: int
    stdout: str
    stderr: str
    seconds: float


def run_command(command: str, cwd: Path, env: dict[str, str], *, quickstart: bool = False) -> Ran:
    argv = shlex.split(command, comments=True)
    assert argv[0] == "sluice", f"a README command this test does not know how to run: {command!r} (run it, or add " \
                                "it to NOT_RUN with the reason)"
    sub = argv[1]
    if sub == "run" and "--dry-run" not in argv:
        argv += SHORT + (SHORT_QUICKSTART if quickstart else SHORT_ELSEWHERE)
    elif sub == "replay":
        argv += SHORT_REPLAY
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", *argv[1:]], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=600)
    return Ran(command, argv, r.returncode, r.stdout, r.stderr, time.monotonic() - started)


def run_lanes(first: list[str], rest: list[str], cwd: Path, env: dict[str, str]) -> list[Ran]:
    """``first`` in order, the quick start's run first, beside ``rest`` in order, which both lanes then share."""
    shared = queue.SimpleQueue[str]()
    for command in rest:
        shared.put(command)
    ran: list[Ran] = []

    def lane(own: list[str]) -> None:
        for i, command in enumerate(own):
            ran.append(run_command(command, cwd, env, quickstart=i == 0))
            if ran[-1].code != 0:
                break  # the rest of this lane looks into that run
        while True:
            try:
                command = shared.get_nowait()
            except queue.Empty:
                return
            ran.append(run_command(command, cwd, env))

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lane, [first, []]))
    return ran


def uses_run(command: str, run_dir: str) -> bool:
    return any(arg == run_dir or arg.startswith(run_dir + "/") for arg in shlex.split(command, comments=True))


@pytest.fixture
def run_servers_stopped(tmp_path: Path) -> Iterator[None]:
    """A finished `sluice run` leaves its embedded Redis up for the commands that look into the run; stop them all."""
    yield
    from pipeline.queue.redis_server import EmbeddedRedis

    for folder in sorted((tmp_path / "runs").glob("*/redis")):
        EmbeddedRedis(folder).start().stop()


def test_readme_commands_run_as_written(tmp_path: Path, run_servers_stopped: None) -> None:
    commands = readme_commands((ROOT / "README.md").read_text())
    assert len(commands) > 10, "the README's ```bash blocks were not found"
    unused = [p for p in NOT_RUN if not any(p in c for c in commands)]
    assert not unused, f"NOT_RUN names commands the README no longer shows: {unused}"
    to_run = [c for c in commands if why_not_run(c) is None]
    for link in ("recipes", "examples"):
        (tmp_path / link).symlink_to(ROOT / link)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":"),
           "OMP_NUM_THREADS": "1"}
    first = quickstart_run()
    recipe = tomllib.loads((ROOT / shlex.split(first)[2]).read_text())
    run_dir = recipe["run"]["run_dir"]
    looking = [first, *(c for c in to_run if uses_run(c, run_dir))]
    others = [c for c in to_run if not uses_run(c, run_dir)]
    ran = run_lanes(looking, others, tmp_path, env)
    for r in sorted(ran, key=lambda r: -r.seconds):
        print(f"{r.seconds:6.1f} s  exit {r.code}  {shlex.join(r.argv)}")
    failed = [f"{r.command}\n  exit {r.code}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}" for r in ran if r.code != 0]
    assert not failed, "README commands that failed:\n" + "\n".join(failed)
    assert len(ran) == len(to_run) + 1

    for r in ran:
        if r.argv[1] in ("run", "replay") and "--dry-run" not in r.argv:
            # Both end with the learning curve over the steps they trained, not a bare line of JSON.
            assert "reward (mean over the steps of each row)" in r.stdout, r.stdout
    replays = [r for r in ran if r.argv[1] == "replay"]
    assert replays, "the README shows no replay"
    for r in replays:
        out = Path(r.argv[r.argv.index("--run-dir") + 1])
        assert f"model: {out / 'model'}" in r.stdout and (tmp_path / out / "model" / "config.json").is_file()
        assert "started from:" in r.stdout
    # megatron warns of an old, broken checkpoint when its save finds files in a fresh checkpoint folder.
    logs = [r.stderr for r in ran] + [p.read_text(errors="replace") for p in (tmp_path / "runs").rglob("*.log")
                                      if "ray" not in p.relative_to(tmp_path).parts]
    assert not any("Overwriting old incomplete" in text for text in logs)
