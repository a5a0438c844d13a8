"""Each InferenceService's own NATS user, end to end: the operator (kopf's KopfRunner against the real
kube-apiserver) writes its credentials Secret and the NATS users Secret; a REAL nats-server loads that
users.conf as the chart's NATS does; one InferenceService's credentials serve it and reach nothing of
another's; a deleted InferenceService's user is gone after the next reload; no password is logged."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import uuid

import nats
import nats.errors
import pytest
from k8swait import wait_for
from kubernetes import client
from test_operator_k8s import API, isvc, kube, run_operator  # noqa: F401  (kube: a fixture)

from pdserve.kvtransfer.protocol import Subjects
from pdserve.natsserver import EmbeddedNats
from pdserve.operator import natsusers

pytestmark = pytest.mark.k8s

SYS = "pdserve-nats-home"


def _secret(kube, ns, name) -> dict[str, str]:
    s = kube.get("v1", "Secret", ns, name) or {}
    return {k: base64.b64decode(v).decode() for k, v in (s.get("data") or {}).items()}


@pytest.fixture
def users_env(kube, tmp_path):
    """What the chart sets up: its NATS credentials, the users Secret with its first users.conf, the
    operator's environment pointing at both, and the NATS server's CA."""
    try:
        kube.request("POST", "/api/v1/namespaces", {"metadata": {"name": SYS}})
    except client.ApiException as e:
        if e.status != 409:
            raise
    name = f"nats-users-{uuid.uuid4().hex[:6]}"
    kube.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": SYS},
                 "stringData": {"users.conf": natsusers.render({})}})
    kube.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-chart", "namespace": SYS},
                 "stringData": {"user": "pdserve", "password": "chart-password-1"}})
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\nnot checked here\n-----END CERTIFICATE-----\n")
    env = {"PDSERVE_NATS_URL": "nats://nats.pdserve-nats-home:4222", "PDSERVE_NATS_SECRET": f"{name}-chart",
           "PDSERVE_NATS_SECRET_NAMESPACE": SYS, "PDSERVE_NATS_USERS_SECRET": name,
           "PDSERVE_NATS_TLS_CA": str(ca), "PDSERVE_IMAGE": "ghcr.io/pdserve/pdserve:0.1.0"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield name, ca.read_text()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


async def _try(server: EmbeddedNats, user: str, password: str, scope: str, other_scope: str) -> dict:
    """Connect as `user`; publish on its own subject and on `other_scope`'s: what the server says."""
    errors: list[str] = []
    violated = asyncio.Event()

    async def on_error(e):
        errors.append(str(e).lower())
        if "permissions violation" in errors[-1]:
            violated.set()

    creds = server.creds.with_user(user, password, scope)
    try:
        nc = await nats.connect(**creds.connect_kwargs(), error_cb=on_error, allow_reconnect=False)
    except Exception as e:
        return {"connected": False, "error": str(e).lower()}
    sub = await nc.subscribe(Subjects.stream(scope, "r"))
    await nc.publish(Subjects.stream(other_scope, "r"), b"into another")
    await nc.publish(Subjects.stream(scope, "r"), b"own")
    own = (await sub.next_msg(5)).data
    await asyncio.wait_for(violated.wait(), 5)
    await nc.close()
    return {"connected": True, "own": own, "errors": errors}


def test_each_inferenceservice_gets_a_confined_nats_user(kube, users_env, k8s_namespace):
    users_secret, ca = users_env
    ns_a, ns_b = k8s_namespace, f"{k8s_namespace}-b"
    kube.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns_b}})
    try:
        with run_operator(ns_a, ns_b) as runner:
            kube.create(isvc("llama", ns_a))
            kube.create(isvc("llama", ns_b))
            a = wait_for(lambda: _secret(kube, ns_a, "llama-nats").get("password") and
                         _secret(kube, ns_a, "llama-nats"), "A's NATS Secret")
            b = wait_for(lambda: _secret(kube, ns_b, "llama-nats").get("password") and
                         _secret(kube, ns_b, "llama-nats"), "B's NATS Secret")
            users = wait_for(lambda: (lambda s: len(json.loads(s.get("users.json", "{}"))) == 2 and s)(
                _secret(kube, SYS, users_secret)), "both users in the NATS users Secret")
            assert a["user"] == natsusers.user_name(ns_a, "llama") and b["user"] == natsusers.user_name(ns_b, "llama")
            assert a["ca.crt"] == ca and a["password"] != b["password"] and len(a["password"]) >= 40
            assert a["password"] not in users["users.conf"] and "$2a$" in users["users.conf"]

            # a real nats-server with the operator's users.conf, as the chart's reads it
            with EmbeddedNats(users_conf=users["users.conf"]) as server:
                scope_a, scope_b = natsusers.scope_of(ns_a, "llama"), natsusers.scope_of(ns_b, "llama")
                got = asyncio.run(_try(server, a["user"], a["password"], scope_a, scope_b))
                assert got["connected"] and got["own"] == b"own"
                assert any(f'publish to "{Subjects.stream(scope_b, "r")}"' in e for e in got["errors"]), got

                # a spec change re-reconciles: the password is kept, the users Secret not rewritten
                version = kube.get("v1", "Secret", SYS, users_secret)["metadata"]["resourceVersion"]
                kube.merge_patch(API, "InferenceService", ns_a, "llama", {"spec": {"front": {"replicas": 2}}})
                wait_for(lambda: kube.get("apps/v1", "Deployment", ns_a, "llama-front")["spec"]["replicas"] == 2,
                         "front replicas 2")
                assert _secret(kube, ns_a, "llama-nats")["password"] == a["password"]
                assert kube.get("v1", "Secret", SYS, users_secret)["metadata"]["resourceVersion"] == version

                # B deleted: its user leaves the file; after the reload its credentials are refused
                kube.request("DELETE", f"/apis/{API}/namespaces/{ns_b}/inferenceservices/llama")
                users = wait_for(lambda: (lambda s: len(json.loads(s.get("users.json", "{}"))) == 1 and s)(
                    _secret(kube, SYS, users_secret)), "B's user removed")
                server.set_users_conf(users["users.conf"])
                gone = asyncio.run(_try(server, b["user"], b["password"], scope_b, scope_a))
                assert not gone["connected"] and "authorization violation" in gone["error"]
        assert runner.exception is None
        for password in (a["password"], b["password"]):
            assert password not in runner.stdout, "a NATS password in the operator's log"
    finally:
        kube.request("DELETE", f"/api/v1/namespaces/{ns_b}")
