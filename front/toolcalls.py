"""Tool calls in a model's output: each family's format, parsed whole or incrementally as tokens stream.

A family is chosen from the checkpoint's chat template (`family_for_template`), or forced by the
front's `--tool-call-parser`, as vLLM's flag of that name:

* `hermes` — Hermes, Qwen 2/2.5/3 and ChatML templates: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`,
  one or more; a JSON list inside one tag is several calls (SmolLM2-Instruct was trained on that form).
* `llama3_json` — Llama 3.x: the whole answer is `{"name": …, "parameters": {…}}` (after an optional
  `<|python_tag|>`), calls separated by `;`.
* `mistral` — `[TOOL_CALLS]` then a JSON list of `{"name": …, "arguments": {…}}`.
* `json` — the fallback: an answer that is a JSON object (or list of them) with `name` and
  `arguments` (or `parameters`) is a call.

`ToolCallStream` parses incrementally: text before a call streams as content at once, except a tail
that could still begin the family's call marker; the marker and the call's JSON never reach
content. A call is announced (index, id, name) as soon as its name is complete, and its arguments
stream as the raw JSON text of the `arguments` value arrives, so the fragments of a call join into
exactly the `arguments` string the unary answer carries.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

_WS = " \t\r\n"


def family_for_template(template: str | None) -> str:
    """The parser a chat template implies. ChatML templates without tool markup (SmolLM2-Instruct's)
    are Hermes': Hermes' tool format is ChatML's, and SmolLM2 was trained on `<tool_call>` lists."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t or "<|im_start|>" in t:
        return "hermes"
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "parameters" in t):
        return "llama3_json"
    return "json"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# -- a forgiving, incremental JSON scanner -------------------------------------------------------

def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def scan_value(s: str, i: int) -> int | None:
    """The end (exclusive) of the JSON value starting at s[i], or None when s ends inside it. Checks
    bracket and string structure only; `json.loads` judges the rest."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        j = i + 1
        while j < len(s):
            if s[j] == "\\":
                j += 2
                continue
            if s[j] == '"':
                return j + 1
            j += 1
        return None
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            ch = s[j]
            if ch == '"':
                end = scan_value(s, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # number or literal: ends at a delimiter; at the end of s it may go on
    while j < len(s) and s[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(s) else None


@dataclass
class PartialCall:
    """A call object as far as it has arrived: its name once complete, and its arguments' raw JSON text."""

    name: str | None = None
    arguments: str = ""  # raw text of the arguments value so far
    args_done: bool = False
    end: int | None = None  # where the object ends in the text (exclusive), once it has
    valid: bool = True  # the object parsed as a call (only known once it ended)


ARG_KEYS = ("arguments", "parameters")


def parse_call_object(s: str, i: int) -> PartialCall:
    """Walk a call object `{"name": …, "arguments": …}` starting at s[i] == '{', as far as s goes."""
    call = PartialCall()
    j = skip_ws(s, i + 1)
    while j < len(s):
        if s[j] == "}":
            call.end = j + 1
            break
        key_end = scan_value(s, j)
        if key_end is None or s[j] != '"':
            call.valid = s[j] == '"'
            return call
        key = _loads(s[j:key_end])
        j = skip_ws(s, key_end)
        if j >= len(s):
            return call
        if s[j] != ":":
            call.valid = False
            return call
        j = skip_ws(s, j + 1)
        if j >= len(s):
            return call
        v_end = scan_value(s, j)
        if key == "name":
            if v_end is not None:
                name = _loads(s[j:v_end])
                call.name = name if isinstance(name, str) else None
        elif key in ARG_KEYS and call.arguments == "":
            call.arguments = s[j:v_end] if v_end is not None else s[j:]
            call.args_done = v_end is not None
        if v_end is None:
            return call
        j = skip_ws(s, v_end)
        if j < len(s) and s[j] == ",":
            j = skip_ws(s, j + 1)
    if call.end is not None:
        obj = _loads(s[i:call.end])
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        call.valid = isinstance(obj, dict) and isinstance(obj.get("name"), str) and (args is None or isinstance(args, dict))
        if call.valid and args is None:
            call.arguments, call.args_done = "{}", True
    return call


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


# -- the families ---------------------------------------------------------------------------------

@dataclass
class Parsed:
    """What an output says so far: its content text and its calls (complete or still arriving)."""

    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)
    final_content_ok: bool = True  # the content is final up to here (no held-back marker prefix)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (it may still become it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _calls_in(s: str, i: int, calls: list[PartialCall]) -> int | None:
    """Parse one call object or a list of them at s[i]; append them; return where they end (None: not yet)."""
    i = skip_ws(s, i)
    if i >= len(s):
        return None
    if s[i] == "{":
        c = parse_call_object(s, i)
        calls.append(c)
        return c.end
    if s[i] == "[":
        j = skip_ws(s, i + 1)
        while j < len(s):
            if s[j] == "]":
                return j + 1
            if s[j] != "{":
                return None
            c = parse_call_object(s, j)
            calls.append(c)
            if c.end is None:
                return None
            j = skip_ws(s, c.end)
            if j < len(s) and s[j] == ",":
                j = skip_ws(s, j + 1)
        return None
    return None


def parse(family: str, text: str, final: bool) -> Parsed:
    """Parse `text` (all of an output so far; `final`: nothing more comes) in `family`'s format."""
    if family == "hermes":
        return _parse_tagged(text, "<tool_call>", "</tool_call>", final)
    if family == "mistral":
        return _parse_tagged(text, "[TOOL_CALLS]", None, final)
    return _parse_bare(text, final, prefix="<|python_tag|>" if family == "llama3_json" else "")


def _parse_tagged(text: str, start: str, end: str | None, final: bool) -> Parsed:
    out = Parsed()
    pos = 0
    parts = []
    while True:
        k = text.find(start, pos)
        if k < 0:
            tail = text[pos:]
            held = 0 if final else _held_prefix(tail, start)
            parts.append(tail[: len(tail) - held])
            break
        parts.append(text[pos:k])
        j = k + len(start)
        stop = _calls_in(text, j, out.calls)
        if stop is None:
            break
        j = skip_ws(text, stop)
        if end is not None:
            if not text.startswith(end, j):
                if len(text) - j < len(end) and end.startswith(text[j:]):
                    break  # the end marker is arriving
                if end in text[j:]:
                    j = text.index(end, j)  # junk after the JSON, before the marker: dropped with the call
                else:
                    break
            j += len(end)
        pos = skip_ws(text, j)  # the space between calls, or after the last, is no content
    out.content = "".join(parts)
    return out


def _parse_bare(text: str, final: bool, prefix: str) -> Parsed:
    """A whole answer that is a call (or calls separated by `;` / a list): else it is all content."""
    out = Parsed()
    i = skip_ws(text, 0)
    if prefix and text.startswith(prefix, i):
        i = skip_ws(text, i + len(prefix))
    elif prefix and not final and prefix.startswith(text[i:]):
        return out  # may be the python tag arriving
    if i >= len(text):
        if final:
            out.content = text
        return out
    if text[i] not in "{[":
        out.content = text
        return out
    while True:
        stop = _calls_in(text, i, out.calls)
        if stop is None:
            break
        i = skip_ws(text, stop)
        if i < len(text) and text[i] == ";":
            i = skip_ws(text, i + 1)
            continue
        if i < len(text) and text[i] == "{":  # calls one per line
            continue
        if i < len(text):  # more than calls: it was an answer that happens to start with JSON
            return Parsed(content=text)
        break
    if out.calls and all(c.end is not None for c in out.calls) and not all(c.valid for c in out.calls):
        return Parsed(content=text)
    if final and (not out.calls or any(c.end is None or not c.valid for c in out.calls)):
        return Parsed(content=text)
    return out


# -- whole and streamed ----------------------------------------------------------------------------

@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def extract(family: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished output → (content or None, its tool calls). A call that does not parse as a call stays
    content: the model's text is never lost."""
    p = parse(family, text, final=True)
    calls = [c for c in p.calls if c.end is not None and c.valid and c.name and _loads(c.arguments) is not None]
    if not calls or len(calls) != len(p.calls):
        return text, []
    content = p.content.strip()
    return content or None, [ToolCall(new_call_id(), c.name, c.arguments.strip()) for c in calls]


@dataclass
class Delta:
    """What one piece of streamed output adds: content text and tool-call pieces (OpenAI's
    `delta.tool_calls` items: the first of a call has id, type and name; later ones arguments)."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


class ToolCallStream:
    """One choice's output, parsed as it streams."""

    def __init__(self, family: str):
        self.family = family
        self.text = ""
        self.sent_content = 0  # characters of content sent
        self.ids: list[str] = []  # per announced call
        self.sent_args: list[int] = []  # per announced call: argument characters sent

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def feed(self, piece: str, final: bool = False) -> Delta:
        self.text += piece
        p = parse(self.family, self.text, final)
        d = Delta()
        if len(p.content) > self.sent_content:
            d.content = p.content[self.sent_content:]
            self.sent_content = len(p.content)
        for i, c in enumerate(p.calls):
            if i >= len(self.ids):
                if c.name is None or not c.valid:
                    break
                self.ids.append(new_call_id())
                self.sent_args.append(0)
                d.tool_calls.append({"index": i, "id": self.ids[i], "type": "function",
                                     "function": {"name": c.name, "arguments": ""}})
            args = c.arguments.strip() if c.args_done else c.arguments.lstrip()
            if len(args) > self.sent_args[i]:
                d.tool_calls.append({"index": i, "function": {"arguments": args[self.sent_args[i]:]}})
                self.sent_args[i] = len(args)
        return d

    def finish(self) -> Delta:
        """The end of the output: whatever was held back (a tail that looked like a marker) goes out."""
        return self.feed("", final=True)


# -- writing calls: the family's markup, for prompts and for constrained decoding -------------------

_ARGS_KEY = {"hermes": "arguments", "llama3_json": "parameters", "mistral": "arguments", "json": "arguments"}
# (before the first call, between calls, after the last); a call is {"name": …, "<args key>": …}
_WRAP = {"hermes": ("<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>"),
         "llama3_json": ("", "; ", ""), "mistral": ("[TOOL_CALLS][", ", ", "]"), "json": ("", "\n", "")}
CALL_MAX_WHITESPACE = 1  # whitespace bytes in a row inside constrained arguments: compact JSON, no padding
_SEPARATOR = {"hermes": "\n", "llama3_json": "; ", "mistral": ", ", "json": "\n"}  # between two calls
# what starts a call in free text (the trigger of constrained decoding under tool_choice auto)
_TRIGGER = {"hermes": "<tool_call>", "llama3_json": '{"name": ', "mistral": "[TOOL_CALLS]", "json": '{"name": '}


def render_calls(family: str, calls: list[tuple[str, object]]) -> str:
    """(name, arguments) pairs as the model writes them in `family`'s format (an assistant turn's
    earlier calls, for chat templates that do not render `tool_calls`)."""
    first, between, last = _WRAP[family]
    key = _ARGS_KEY[family]
    return first + between.join(json.dumps({"name": n, key: a}) for n, a in calls) + last


def tools_prompt(family: str, tools: list[dict]) -> str:
    """A system prompt that shows the tools and the call format, for chat templates that do not render
    `tools` themselves (SmolLM2-Instruct's): the wording of Hermes' function-calling prompt."""
    specs = "\n".join(json.dumps(t) for t in tools)
    example = render_calls(family, [("<function-name>", "<args-dict>")]).replace('"<args-dict>"', "<args-dict>")
    return ("You are a function calling AI model. You are provided with function signatures within <tools></tools> "
            "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
            f"about what values to plug into functions. Here are the available tools: <tools>\n{specs}\n</tools>\n"
            "For each function call return a json object with function name and arguments as follows:\n"
            f"{example}")


def call_structural_tag(family: str, functions: list[dict], must_call: bool, parallel: bool) -> dict:
    """The structural tag (xgrammar's) that constrains output to `family`'s calls of `functions` (OpenAI
    function specs), each call's arguments to its `parameters` schema. `must_call` (tool_choice required or
    named): the answer is calls and nothing else; else free text in which any call is constrained. `parallel`
    False: at most one call."""
    key = _ARGS_KEY[family]
    each = family == "hermes"  # each call in tags of its own (a Mistral list wraps them all)
    tags = [{"type": "tag",
             "begin": ("<tool_call>\n" if each else "") + json.dumps({"name": f["name"], key: 0})[:-2],
             "content": {"type": "json_schema", "json_schema": f.get("parameters") or {"type": "object"},
                         "max_whitespace_cnt": CALL_MAX_WHITESPACE},
             "end": "}" + ("\n</tool_call>" if each else "")} for f in functions]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": _SEPARATOR[family], "at_least_one": True,
             "stop_after_first": not parallel}
    if family == "mistral":
        calls = {"type": "tag", "begin": "[TOOL_CALLS][", "content": calls, "end": "]"}
    if must_call:
        fmt = calls
    else:
        fmt = {"type": "triggered_tags", "triggers": [_TRIGGER[family]], "tags": [calls] if family == "mistral" else tags,
               "at_least_one": False, "stop_after_first": family == "mistral" or not parallel}
    return {"type": "structural_tag", "format": fmt}
