"""An agent framework driving the server through Anthropic's Messages API and OpenAI's Responses API:
pydantic-ai's ``AnthropicModel`` and ``OpenAIResponsesModel``, unchanged, with a typed output and a tool
the agent runs. Each sends what it sends to Anthropic or OpenAI; the server must answer in kind."""

from __future__ import annotations

import pytest

from helpers import EXTRACT, Person, weather_agent_calls
from live_app import KEY, live_unfailing

pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]

pydantic_ai = pytest.importorskip("pydantic_ai", reason="the test extra installs pydantic-ai-slim")

MEMBER = "qwen2.5-coder-0.5b"  # one member alone: the route and the job are the ensemble's, and it is quick


@pytest.fixture(scope="module")
def server(default_ensemble):
    with live_unfailing(default_ensemble) as running:
        yield running


def _model(server, api: str):
    if api == "messages":
        from pydantic_ai.models.anthropic import AnthropicModel
        from pydantic_ai.providers.anthropic import AnthropicProvider

        return AnthropicModel(MEMBER, provider=AnthropicProvider(base_url=server.url, api_key=KEY))
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIResponsesModel(MEMBER, provider=OpenAIProvider(base_url=server.api, api_key=KEY))


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_a_typed_output(server, api):
    agent = pydantic_ai.Agent(
        _model(server, api), output_type=Person, model_settings={"temperature": 0, "max_tokens": 64}
    )
    person = agent.run_sync(EXTRACT).output
    assert person == Person(name="Maria Lopez", age=34, city="Seville")


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_the_agent_runs_a_tool_and_answers(server, api):
    """The agent reads our call, runs its tool and sends the result back (a tool_result block, a
    function_call_output item); what comes next is an answer or another call that validated."""
    calls = weather_agent_calls(_model(server, api), max_tokens=48)
    assert calls and calls[0] == "Paris"
