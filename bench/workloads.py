"""The speculation benchmark's workloads: free chat, code editing and agent traces.

Each workload is a list of chat conversations whose next turn is the assistant's; prompts are
rendered with the model's own chat template (``render(tokenizer)``). They differ in how much of
the answer is already in the context — the thing speculation (prompt lookup above all) lives on:

* ``free_chat`` — open-ended questions; little to copy, speculation must not cost much (≥ 0.95×).
* ``code_edit`` — "rewrite this function …" with the function in the prompt; the answer
  quotes most of it back (target ≥ 1.6×).
* ``agent_trace`` — a system prompt with tool schemas, earlier tool calls (JSON) and their
  observations; the next assistant turn is a tool call whose arguments repeat the context
  (target ≥ 1.6×).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WorkloadPrompt", "Workload", "WORKLOADS", "get_workloads"]


@dataclass(frozen=True)
class WorkloadPrompt:
    name: str
    messages: list[dict[str, str]]
    max_new_tokens: int

    def render(self, tokenizer: Any) -> str:
        return tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=False)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    prompts: list[WorkloadPrompt] = field(default_factory=list)
    target_speedup: float = 1.0  # the benchmark's bar for speculative vs plain tokens/s


# --------------------------------------------------------------------------------------------
# Free chat

_FREE_CHAT_QUESTIONS = [
    "What are three good habits for staying focused while working from home?",
    "Explain why the sky is blue to a ten-year-old.",
    "I'm visiting Lisbon for two days. What should I not miss?",
    "What is the difference between a virus and a bacterium?",
    "Give me a short motivational message for someone starting to learn the piano at 40.",
    "How do I make a simple tomato sauce for pasta?",
    "Why do cats purr?",
    "Write a haiku about the first snow of winter.",
]

FREE_CHAT = Workload(
    name="free_chat",
    description="open-ended questions: little of the answer is in the context",
    prompts=[
        WorkloadPrompt(f"chat{i}", [{"role": "user", "content": q}], 96)
        for i, q in enumerate(_FREE_CHAT_QUESTIONS)
    ],
    target_speedup=0.95,
)


# --------------------------------------------------------------------------------------------
# Code editing

_CODE_TASKS = [
    (
        "Rewrite this function to use a list comprehension instead of the loop. Keep the name and docstring.",
        '''def even_squares(numbers):
    """Return the squares of the even numbers in the list."""
    result = []
    for n in numbers:
        if n % 2 == 0:
            result.append(n * n)
    return result''',
    ),
    (
        "Add type hints to this function. Do not change anything else.",
        '''def merge_counts(left, right):
    merged = dict(left)
    for key, value in right.items():
        merged[key] = merged.get(key, 0) + value
    return merged''',
    ),
    (
        "Rename the variable `tmp` to `total` in this function and return the code.",
        '''def cart_total(items, tax_rate):
    tmp = 0.0
    for item in items:
        tmp += item["price"] * item["quantity"]
    tmp = tmp * (1 + tax_rate)
    return round(tmp, 2)''',
    ),
    (
        "Add a docstring to this function and return the full function.",
        '''def read_config(path):
    with open(path) as f:
        lines = f.readlines()
    config = {}
    for line in lines:
        if "=" in line:
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config''',
    ),
    (
        "Rewrite this JavaScript function to use const and let instead of var.",
        '''function findUser(users, id) {
    var found = null;
    for (var i = 0; i < users.length; i++) {
        var user = users[i];
        if (user.id === id) {
            found = user;
            break;
        }
    }
    return found;
}''',
    ),
    (
        "Fix the bug in this function: it should return the largest value, not the smallest.",
        '''def largest(values):
    best = values[0]
    for v in values[1:]:
        if v < best:
            best = v
    return best''',
    ),
    (
        "Add input validation to this function: raise ValueError if width or height is negative.",
        '''def rectangle_area(width, height):
    area = width * height
    return area''',
    ),
    (
        "Convert this class to a Python dataclass.",
        '''class Point:
    def __init__(self, x, y, label):
        self.x = x
        self.y = y
        self.label = label

    def distance_to(self, other):
        return ((self.x - other.x) ** 2 + (self.y - other.y) ** 2) ** 0.5''',
    ),
]

CODE_EDIT = Workload(
    name="code_edit",
    description="rewrite a function given in the prompt: the answer quotes much of it",
    prompts=[
        WorkloadPrompt(
            f"code{i}",
            [{"role": "user", "content": f"{task}\n\n```\n{code}\n```"}],
            160,
        )
        for i, (task, code) in enumerate(_CODE_TASKS)
    ],
    target_speedup=1.6,
)


# --------------------------------------------------------------------------------------------
# Agent traces

_TOOLS = [
    {
        "name": "search_files",
        "description": "Search the repository for files whose contents match a query.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "text to search for"},
                "path": {"type": "string", "description": "folder to search under"},
            },
            "required": ["query"],
        },
    },
    {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "file path"},
                "start_line": {"type": "integer"},
                "end_line": {"type": "integer"},
            },
            "required": ["path"],
        },
    },
    {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "units": {"type": "string", "enum": ["metric", "imperial"]},
            },
            "required": ["city"],
        },
    },
    {
        "name": "send_email",
        "description": "Send an email.",
        "parameters": {
            "type": "object",
            "properties": {
                "to": {"type": "string"},
                "subject": {"type": "string"},
                "body": {"type": "string"},
            },
            "required": ["to", "subject", "body"],
        },
    },
    {
        "name": "create_calendar_event",
        "description": "Create an event in the user's calendar.",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "date": {"type": "string", "description": "YYYY-MM-DD"},
                "time": {"type": "string", "description": "HH:MM"},
                "attendees": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["title", "date", "time"],
        },
    },
]

_AGENT_SYSTEM = (
    "You are an assistant that can call tools. You have access to these tools:\n"
    + "\n".join(json.dumps(t) for t in _TOOLS)
    + "\n\nTo call a tool, answer with exactly one tool call and nothing else, in this format:\n"
    '<tool_call>\n{"name": <tool name>, "arguments": <arguments as a JSON object>}\n</tool_call>\n'
    "Tool results come back in a message from the tool. Reuse values from earlier calls and results exactly."
)


def _call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _trace(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": "system", "content": _AGENT_SYSTEM}] + [{"role": r, "content": c} for r, c in turns]


_WEATHER_PARIS = {"city": "Paris", "temperature": 14, "units": "metric", "conditions": "light rain"}
_HANDOFF_MATCH = {"matches": [{"path": "kvtransfer/protocol.py", "line": 212,
                               "text": "def parse_handoff_record(payload: bytes) -> HandoffRecord:"}]}
_STANDUP = ("# Standup 2026-11-30\n- The KV channel passed its tests.\n- The operator still needs RBAC.\n"
            "- Release planned for Friday.")
_OBSERVED_GEN = {"matches": [{"path": "operator/reconcile.py", "line": 88,
                              "text": "status['observedGeneration'] = meta['generation']"},
                             {"path": "operator/handlers.py", "line": 41,
                              "text": "patch.status['observedGeneration'] = generation"}]}

_AGENT_TRACES = [
    _trace(
        ("user", "What's the weather in Paris and in Berlin right now, in metric units?"),
        ("assistant", _call("get_weather", city="Paris", units="metric")),
        ("tool", json.dumps(_WEATHER_PARIS)),
        ("user", "Thanks. Now call the same tool for Berlin with the same units."),
    ),
    _trace(
        ("user", "Find where the function parse_handoff_record is defined in the kvtransfer folder and show it to me."),
        ("assistant", _call("search_files", query="def parse_handoff_record", path="kvtransfer")),
        ("tool", json.dumps(_HANDOFF_MATCH)),
        ("user", "Read that file from line 212 to line 260."),
    ),
    _trace(
        ("user", "Email alice@example.com the summary of today's standup with the subject 'Standup 2026-11-30'."),
        ("assistant", _call("read_file", path="notes/standup.md", start_line=1, end_line=20)),
        ("tool", _STANDUP),
        ("user", "Good. Send it to alice@example.com now; copy the notes into the body exactly."),
    ),
    _trace(
        ("user", "Schedule a meeting called 'Design review: speculative decoding' on 2026-12-03 at 14:30 "
                 "with bob@example.com and carol@example.com."),
        ("assistant", _call("create_calendar_event", title="Design review: speculative decoding",
                            date="2026-12-03", time="14:30", attendees=["bob@example.com"])),
        ("tool", json.dumps({"error": "attendees incomplete: carol@example.com is missing; call again with all attendees"})),
    ),
    _trace(
        ("user", "Read lines 40 to 80 of decode/speculation.py, then lines 80 to 120 of the same file."),
        ("assistant", _call("read_file", path="decode/speculation.py", start_line=40, end_line=80)),
        ("tool", "class SpanTracker:\n    \"\"\"Incremental span classifier for one request.\"\"\"\n    ..."),
        ("user", "Now the next part, lines 80 to 120."),
    ),
    _trace(
        ("user", "Check the weather in Tokyo in imperial units, then email the result to dan@example.com "
                 "with the subject 'Tokyo weather'."),
        ("assistant", _call("get_weather", city="Tokyo", units="imperial")),
        ("tool", json.dumps({"city": "Tokyo", "temperature": 61, "units": "imperial", "conditions": "clear"})),
    ),
    _trace(
        ("user", "Search the operator folder for 'observedGeneration' and then read the first file you find."),
        ("assistant", _call("search_files", query="observedGeneration", path="operator")),
        ("tool", json.dumps(_OBSERVED_GEN)),
    ),
    _trace(
        ("user", "Send an email to ops@example.com with subject 'Decode pool scaled' and body "
                 "'The decode pool scaled from 2 to 4 replicas at 03:10 UTC because the queue depth passed 32.'"),
    ),
]

AGENT_TRACE = Workload(
    name="agent_trace",
    description="tool schemas, earlier tool calls and observations; the next turn is a tool call repeating context",
    prompts=[WorkloadPrompt(f"agent{i}", msgs, 96) for i, msgs in enumerate(_AGENT_TRACES)],
    target_speedup=1.6,
)

WORKLOADS: dict[str, Workload] = {w.name: w for w in (FREE_CHAT, CODE_EDIT, AGENT_TRACE)}


def get_workloads(names: list[str] | None = None) -> list[Workload]:
    """The named workloads (all three by default), in a stable order."""
    if not names:
        return list(WORKLOADS.values())
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise KeyError(f"unknown workload(s) {unknown}; known: {sorted(WORKLOADS)}")
    return [WORKLOADS[n] for n in names]
