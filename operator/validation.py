"""Rules of an InferenceService that a CRD schema cannot express on v1.20 (no CEL).

`validate` (the name and the spec) is used by the validating admission webhook (refuses the
object at apply time) and by the reconciler (reports it in status and events when the webhook was
bypassed, e.g. objects created before the webhook existed). Messages name the fields and say
what to change.

Names: every child's name and label values are rendered from the InferenceService's name, so a
name is checked by rendering the children a probe with that name would get and holding each
against the rule its kind has on the API server (`name_errors`); `crd.NAME_SCHEMA` states the
same rule for the API server.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from pdserve.config import COMMANDS, DraftPoolConfig, option

from .crd import apply_defaults
from .reconcile import DRAFT_POOL, OperatorConfig, cpu_cores, desired_children, draft_pool, settings

DNS1035_LABEL = "[a-z]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN = rf"{DNS1123_LABEL}(\.{DNS1123_LABEL})*"
LABEL_VALUE = "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
# What the API server demands of each kind's name: (pattern, most characters, what to call it).
_NAME_RULES = {"Service": (DNS1035_LABEL, 63, "a DNS-1035 label: lower-case letters, digits and '-', starting "
                                              "with a letter and ending with a letter or digit")}
_DEFAULT_RULE = (DNS1123_SUBDOMAIN, 253, "a DNS-1123 subdomain: lower-case letters, digits, '-' and '.', "
                                         "starting and ending with a letter or digit")
_LABEL_RULE = (LABEL_VALUE, 63, "a label value: letters, digits, '-', '_' and '.', starting and ending with a "
                                "letter or digit")


def _probe_children(name: str) -> list[dict]:
    """The children an InferenceService called `name` gets with every optional child present."""
    body = {"metadata": {"name": name, "namespace": "default", "uid": "probe"},
            "spec": {"model": {"path": "m", "pvc": "p"}, "speculation": {"draftPool": {}}}}
    return desired_children(body, OperatorConfig(nats_credentials={"user": "", "password": ""}))


def _named(children: list[dict], name: str):
    """(what, rendered value, rule) for every child name and label value that holds `name`."""
    for c in children:
        kind, meta = c["kind"], c["metadata"]
        yield f"{kind} name", meta["name"], _NAME_RULES.get(kind, _DEFAULT_RULE)
        labels = dict(meta.get("labels") or {})
        labels.update(((c.get("spec") or {}).get("template") or {}).get("metadata", {}).get("labels") or {})
        for key, value in labels.items():
            if name in value:
                yield f"{kind} label {key}", value, _LABEL_RULE


def _suggest(name: str, longest: int) -> str:
    s = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    s = re.sub(r"^[^a-z]+", "", s)[:longest].rstrip("-")
    return s or "my-model"


def _longest() -> tuple[int, str, str, int]:
    """(most characters of a name, the child name or label that binds it, its rendering for a
    probe name, its own limit)."""
    probe = "zq9zq"  # appears in nothing the operator renders but where the name goes
    return min((limit - (len(value) - len(probe)), what, value, limit)
               for what, value, (_, limit, _) in _named(_probe_children(probe), probe))


def name_errors(name: str) -> list[str]:
    """What keeps an InferenceService called `name` from having all its children, as messages."""
    longest, what, probe_value, limit = _longest()
    errors: list[str] = []
    if len(name) > longest:
        errors.append(f"metadata.name {name!r} has {len(name)} characters; at most {longest} fit, since the {what} "
                      f"built from it ({probe_value.replace('zq9zq', '<name>')!r}) may have at most {limit}; use "
                      f"e.g. {_suggest(name, longest)!r}")
    seen: set[str] = set()
    for what, value, (pattern, _, form) in _named(_probe_children(name), name):
        if not re.fullmatch(pattern, value) and form not in seen:
            seen.add(form)
            errors.append(f"metadata.name {name!r} makes the {what} {value!r}, which must be {form}; use e.g. "
                          f"{_suggest(name, longest)!r}")
    return errors


def validate(body: dict[str, Any]) -> list[str]:
    """All problems of an InferenceService (its name and spec), as user-facing messages; [] if none."""
    m = body["metadata"]
    # a generated name is the prefix and five random characters
    name = m.get("name") or (m.get("generateName") or "") + "x" * 5
    return name_errors(name) + validate_spec(body.get("spec") or {})


def validate_spec(spec: dict[str, Any]) -> list[str]:
    """All cross-field problems of `spec` (raw or defaulted), as user-facing messages; [] if none."""
    s = apply_defaults(spec or {})
    errors: list[str] = []
    pools = {name: s.get(name, {}) for name in ("prefill", "decode")}

    dp = (s.get("speculation") or {}).get("draftPool")
    scaled = {f"spec.{name}": pool for name, pool in pools.items()}
    if dp is not None:
        scaled["spec.speculation.draftPool"] = dp
    for where, pool in scaled.items():
        a = pool.get("autoscaling", {})
        if a.get("enabled", True) and a.get("minReplicas", 1) > a.get("maxReplicas", 1):
            errors.append(
                f"{where}.autoscaling.minReplicas ({a['minReplicas']}) is greater than "
                f"{where}.autoscaling.maxReplicas ({a['maxReplicas']}); raise maxReplicas or lower minReplicas")

    pkv, dkv = pools["prefill"].get("kv", {}), pools["decode"].get("kv", {})
    if pkv.get("dtype") != dkv.get("dtype"):
        errors.append(
            f"spec.prefill.kv.dtype ({pkv.get('dtype')}) differs from spec.decode.kv.dtype ({dkv.get('dtype')}); "
            "decode receives prefill's KV cache as-is, so both pools must use the same KV dtype")
    if pkv.get("blockSize") != dkv.get("blockSize"):
        errors.append(
            f"spec.prefill.kv.blockSize ({pkv.get('blockSize')}) differs from spec.decode.kv.blockSize "
            f"({dkv.get('blockSize')}); both pools must use the same KV block size")

    compression = s.get("kvTransfer", {}).get("compression", "none")
    for name in ("prefill", "decode"):
        supported = pools[name].get("kv", {}).get("compressions", [])
        if compression not in supported:
            errors.append(
                f"spec.kvTransfer.compression is {compression!r} but spec.{name}.kv.compressions is {supported}; "
                f"choose a compression both pools support or add {compression!r} to that list")

    spec_cfg = s.get("speculation", {})
    method, draft = spec_cfg.get("method", "ngram"), spec_cfg.get("draft")
    if method == "draft":
        if not draft:
            errors.append("spec.speculation.method is 'draft' but spec.speculation.draft.path is not set; "
                          "name the draft model or use method 'ngram'")
        else:
            target_tok = s.get("model", {}).get("tokenizer")
            draft_tok = draft.get("tokenizer")
            if not target_tok or not draft_tok:
                errors.append("spec.speculation.method is 'draft': set both spec.model.tokenizer and "
                              "spec.speculation.draft.tokenizer so the draft can be checked against the target")
            elif target_tok != draft_tok:
                errors.append(
                    f"spec.speculation.draft.tokenizer ({draft_tok}) differs from spec.model.tokenizer ({target_tok}); "
                    "a draft model must share the target's tokenizer")
    elif draft is not None:
        errors.append(f"spec.speculation.draft is set but spec.speculation.method is {method!r}; "
                      "set method to 'draft' or remove the draft")
    if dp is not None:
        errors += _draft_pool_errors(dp, method)

    ratio = s.get("autoscaling", {}).get("prefillDecodeRatio")
    if ratio and "min" in ratio and "max" in ratio and ratio["min"] > ratio["max"]:
        errors.append(f"spec.autoscaling.prefillDecodeRatio.min ({ratio['min']}) is greater than "
                      f".max ({ratio['max']})")

    for name, pool in pools.items():
        errors += _resource_errors(f"spec.{name}", pool, f"a pool's GPUs come from spec.{name}.gpus (now "
                                                         f"{pool.get('gpus')}): remove it from resources and set gpus")

    if pkv.get("dtype") == "auto" and bool(pools["prefill"].get("gpus")) != bool(pools["decode"].get("gpus")):
        errors.append("spec.prefill.kv.dtype and spec.decode.kv.dtype are 'auto' but only one pool has GPUs: auto "
                      "resolves to bfloat16 on a GPU and float32 on the CPU, and decode takes prefill's KV as it is; "
                      "name the dtype")

    model = s.get("model", {})
    if model.get("pvc") and model.get("image"):
        errors.append("spec.model sets both pvc and image; choose one source for /models")
    if not model.get("pvc") and not model.get("image"):
        for name in ("prefill", "decode"):
            vols = (pools[name].get("podTemplate", {}).get("spec", {}) or {}).get("volumes", []) or []
            if not any(isinstance(v, dict) and v.get("name") == "models" for v in vols):
                errors.append(f"spec.model needs a source for /models: set spec.model.pvc (a PVC with the "
                              f"weights) or spec.model.image, or give spec.{name}.podTemplate.spec.volumes "
                              "a volume named 'models'")
                break
    return errors or _settings_errors(s)


def _draft_pool_errors(dp: dict, method: str) -> list[str]:
    """What is wrong with spec.speculation.draftPool (defaulted), given the speculation method."""
    errors = []
    if dp.get("enabled", True) and method != "ngram":
        errors.append(f"spec.speculation.draftPool is set but spec.speculation.method is {method!r}: decode pods ask "
                      "the pool beside their own prompt lookup, so the pool needs method 'ngram'; set method to "
                      "'ngram', or set draftPool.enabled to false")
    index = dp.get("suffixIndex") or {}
    defaults = DraftPoolConfig.model_fields
    min_n, max_n = index.get("minN", defaults["min_n"].default), index.get("maxN", defaults["max_n"].default)
    if min_n > max_n:
        errors.append(f"spec.speculation.draftPool.suffixIndex.minN ({min_n}) is greater than .maxN ({max_n}"
                      f"{'' if 'maxN' in index else ', its default'}); a draft follows a context suffix of minN to "
                      "maxN tokens")
    return errors + _resource_errors("spec.speculation.draftPool", dp,
                                     f"the {dp.get('drafter', 'suffix')} drafter runs on the CPU: remove it")


def _resource_errors(where: str, pool: dict, gpu_fix: str) -> list[str]:
    """A pool's resources (at `where`) naming nvidia.com/gpu (`gpu_fix` says what to do instead), or a CPU
    quantity that is none, as messages."""
    errors = []
    for section in ("limits", "requests"):
        given = (pool.get("resources") or {}).get(section) or {}
        if "nvidia.com/gpu" in given:
            errors.append(f"{where}.resources.{section}.nvidia.com/gpu is set; {gpu_fix}")
        if given.get("cpu") is not None:
            try:
                cpu_cores(given["cpu"])
            except ValueError as e:
                errors.append(f"{where}.resources.{section}.cpu: {e}")
    return errors


def _settings_errors(spec: dict) -> list[str]:
    """What the pools' own settings (pdserve.config) refuse in the arguments this spec renders: the
    last word, so that a pod never starts only to exit on its arguments."""
    found: dict[tuple[str, str, str], list[str]] = {}
    body = {"metadata": {"name": "probe", "namespace": "default", "uid": "probe"}}
    for pool, kind in COMMANDS.items():
        if pool == DRAFT_POOL and not draft_pool(spec):
            continue
        try:
            settings(body, spec, OperatorConfig(), pool)
        except ValidationError as e:
            for err in e.errors():
                path = ".".join(str(x) for x in err["loc"])
                where = option(kind, path).flag if path else "settings"
                msg = err["msg"].removeprefix("Value error, ")
                found.setdefault((where, repr(err.get("input")), msg), []).append(pool)
    return [f"the spec gives the {', '.join(pools)} pool{'s' if len(pools) > 1 else ''} {where} {value}: {msg}"
            for (where, value, msg), pools in found.items()]
