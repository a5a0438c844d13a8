"""A two-tool agent loop driven by LangChain (`ChatOpenAI.bind_tools`) against an OpenAI-compatible server.

Run by tests/test_agent_e2e.py with the python of LangChain's own venv (`bench/peer.py`'s
`ensure_langchain`), outside the checkout: `python langchain_tool_loop.py BASE_URL MODEL`. Each turn
binds the tools and names the one to call (LangChain's `tool_choice`, one call a turn), runs the call
LangChain parsed, and feeds its result back as a `ToolMessage`; a last turn (`tool_choice` none, as an
agent does at its last step) has the model answer from the results. Prints one JSON line:
the calls made (name, arguments, result) and the final answer.
"""
import json
import sys

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return json.dumps({"city": city, "temperature_c": 21, "sky": "clear"})


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def main(base_url: str, model: str) -> None:
    llm = ChatOpenAI(base_url=base_url, api_key="unused", model=model, temperature=0, max_tokens=64, max_retries=0,
                     timeout=300)
    tools = {"get_weather": get_weather, "add": add}
    messages = [HumanMessage("What is the weather in Paris? And what is 2 plus 3?")]
    calls = []
    for name in ("get_weather", "add"):
        ai = llm.bind_tools(list(tools.values()), tool_choice=name, strict=True,
                            parallel_tool_calls=False).invoke(messages)
        messages.append(ai)
        for call in ai.tool_calls:
            result = tools[call["name"]].invoke(call["args"])
            messages.append(ToolMessage(str(result), tool_call_id=call["id"]))
            calls.append({"name": call["name"], "args": call["args"], "id": call["id"], "result": result})
    final = llm.bind_tools(list(tools.values()), tool_choice="none").invoke(messages)
    print(json.dumps({"calls": calls, "final": final.content, "final_calls": final.tool_calls,
                      "finish_reason": final.response_metadata.get("finish_reason")}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
