"""The frameworks applications use, unchanged, against a live `segfuse serve` with the embedded members.

LangChain's ``ChatOpenAI`` (structured output and bound tools) and pydantic-ai agents (a typed output,
and a tool the agent calls before it answers). Each sends what it sends to OpenAI; the server must
answer in kind.
"""

from __future__ import annotations

import pytest

from helpers import EXTRACT, Person, live_server, weather_agent_calls
from segfuse import models as catalogue

pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    missing = [n for n in catalogue.DEFAULT_MODELS if not catalogue.is_ready(catalogue.CATALOGUE[n])]
    if missing:
        pytest.fail(f"models not prepared: {missing}; run `make models`", pytrace=False)
    with live_server(tmp_path_factory.mktemp("frameworks")) as running:
        yield running
        assert running.health()["counters"]["failed"] == 0, running.log_tail()


@pytest.fixture(scope="module")
def chat_model(server):
    langchain_openai = pytest.importorskip("langchain_openai", reason="the test extra installs langchain-openai")
    return langchain_openai.ChatOpenAI(
        base_url=server.api, api_key=server.api_key, model="segfuse", temperature=0, max_tokens=64, max_retries=0
    )


def test_langchain_structured_output(chat_model):
    person = chat_model.with_structured_output(Person).invoke(EXTRACT)
    assert isinstance(person, Person) and person.name and person.age > 0 and person.city


def test_langchain_bound_tools(chat_model):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"sunny in {city}"

    message = chat_model.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str) and call["id"]


def _agent_model(server):
    pytest.importorskip("pydantic_ai", reason="the test extra installs pydantic-ai-slim[openai]")
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel("segfuse", provider=OpenAIProvider(base_url=server.api, api_key=server.api_key))


def test_pydantic_ai_typed_output(server):
    from pydantic_ai import Agent

    agent = Agent(_agent_model(server), output_type=Person, model_settings={"temperature": 0, "max_tokens": 96})
    person = agent.run_sync(EXTRACT).output
    assert isinstance(person, Person) and person.name and person.age > 0


def test_pydantic_ai_agent_calls_a_tool(server):
    """The agent reads our tool call, runs its tool with the arguments and sends the result back. (What the
    0.5B leader does next is its own affair: with these members it calls the tool again rather than answer,
    so the run is cut after the request that follows the result.)"""
    calls = weather_agent_calls(_agent_model(server), max_tokens=64)
    assert calls and calls[0] == "Paris"
