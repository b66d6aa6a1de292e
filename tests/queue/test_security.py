"""Security: credentials reach the run's processes but no file, log or printout; an ACL user limited to ``sluice:*``
keys and the commands sluice needs runs a whole run over TLS (plain port off), evaluator included, and can read
nothing else; a Redis that refuses the password is a clear error."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
import redis

from pipeline.config import dump_config, load_config
from pipeline.config.eval import EvaluatorConfig
from pipeline.config.filters import FilterConfig
from pipeline.config.staleness import StalenessConfig
from pipeline.consumers.evaluator import Evaluator
from pipeline.consumers.trainer.audit import audit_trainer
from pipeline.consumers.trainer.drain import Drainer
from pipeline.consumers.trainer.ledger import Ledger
from pipeline.errors import ConfigError, QueueError
from pipeline.queue.archive import Archiver, ArchiveReader
from pipeline.queue.connection import connect, redact_url
from pipeline.queue.credentials import (
    ACL_COMMANDS,
    SECRET_FILE,
    acl_rule,
    read_secret_url,
    resolve_url,
    write_secret_url,
)
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.rundir import open_run
from tests.helpers.samples import make_group
from tests.helpers.secure_redis import ADMIN_PASSWORD, SecuredRedis, TlsUnsupported, start_secured_redis

ROOT = Path(__file__).parents[2]
PASSWORD = "Pw-s3cret-7Qx9"  # distinctive: any occurrence in a file or printout is a leak


def _needles(password: str) -> list[bytes]:
    return [password.encode(), quote(password).encode()]


def _leaks(folder: Path, password: str) -> list[str]:
    """Every file under ``folder`` whose bytes hold the password."""
    found = []
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if any(n in data for n in _needles(password)):
                found.append(str(path.relative_to(folder)))
    return found


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # Short enough that the private Ray instance keeps its session (logs included) inside the run folder, so that
    # the leak search covers Ray's files too.
    folder = Path(tempfile.mkdtemp(prefix="sec-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_run_over_tls_as_an_acl_user_with_the_evaluator_leaks_no_credential(short_tmp: Path) -> None:
    try:
        server = start_secured_redis(short_tmp / "redis", password=PASSWORD, tls=True)
        tls = True
    except TlsUnsupported as e:  # the run is still worth it over the plain port, with the ACL user
        print(f"TLS not tested: {e}")
        server = start_secured_redis(short_tmp / "redis", password=PASSWORD)
        tls = False
    try:
        _check_run(server, short_tmp, tls)
    finally:
        server.stop()


def _check_run(server: SecuredRedis, tmp: Path, tls: bool) -> None:
    url = server.url()
    admin = server.admin()
    if tls:
        assert admin.config_get("port")["port"] == "0"  # the plain port is off
        with pytest.raises(redis.ConnectionError):
            connect(url.replace("rediss://", "redis://").split("?")[0], socket_timeout=2, retry=None).ping()
    run_dir = tmp / "run"
    args = ["recipes/cpu-moe.toml", "--run-dir", str(run_dir), "--steps", "4",
            "--set", f"queue.redis_url={json.dumps(url)}", "--set", "warmstart.enabled=false",
            "--set", "eval.heldout.enabled=false", "--set", "eval.enabled=true", "--set", "trainer.batch_groups=2",
            "--set", "filters.zero_variance=false", "--set", "trainer.checkpoint_every=2",
            "--set", "producer.concurrency=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("SLUICE_REDIS_URL", None)
    dry = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", *args, "--dry-run"], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=120)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert redact_url(url) in dry.stdout and PASSWORD not in dry.stdout + dry.stderr

    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]

    # The evaluator and the archiver read the stream beside the trainer, as the ACL user, over TLS.
    eval_lines = (run_dir / "eval" / "metrics.jsonl").read_text().splitlines()
    assert eval_lines and json.loads(eval_lines[-1])["samples"] > 0
    assert sum(1 for _ in ArchiveReader(run_dir / "archive").samples()) > 0
    handle = open_run(run_dir=run_dir, redis_url=url)
    try:
        audit = audit_trainer(handle.queue, run_dir)
        assert audit.committed_step == 4 and audit.lost == 0 and audit.duplicates == 0 and audit.trained > 0
    finally:
        handle.close()
    # Not one command of the whole run was refused: the ACL's command list is enough.
    assert admin.execute_command("ACL", "LOG") == []

    # No credential anywhere: config.json and run.json hold the redacted URL, the launcher's private file is gone.
    assert json.loads((run_dir / "config.json").read_text())["queue"]["redis_url"] == redact_url(url)
    assert json.loads((run_dir / "run.json").read_text())["redis_url"] == redact_url(url)
    assert not (run_dir / SECRET_FILE).exists()
    assert (run_dir / "ray").is_dir()  # Ray's session files were searched too
    assert _leaks(run_dir, PASSWORD) == []
    assert not any(n in out for n in _needles(PASSWORD))

    # The same user reads nothing outside sluice:* and may run no admin command.
    admin.set("other:secret", "x")
    user = connect(url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.get("other:secret")
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.keys("*")
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.config_get("requirepass")
    user.close()
    admin.close()


def test_the_secret_file_is_private_and_resolves_a_redacted_url(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_REDIS_URL", raising=False)
    url = f"redis://sluice:{PASSWORD}@127.0.0.1:1/0"
    stored = redact_url(url)
    with pytest.raises(ConfigError, match="pass the URL with --redis or SLUICE_REDIS_URL") as e:
        resolve_url(tmp_path, stored)
    assert PASSWORD not in str(e.value)
    path = write_secret_url(tmp_path, url)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert resolve_url(tmp_path, stored) == url
    assert resolve_url(tmp_path, "redis://h:1/0") == "redis://h:1/0"  # nothing to resolve
    path.chmod(0o644)  # readable by others: refused, not used
    with pytest.raises(ConfigError, match="not private to this user"):
        read_secret_url(tmp_path)
    path.chmod(0o600)
    monkeypatch.setenv("SLUICE_REDIS_URL", "redis://sluice:other@127.0.0.1:2/0")
    assert resolve_url(tmp_path, stored) == "redis://sluice:other@127.0.0.1:2/0"


def test_dry_run_and_config_dump_redact_every_password() -> None:
    for url in (f"rediss://sluice:{PASSWORD}@h:6380/0?ssl_ca_certs=/x/ca.pem",
                f"redis://h:6379/0?password={PASSWORD}", f"unix:///tmp/r.sock?password={PASSWORD}&db=1"):
        cfg = load_config(ROOT / "recipes" / "cpu-moe.toml", [f"queue.redis_url={json.dumps(url)}"])
        dumped = dump_config(cfg)
        assert PASSWORD not in dumped and "***" in dumped
        assert cfg.queue.redis_url == url  # the launcher itself keeps the real one


def test_a_url_that_is_not_redis_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [f'queue.redis_url="http://sluice:{PASSWORD}@h/0"'])
    assert "queue.redis_url" in str(e.value) and "rediss://" in str(e.value) and PASSWORD not in str(e.value)


def test_a_redis_that_refuses_the_password_is_a_clear_error(tmp_path: Path) -> None:
    server = start_secured_redis(tmp_path / "redis", password=PASSWORD)
    try:
        wrong = server.url(password="not-the-password")
        with pytest.raises(QueueError) as e:
            open_run(redis_url=wrong, run="r")
        message = str(e.value)
        assert "refused" in message and "queue.redis_url" in message and redact_url(wrong) in message
        assert "not-the-password" not in message
        # The right password but a user without the needed rights names what is missing.
        admin = server.admin()
        admin.execute_command("ACL", "SETUSER", "weak", "on", ">weak-pw", "~other:*", "+ping")
        with pytest.raises(QueueError, match="ACL") as e:
            open_run(redis_url=server.url("weak", "weak-pw"), run="r")
        assert "weak-pw" not in str(e.value)
        admin.close()
    finally:
        server.stop()


def test_the_documented_acl_rule_is_the_one_tested() -> None:
    doc = (ROOT / "docs" / "security.md").read_text()
    assert acl_rule() in doc
    assert len(ACL_COMMANDS) == len(set(ACL_COMMANDS))
    assert ADMIN_PASSWORD not in doc


def test_user_code_is_imported_only_from_the_recipe(queue: SampleQueue, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Only reward and filter import paths the recipe names are imported; a module named in every string a sample
    carries, and in the environment, is never even looked for while the trainer's drain, the evaluator and the archive
    read those samples."""
    probe = f"sluice_probe_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / f"{probe}.imported"
    (tmp_path / f"{probe}.py").write_text(f"open({str(marker)!r}, 'w').close()\n\ndef fn(*args):\n    return True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = f"{probe}:fn"
    for var in ("SLUICE_REWARD", "SLUICE_FILTER", "SLUICE_ROLLOUT", "SLUICE_REDIS_URL"):
        monkeypatch.setenv(var, spec)
    looked_for: list[str] = []

    class Recorder:  # first on sys.meta_path: told of every module looked for, finds none itself
        @staticmethod
        def find_spec(name: str, path: object = None, target: object = None) -> None:
            looked_for.append(name)

    monkeypatch.setattr(sys, "meta_path", [Recorder(), *sys.meta_path])
    try:
        group = make_group(np.random.default_rng(5), 2)
        for s in group:
            s.group_id = s.prompt_id = s.producer = s.engine = s.finish_reason = spec
            s.reward_info = {"reward": spec, "filter": spec, "rollout": spec}
        for name in ("trainer", "eval", "archive"):
            queue.create_group(name, "0")
        queue.put(group)
        load_config(ROOT / "recipes" / "cpu-moe.toml")
        drainer = Drainer(queue, Ledger(tmp_path / "ledger"), StalenessConfig(max_lag=4), filters=FilterConfig(),
                          block_ms=50)
        drainer.recover()
        assert len(drainer.next_batch(1, step=0, version=lambda: 0).groups) == 1
        assert Evaluator(queue, EvaluatorConfig(block_ms=50)).run(until_idle_s=0).counted_entries == 1
        Archiver(queue, tmp_path / "archive", segment_samples=2, block_ms=20).run(idle_exit_s=0.2)
        assert [s.reward_info for s in ArchiveReader(tmp_path / "archive").samples()] == [group[0].reward_info] * 2
        assert probe not in looked_for and not marker.exists()
        # Named in the recipe but found outside plugins.paths (here through sys.path, as a PYTHONPATH entry would
        # put it): refused, and none of its code runs.
        with pytest.raises(ConfigError, match=r"outside plugins\.paths.*it was not imported"):
            load_config(None, [f'producer.reward="{spec}"'])
        assert not marker.exists()
        # Named in the recipe, from a folder the recipe names: imported (the check above would have seen an import).
        load_config(None, [f'filters.user=["{spec}"]', f'producer.reward="{spec}"', f"plugins.paths=[{str(tmp_path)!r}]"])
        assert probe in looked_for and marker.exists()
    finally:
        sys.modules.pop(probe, None)
