"""OpenAI-API client libraries against a running cbserve, each used as its own docs show; run in
the clients' venv (`make install` builds .venv-clients), never imported by the suite.

    python client_libraries.py BASE_URL MODEL  ->  one JSON object of what each client got

BASE_URL ends in /v1. Nothing here reaches the network: tracing and cost-map downloads are off.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Literal  # module level: the tools' annotations are resolved here

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches its model table otherwise
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

def langchain(base_url: str, model: str) -> dict:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    llm = ChatOpenAI(model=model, base_url=base_url, api_key="none", max_tokens=6, temperature=0, max_retries=0)
    answer = llm.invoke("the sea")
    streamed = "".join(chunk.content for chunk in llm.stream("the sea"))

    @tool
    def get_weather(city: Literal["paris", "tokyo"]) -> str:  # an enum: the tiny model ends its string
        """The weather in a city."""
        return "sunny"

    called = ChatOpenAI(model=model, base_url=base_url, api_key="none", max_tokens=200, temperature=0,
                        max_retries=0).bind_tools([get_weather], tool_choice="get_weather").invoke("weather?")
    class Verdict(BaseModel):
        answer: Literal["yes", "no"]

    verdict = ChatOpenAI(model=model, base_url=base_url, api_key="none", max_tokens=50, temperature=0,
                         max_retries=0).with_structured_output(Verdict).invoke("yes or no?")
    return {"text": answer.content, "streamed": streamed, "usage": answer.usage_metadata,
            "tool_calls": [{"name": c["name"], "args": c["args"]} for c in called.tool_calls],
            "structured": verdict.answer}


def litellm_client(base_url: str, model: str) -> dict:
    import litellm

    litellm.telemetry = False
    messages = [{"role": "user", "content": "the sea"}]
    answer = litellm.completion(model=f"openai/{model}", api_base=base_url, api_key="none", messages=messages,
                                max_tokens=6, temperature=0)
    stream = litellm.completion(model=f"openai/{model}", api_base=base_url, api_key="none", messages=messages,
                                max_tokens=6, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    return {"text": answer.choices[0].message.content, "streamed": streamed,
            "completion_tokens": answer.usage.completion_tokens}


def agents(base_url: str, model: str) -> dict:

    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    class Report(BaseModel):  # a structured final output: its JSON schema ends the tiny model's answer
        sky: Literal["sunny", "rainy"]

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["paris", "tokyo"]) -> str:  # an enum: the tiny model ends its string
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    out = {}
    for name, backend in (("responses", OpenAIResponsesModel(model=model, openai_client=client)),
                          ("chat", OpenAIChatCompletionsModel(model=model, openai_client=client))):
        agent = Agent(name="weather", instructions="Answer briefly.", model=backend, tools=[get_weather],
                      output_type=Report,
                      model_settings=ModelSettings(tool_choice="get_weather", max_tokens=200, temperature=0))
        # The tool is called first (tool_choice), then reset (the SDK's default) for the answer.
        result = Runner.run_sync(agent, "weather in tokyo?", max_turns=3)
        out[name] = {"final_output": result.final_output.model_dump(), "tool_calls": list(calls)}
        calls.clear()
    return out


def main() -> int:
    base_url, model = sys.argv[1], sys.argv[2]
    results = {}
    for name, run in (("langchain", langchain), ("litellm", litellm_client), ("agents", agents)):
        try:
            results[name] = run(base_url, model)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which names the client
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(results, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
