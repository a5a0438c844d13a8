"""The InferenceService CRD (pdserve.io/v1alpha1), written once here as Python data.

The chart's `charts/pdserve/crds/inferenceservices.yaml` is generated from this module
(`python -m pdserve.operator.crd > charts/pdserve/crds/inferenceservices.yaml`; a test checks
they agree), and `apply_defaults` fills the schema's `default:` values the same way the API
server does, so the pure reconciler sees the same spec in unit tests as in a cluster.

Field rules (types, enums, minimums, required fields, no unknown fields) live in the schema;
cross-field rules live in `validation.py` (v1.20 has no CEL).
"""
from __future__ import annotations

import copy
import sys
from typing import Any

from pdserve import basetypes, config

GROUP = "pdserve.io"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SHORT_NAMES = ["pdis"]  # KServe uses `isvc`; ours must not collide when both are installed.

KV_DTYPES = list(config.DTYPES)  # what the workers run with; `auto` resolves per device
COMPRESSIONS = list(basetypes.COMPRESSIONS)
DEFAULT_PREFILL_METRIC = "pdserve_prefill_queue_depth"
DEFAULT_DECODE_METRIC = "pdserve_decode_kv_utilization"
DEFAULT_DRAFT_POOL_METRIC = "pdserve_draftpool_requests_per_second"
DRAFTERS = ("suffix",)  # what a draft pool drafts from


def _s(**kw) -> dict:
    return {"type": "string", **kw}


def _i(minimum: int | None = None, **kw) -> dict:
    d: dict[str, Any] = {"type": "integer", **kw}
    if minimum is not None:
        d["minimum"] = minimum
    return d


def _obj(props: dict, required: list[str] | None = None, **kw) -> dict:
    d: dict[str, Any] = {"type": "object", "properties": props, **kw}
    if required:
        d["required"] = required
    return d


# An InferenceService's name becomes its children's names and label values; the strictest is the
# front Service (named after it: a DNS-1035 label) and the decode Service (<name>-decode, at most
# 63 characters). validation.name_errors finds the same rule by rendering the children; a test
# holds the two equal.
NAME_SCHEMA = {"type": "string", "maxLength": 56, "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$"}

_QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
_FREE_OBJECT = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
_SECRET_KEY_REF = _obj({"name": _s(minLength=1), "key": _s(minLength=1)}, ["name", "key"])


def _resources(description: str) -> dict:
    return _obj({
        "requests": {"type": "object", "additionalProperties": _QUANTITY},
        "limits": {"type": "object", "additionalProperties": _QUANTITY},
    }, description=description)


def _placement() -> dict:
    """Where a pool's pods run and what overrides their template: the same fields for every pool."""
    return {
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
        "tolerations": {"type": "array", "items": _obj({
            "key": _s(), "operator": _s(enum=["Exists", "Equal"]), "value": _s(),
            "effect": _s(enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]),
            "tolerationSeconds": _i(),
        })},
        "podTemplate": _obj({
            "metadata": _obj({
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            }),
            "spec": {**_FREE_OBJECT, "description": "Merged over the generated PodSpec (e.g. affinity, "
                     "priorityClassName, volumes); containers are merged by name."},
        }, description="Pod template overrides."),
    }


def _scaling(default_metric: str, default_target: str) -> dict:
    """A pool's HPA and disruption budget."""
    return {
        "autoscaling": _obj({
            "enabled": {"type": "boolean", "default": True},
            "minReplicas": _i(1, default=1),
            "maxReplicas": _i(1, default=4),
            "metric": _obj({
                "name": _s(minLength=1, default=default_metric),
                "targetAverageValue": {**_QUANTITY, "default": default_target,
                                       "description": "Per-pod average the HPA aims for."},
            }, default={}),
            "scaleDownStabilizationSeconds": _i(0, maximum=3600, default=300),
        }, default={}),
        "disruptionBudget": _obj({"maxUnavailable": _i(0, default=1)}, default={}),
    }


def _pool(default_metric: str, default_target: str, data_port: int) -> dict:
    return _obj({
        "replicas": _i(0, default=1, description="Replicas when autoscaling is disabled."),
        "gpus": _i(0, default=1, description="nvidia.com/gpu per pod (set in limits); a pool with GPUs runs on "
                                             "CUDA, one without on the CPU."),
        "resources": _resources("CPU/memory (and other) requests and limits. GPUs come from `gpus` (nvidia.com/gpu "
                                "here is refused); the CPU limit (else request), rounded down, is the workers' torch "
                                "threads."),
        **_placement(),
        "kv": _obj({
            "dtype": _s(enum=KV_DTYPES, default="bfloat16",
                        description="Model and KV cache element type; auto: bfloat16 on GPUs that have it, "
                                    "float32 on the CPU. Both pools must hold the same."),
            "blockSize": _i(1, maximum=1024, default=16, description="Tokens per KV block."),
            "compressions": {"type": "array", "items": _s(enum=COMPRESSIONS),
                             "default": list(COMPRESSIONS),
                             "description": "Transfer compressions this pool can encode/decode."},
        }, default={}),
        "dataPort": _i(1, maximum=65535, default=data_port),
        **_scaling(default_metric, default_target),
    }, default={})


# No default: absent, an InferenceService has no draft pool; present (even `{}`), it has one.
DRAFT_POOL_SCHEMA = _obj({
    "enabled": {"type": "boolean", "default": True,
                "description": "Run the pool (false keeps its settings and removes it)."},
    "drafter": _s(enum=list(DRAFTERS), default="suffix",
                  description="What the pool drafts from. suffix: a suffix index of every finished request's prompt "
                              "and output across the deployment (no model; CPU only)."),
    "replicas": _i(0, default=1, description="Replicas when autoscaling is disabled."),
    "resources": _resources("CPU/memory requests and limits. The suffix index needs no GPU (nvidia.com/gpu is "
                            "refused)."),
    **_placement(),
    **_scaling(DEFAULT_DRAFT_POOL_METRIC, "2000"),
    "suffixIndex": _obj({
        "minN": _i(1, maximum=16, description="Shortest context suffix a draft may follow (tokens)."),
        "maxN": _i(1, maximum=32, description="Longest context suffix looked up (tokens)."),
        "maxTokens": _i(1, description="Most tokens of finished requests each replica holds; the least recently "
                                       "used requests are evicted first."),
        "shareTenants": {"type": "boolean", "description": "Let one tenant's text draft for another's requests "
                                                           "(default: never)."},
    }, description="The suffix drafter's index; unset fields keep `pdserve draftpool`'s defaults."),
    "maxQueue": _i(1, description="Most draft requests waiting per replica; past it a request is answered "
                                  "'overloaded' at once and its decode worker drafts locally."),
    "timeoutSeconds": {"type": "number", "minimum": 0.001, "maximum": 1,
                       "description": "Most seconds a decode step waits for the pool's draft (less where a quarter "
                                      "of a plain step is less); past it the step drafts locally."},
}, description="A draft pool (`pdserve draftpool`) that every decode pod asks for drafts over NATS, beside its own "
               "prompt lookup (speculation.method ngram); decode falls back to local drafts when the pool is slow, "
               "overloaded or gone.")


SPEC_SCHEMA = _obj({
    "model": _obj({
        "name": _s(description="Served model name (OpenAI `model`); defaults to the object name."),
        "path": _s(minLength=1, description="Path under /models in the pod."),
        "pvc": _s(description="PersistentVolumeClaim holding /models (read-only)."),
        "image": _s(description="Image holding the model under /models; copied into an emptyDir at start."),
        "tokenizer": _s(description="Tokenizer identity; a draft model must declare the same one."),
    }, ["path"]),
    "image": _s(description="Worker image; defaults to the operator's configured image."),
    "imagePullPolicy": _s(enum=["Always", "IfNotPresent", "Never"], default="IfNotPresent"),
    "prefill": _pool(DEFAULT_PREFILL_METRIC, "4", 7100),
    "decode": _pool(DEFAULT_DECODE_METRIC, "800m", 7200),
    "front": _obj({
        "replicas": _i(1, default=1),
        "resources": _obj({
            "requests": {"type": "object", "additionalProperties": _QUANTITY},
            "limits": {"type": "object", "additionalProperties": _QUANTITY},
        }),
    }, default={}),
    "speculation": _obj({
        "method": _s(enum=["ngram", "draft", "none"], default="ngram"),
        "maxK": _i(1, maximum=64, default=8),
        "draft": _obj({"path": _s(minLength=1), "tokenizer": _s()}, ["path"]),
        "draftPool": DRAFT_POOL_SCHEMA,
    }, default={}),
    "kvTransfer": _obj({
        "transport": _s(enum=["tcp", "shm", "nats"], default="tcp"),
        "compression": _s(enum=COMPRESSIONS, default="none"),
        "timeoutSeconds": {"type": "number", "minimum": 0.1, "maximum": 600, "default": 10},
        "failurePolicy": _s(enum=["recompute", "fail"], default="recompute"),
        "shmSizeLimit": _s(pattern=r"^[0-9]+(Ki|Mi|Gi|Ti)$", default="4Gi",
                           description="Bound of each worker's memory-backed /dev/shm, where decode lands received "
                                       "KV (a pool of warm segments, kept idle up to half of this) and shared-memory "
                                       "handoffs go. Counts against the pod's memory."),
    }, default={}),
    "prefixCache": _obj({
        "prepositioning": {"type": "boolean", "default": True,
                           "description": "After each request, let an idle prefill worker pre-compute the next turn's KV."},
        "prepositionBudgetBlocks": _i(0, default=256, description="Most pre-positioned KV blocks per prefill "
                                                                  "worker not yet used (0: off)."),
        "offload": {"type": "boolean", "default": False,
                    "description": "Share prefix KV blocks between workers through the JetStream object store."},
        "offloadTTLSeconds": _i(1, default=3600, description="How long an offloaded prefix block lives."),
    }, default={}, description="Prefix reuse across requests: the prefill workers' cache, pre-positioning, offload."),
    "disaggregation": _obj({
        "deferQueueTokens": _i(0, description="A prompt arriving behind at least this many prompt tokens queued "
                                              "at its prefill worker goes to decode uncomputed, if decode's own "
                                              "queue of such prompts is shorter (0: every prompt is prefilled by "
                                              "prefill). Default: 256 on GPUs, 512 on CPUs running "
                                              "the native bfloat16 decoder, else 0."),
        "localPrefillChunk": _i(0, default=64, description="Most tokens of such a prompt one decode step computes "
                                                           "beside its running sequences (0: decode takes none)."),
    }, default={}, description="Conditional disaggregation: under a long prefill queue, decode's spare step time "
                               "computes prompts too."),
    "nats": _obj({
        "url": _s(description="External NATS URL; default: the chart's in-cluster NATS."),
        "credentialsSecret": _obj({
            "name": _s(minLength=1),
            "userKey": _s(default="user"),
            "passwordKey": _s(default="password"),
        }, ["name"]),
    }, default={}),
    "serving": _obj({
        "port": _i(1, maximum=65535, default=8000),
        "serviceType": _s(enum=["ClusterIP", "NodePort", "LoadBalancer"], default="ClusterIP"),
        "apiKeySecret": _SECRET_KEY_REF,
        "migrationLimit": _i(0, maximum=16, default=2, description=(
            "Times a request whose worker dies or is stopped holding it moves to other workers, with the tokens "
            "already streamed: invisible to the client. 0: such a request fails with worker_lost.")),
    }, default={}),
    "autoscaling": _obj({
        "prefillDecodeRatio": _obj({
            "min": {"type": "number", "exclusiveMinimum": True, "minimum": 0},
            "max": {"type": "number", "exclusiveMinimum": True, "minimum": 0},
        }, description="Keep prefill:decode replicas within [min, max] by moving the prefill HPA's bounds."),
    }, default={}),
}, ["model"])

_POOL_STATUS = _obj({
    "desiredReplicas": _i(),
    "readyReplicas": _i(),
    "replicas": _s(description="ready/desired, for printing"),
})

STATUS_SCHEMA = _obj({
    "observedGeneration": _i(),
    "endpoint": _s(),
    "prefill": _POOL_STATUS,
    "decode": _POOL_STATUS,
    "front": _POOL_STATUS,
    "draftpool": _POOL_STATUS,
    "ready": _s(),
    "conditions": {"type": "array", "items": _obj({
        "type": _s(), "status": _s(enum=["True", "False", "Unknown"]), "reason": _s(), "message": _s(),
        "lastTransitionTime": _s(format="date-time"), "observedGeneration": _i(),
    }, ["type", "status"])},
})
# kopf records its own progress under status.kopf; keep it rather than pruning it.
STATUS_SCHEMA["x-kubernetes-preserve-unknown-fields"] = True


def crd() -> dict:
    """The CustomResourceDefinition object (apiextensions.k8s.io/v1)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "pdserve"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL,
                      "singular": "inferenceservice", "shortNames": SHORT_NAMES, "categories": ["pdserve"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Model", "type": "string", "jsonPath": ".spec.model.path"},
                    {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.replicas",
                     "description": "ready/desired prefill replicas"},
                    {"name": "Decode", "type": "string", "jsonPath": ".status.decode.replicas",
                     "description": "ready/desired decode replicas"},
                    {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
                    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
                "schema": {"openAPIV3Schema": _obj({
                    "apiVersion": _s(), "kind": _s(),
                    # The name becomes Service names and label values: refused here when they could not be.
                    "metadata": _obj({"name": NAME_SCHEMA}),
                    "spec": SPEC_SCHEMA, "status": STATUS_SCHEMA,
                }, ["spec"])},
            }],
        },
    }


def apply_defaults(obj: Any, schema: dict = SPEC_SCHEMA) -> Any:
    """Return a copy of `obj` with the schema's defaults filled in, as the API server does
    (a default applies where the field is absent; defaults of nested objects then recurse)."""
    obj = copy.deepcopy(obj)
    return _default(obj, schema)


def _default(obj: Any, schema: dict) -> Any:
    if isinstance(obj, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                obj[key] = _default(obj[key], sub)
    elif isinstance(obj, list) and "items" in schema:
        return [_default(x, schema["items"]) for x in obj]
    return obj


def main(argv: list[str] | None = None) -> int:
    import yaml

    sys.stdout.write("# Generated by `python -m pdserve.operator.crd`; do not edit by hand.\n")
    sys.stdout.write(yaml.safe_dump(crd(), sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
