"""The chart's NATS server learns each InferenceService's credentials: one NATS user per InferenceService,
confined to its deployment scope, kept in a Secret the NATS server reads.

Why a users file that the server reloads (rather than accounts or an auth callout): the chart's NATS
already authenticates users from its config; a users list with NATS permissions is all that confining
a scope needs (`kvtransfer.protocol.permissions`), it keeps NATS up when the operator is down (an
auth callout would make the operator a dependency of every connection), and it needs no signing keys
(JWT accounts would). Its cost: a new InferenceService's pods wait until the kubelet has updated the
mounted Secret and the NATS pod's reloader has signalled the server (about a minute at most); the
workers retry their first connection meanwhile.

The Secret (in the NATS server's namespace) holds:

- `users.json`: `{user: {"isvc": "namespace/name", "uid": ..., "scope": ..., "hash": bcrypt}}`,
  the record this module keeps;
- `users.conf`: what the server includes in its `authorization` block: the chart's own user
  (`$NATS_USER`/`$NATS_PASSWORD` from the server's environment, the metrics adapter's read-only
  observer) and one user per InferenceService.

Passwords live only in each InferenceService's own Secret (`<name>-nats`, owned by it); this Secret
holds their bcrypt hashes, which NATS checks as such.
"""
from __future__ import annotations

import base64
import json
import secrets
import threading
from typing import TYPE_CHECKING, Any

from pdserve.kvtransfer.protocol import observer_permissions, permissions, scope_token
from pdserve.natsserver import EnvRef, NatsUser, users_conf

from .crd import GROUP, PLURAL, VERSION

if TYPE_CHECKING:
    from .kube import Kube

USERS_JSON, USERS_CONF = "users.json", "users.conf"
# bcrypt's cost for the users' password hashes: NATS checks the hash on every connect, so a cost that every
# connect can afford (docs/PERFORMANCE.md, "NATS password hashing")
BCRYPT_ROUNDS = 11
CHART_USER = NatsUser(EnvRef("NATS_USER"), EnvRef("NATS_PASSWORD"), observer_permissions())

_lock = threading.Lock()  # one writer of the Secret at a time (kopf runs handlers on a thread pool)


def scope_of(namespace: str, name: str) -> str:
    """The deployment scope of an InferenceService's processes (`ProcessConfig.deployment_scope`)."""
    return f"{namespace}.{name}"


def user_name(namespace: str, name: str) -> str:
    """The NATS user of an InferenceService."""
    return f"isvc-{scope_token(scope_of(namespace, name))}"


def new_password() -> str:
    return secrets.token_urlsafe(32)


def render(records: dict[str, dict]) -> str:
    """`users.conf` for these records: the chart's observer, then one confined user per InferenceService."""
    users = [CHART_USER] + [NatsUser(user, r["hash"], permissions(r["scope"])) for user, r in sorted(records.items())]
    return users_conf(users)


def _hash(password: str) -> str:
    import bcrypt

    # "$2a$": the prefix by which NATS recognises a bcrypt hash in its config
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_ROUNDS, prefix=b"2a")).decode()


def _matches(password: str, hashed: str) -> bool:
    import bcrypt

    try:
        return bcrypt.checkpw(password.encode(), hashed.encode())
    except ValueError:
        return False


def _read(kube: Kube, ref: tuple[str, str]) -> tuple[dict | None, dict[str, dict]]:
    secret = kube.get("v1", "Secret", *ref)
    if secret is None:
        return None, {}
    raw = (secret.get("data") or {}).get(USERS_JSON)
    try:
        records = json.loads(base64.b64decode(raw)) if raw else {}
    except ValueError:
        records = {}  # not ours to trust: rebuilt from the InferenceServices
    return secret, records if isinstance(records, dict) else {}


def _live(kube: Kube) -> set[tuple[str, str, str]]:
    """(namespace, name, uid) of every InferenceService on the server."""
    items = (kube.request("GET", f"/apis/{GROUP}/{VERSION}/{PLURAL}") or {}).get("items") or []
    return {(i["metadata"]["namespace"], i["metadata"]["name"], i["metadata"]["uid"]) for i in items}


def sync(kube: Kube, ref: tuple[str, str], isvc: dict | None, password: str | None) -> bool:
    """Bring the users Secret `ref` (namespace, name) in line: `isvc` (an InferenceService body) gets a
    user whose hash matches `password`, and users of InferenceServices that no longer exist go.
    `isvc` None: only the latter. → whether the Secret changed. Raises RuntimeError when the Secret is
    missing (the chart creates it)."""
    with _lock:
        secret, records = _read(kube, ref)
        if secret is None:
            raise RuntimeError(f"NATS users Secret {ref[0]}/{ref[1]} not found (the chart creates it)")
        before = dict(records)
        live = _live(kube)
        records = {u: r for u, r in records.items() if (*r.get("isvc", "/").split("/", 1), r.get("uid")) in live}
        if isvc is not None:
            m = isvc["metadata"]
            user = user_name(m["namespace"], m["name"])
            old = records.get(user)
            if not (old and old.get("uid") == m["uid"] and _matches(password or "", old.get("hash", ""))):
                records[user] = {"isvc": f"{m['namespace']}/{m['name']}", "uid": m["uid"],
                                 "scope": scope_of(m["namespace"], m["name"]), "hash": _hash(password or "")}
        conf = render(records)
        data = secret.get("data") or {}
        if records == before and data.get(USERS_CONF) == _b64(conf):
            return False
        kube.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": ref[1], "namespace": ref[0]},
                    "data": {USERS_JSON: _b64(json.dumps(records, sort_keys=True)), USERS_CONF: _b64(conf)}},
                   force=True)
        return True


def existing_password(secret: dict | None, user: str) -> str | None:
    """The password in an InferenceService's own NATS Secret, if it is that user's."""
    data: dict[str, Any] = (secret or {}).get("data") or {}
    try:
        if base64.b64decode(data.get("user", "")).decode() == user and data.get("password"):
            return base64.b64decode(data["password"]).decode()
    except ValueError:
        pass
    return None


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()
