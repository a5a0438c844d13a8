"""Each KV transport end to end through real prefill and decode processes: the same greedy tokens
whichever way the KV travelled (shared memory is the default between co-located workers and is
exercised by every other serving test)."""
from __future__ import annotations

import json
import urllib.request

import pytest

from pdserve.local import LocalCluster

pytestmark = pytest.mark.model
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Summarise in one sentence: the printing press spread literacy across Europe."


def complete(url):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def reference(nats_server, model_dir):
    with LocalCluster(str(model_dir), nats=nats_server.creds) as c:
        return complete(c.url)["choices"][0]["token_ids"]


@pytest.mark.parametrize("prefill_args", [["--kv-transports", "tcp"], ["--kv-transports", "nats"],
                                          ["--kv-transports", "tcp", "--kv-compression", "int8"]],
                         ids=["tcp", "nats-chunked", "tcp-int8"])
def test_transport_end_to_end(nats_server, model_dir, reference, prefill_args):
    with LocalCluster(str(model_dir), nats=nats_server.creds, worker_args={"prefill": prefill_args}) as c:
        out = complete(c.url)
        log = c.tail("decode-0", 200)
    ids = out["choices"][0]["token_ids"]
    if "--kv-compression" in prefill_args:
        # int8 KV agrees with full-precision KV on >= 99% of positions (tests/test_kvtransfer_accuracy.py);
        # here: the request completes through the compressed path and mostly agrees
        assert len(ids) == len(reference) and sum(a == b for a, b in zip(ids, reference)) >= len(ids) - 2
    else:
        assert ids == reference
    assert "recomputing" not in log  # the KV really arrived over this transport, no fallback recompute
