"""Cross-field rules of an InferenceService spec that a CRD schema cannot express on v1.20 (no CEL).

One pure function, `validate_spec`, used by the validating admission webhook (refuses the object
at apply time) and by the reconciler (reports it in status and events when the webhook was
bypassed, e.g. objects created before the webhook existed). Messages name the fields and say
what to change.
"""
from __future__ import annotations

from typing import Any

from .crd import apply_defaults


def validate_spec(spec: dict[str, Any]) -> list[str]:
    """All cross-field problems of `spec` (raw or defaulted), as user-facing messages; [] if none."""
    s = apply_defaults(spec or {})
    errors: list[str] = []
    pools = {name: s.get(name, {}) for name in ("prefill", "decode")}

    for name, pool in pools.items():
        a = pool.get("autoscaling", {})
        if a.get("enabled", True) and a.get("minReplicas", 1) > a.get("maxReplicas", 1):
            errors.append(
                f"spec.{name}.autoscaling.minReplicas ({a['minReplicas']}) is greater than "
                f"spec.{name}.autoscaling.maxReplicas ({a['maxReplicas']}); raise maxReplicas or lower minReplicas")

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

    ratio = s.get("autoscaling", {}).get("prefillDecodeRatio")
    if ratio and "min" in ratio and "max" in ratio and ratio["min"] > ratio["max"]:
        errors.append(f"spec.autoscaling.prefillDecodeRatio.min ({ratio['min']}) is greater than "
                      f".max ({ratio['max']})")

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
    return errors
