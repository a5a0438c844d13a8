"""`pdserve webhook-check`: what each API server answer to the dry-run probe means, and the wait.

The answers here are the bodies a real kube-apiserver returns (a Status object); the whole
command against a real API server is in tests/k8s/test_chart_install.py (admitted, so it must
fail) and, as the chart's install hook, in tests/k8s/test_node_serving.py (denied, so it passes).
"""
from __future__ import annotations

import json

import pytest

from pdserve.operator import webhookcheck as wc


def _status(code: int, message: str, reason: str = "") -> tuple[int, str]:
    return code, json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                             "message": message, "reason": reason, "code": code})


DENIED = _status(400, 'admission webhook "validate.inferenceservices.pdserve.io" denied the request: '
                      "decode.autoscaling: minReplicas 3 > maxReplicas 2", "BadRequest")
UNREACHABLE = _status(500, 'Internal error occurred: failed calling webhook "validate.inferenceservices.pdserve.io": '
                           'failed to call webhook: Post "https://rel-pdserve-webhook.ns.svc:443/validate-inferenceservice'
                           '?timeout=10s": dial tcp 10.96.112.157:443: connect: connection refused', "InternalError")


@pytest.mark.parametrize("answer, verdict, words", [
    (DENIED, "ready", "minReplicas"),
    (UNREACHABLE, "retry", "connection refused"),
    ((201, json.dumps({"kind": "InferenceService", "metadata": {"name": "pdserve-webhook-check-x"}})), "retry", "admitted"),
    (_status(404, 'the server could not find the requested resource'), "retry", "CRD is not served"),
    ((0, "MaxRetryError: HTTPSConnectionPool(host='10.96.0.1', port=443): connection refused"), "retry", "MaxRetryError"),
    (_status(429, "too many requests"), "retry", "429"),
    (_status(503, "the server is currently unable to handle the request"), "retry", "503"),
    (_status(403, 'inferenceservices.pdserve.io is forbidden: User "system:serviceaccount:ns:x" cannot create'),
     "refused", "ServiceAccount"),
    (_status(401, "Unauthorized"), "refused", "401"),
    (_status(422, 'InferenceService.pdserve.io "x" is invalid: spec.model.path: Required value', "Invalid"),
     "refused", "does not fit this CRD"),
    ((502, "<html>bad gateway</html>"), "retry", "bad gateway"),
])
def test_each_answer_has_one_meaning(answer, verdict, words):
    out = wc.classify(*answer)
    assert out.verdict == verdict
    assert words in out.detail


def test_another_webhooks_denial_is_not_ours():
    """A denial by some other admission webhook (a policy engine) does not prove ours is reachable."""
    other = _status(400, 'admission webhook "validate.kyverno.svc" denied the request: nope')
    assert wc.classify(*other).verdict == "refused"


def test_the_probe_breaks_only_the_webhooks_rule():
    """The probe passes the CRD's schema and the typed spec, and fails only the cross-field check
    the webhook runs, so a denial of it is the webhook's and nothing else's."""
    from pdserve.operator import crd, validation

    obj = wc.probe_object()
    assert obj["apiVersion"] == f"{crd.GROUP}/{crd.VERSION}" and obj["kind"] == "InferenceService"
    assert "name" not in obj["metadata"] and obj["metadata"]["generateName"]
    problems = validation.validate(obj)
    assert len(problems) == 1 and "minReplicas (3) is greater than" in problems[0], problems
    # (that the CRD's schema admits it is shown against a real API server: test_chart_install.py)


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_waits_through_unreachable_and_admitted_until_denied():
    answers = iter([(0, "ConnectionRefusedError"), UNREACHABLE, UNREACHABLE, (201, "{}"), DENIED])
    clock, logs = _Clock(), []
    out = wc.wait_ready(lambda: next(answers), timeout=30, interval=1, log=logs.append, clock=clock, sleep=clock.sleep)
    assert out.verdict == "ready"
    assert clock.t == 104.0
    assert len(logs) == 3  # each new kind of answer once, not once per try
    assert any("connection refused" in line for line in logs) and any("admitted" in line for line in logs)


def test_gives_up_at_the_deadline_with_the_last_answer():
    clock, calls = _Clock(), []

    def attempt():
        calls.append(clock.t)
        return UNREACHABLE

    out = wc.wait_ready(attempt, timeout=5, interval=1, log=lambda s: None, clock=clock, sleep=clock.sleep)
    assert out.verdict == "refused"
    assert "no webhook denial in 5 s" in out.detail and "connection refused" in out.detail
    assert clock.t - 100.0 <= 5 and len(calls) == 6


def test_a_refusal_ends_the_wait_at_once():
    clock = _Clock()
    forbidden = _status(403, "forbidden")
    out = wc.wait_ready(lambda: forbidden, timeout=60, interval=1, log=lambda s: None, clock=clock, sleep=clock.sleep)
    assert out.verdict == "refused" and clock.t == 100.0


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit) as e:
        wc.main(["--timeout", "0"])
    assert e.value.code == 2
