"""Agent SDKs' own tool loops against `qinfer serve`, end to end: LangGraph's prebuilt ReAct
agent over LangChain's `ChatOpenAI` (chat completions), the OpenAI Agents SDK over the
Responses API (whole and streamed), and the `anthropic` client's tool runner over the
Messages API.

On the planted Qwen3 with its tool loop (tests/planted_qwen3.py), every SDK runs the same
two-tool loop (LangGraph and the Agents SDK on the planted Qwen3.5 too, its calls in XML): the model calls get_weather, gets its result, calls get_time, gets its
result, and answers `LOOP_ANSWER`; the model only takes each step once the previous
result is in the conversation it is sent, so the transcript shows that each SDK fed the
results back and that the server parsed, named and matched every call. On the embedded
SmolLM2 each loop must end by itself (a final answer within a few turns) without an error.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import anthropic
import openai
import pytest
import torch
from agents import (
    Agent,
    ItemHelpers,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from anthropic.lib.tools import beta_tool
from gguf_files import smollm2_path
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent
from planted_qwen3 import (
    LOOP_ANSWER,
    LOOP_CALLS,
    LOOP_RESULTS,
    PLANTED_REASONING,
    TIME_TOOL,
    WEATHER_TOOL,
    build_planted_qwen3,
)
from servers import serving
from transformers import AutoModelForCausalLM

import qinfer
from qinfer.server.app import served_name

QUESTION = "What is the weather in Paris, and what time is it there?"
#: The turns (model replies) a loop on SmolLM2 may take before it must have answered.
SMOKE_TURNS = 6

# The Agents SDK would send its traces to OpenAI: there is no internet here.
set_tracing_disabled(True)
# LangGraph 1.x points at langchain.agents.create_agent; the prebuilt agent is what we test.
#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:create_react_agent has been moved"),
]


class Tools:
    """The loop's two tools as plain functions (each SDK wraps them its own way), and the
    calls they received: (name, city)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def functions(self) -> list[Callable[[str], str]]:
        def get_weather(city: str) -> str:
            self.calls.append(("get_weather", city))
            return LOOP_RESULTS[0]

        def get_time(city: str) -> str:
            self.calls.append(("get_time", city))
            return LOOP_RESULTS[1]

        # The descriptions the planted model knows (the weather one is its cue).
        get_weather.__doc__, get_time.__doc__ = WEATHER_TOOL[1], TIME_TOOL[1]
        return [get_weather, get_time]


#: The calls the planted loop makes, as the tools receive them.
EXPECTED_CALLS = [(name, arguments["city"]) for name, arguments in LOOP_CALLS]


#: The planted families the LangGraph and Agents SDK loops run on (indirect `planted`).
FAMILIES = pytest.mark.parametrize("planted", ["qwen3", "qwen3_5"], indirect=True)


@pytest.fixture(scope="module")
def planted(request, tmp_path_factory):
    """(base URL, model name) of `qinfer serve` on the planted Qwen3 (or the family a test
    names) with its tool loop."""
    family = getattr(request, "param", "qwen3")
    folder = build_planted_qwen3(
        tmp_path_factory.mktemp(f"agent-loop-{family}"),
        tool_loop=True,
        family=family,
        max_position_embeddings=4096,
    )
    with serving(
        *("--model", str(folder), "--served-model-name", "tiny", "--max-model-len", "4096")
    ) as server:
        yield server.url, "tiny"


@pytest.fixture(scope="module")
def smollm2():
    """(base URL, model name) of `qinfer serve` with no model: the embedded SmolLM2."""
    model_name = served_name(smollm2_path())
    with serving() as server:
        yield server.url, model_name


# --- LangGraph's prebuilt ReAct agent over ChatOpenAI ----------------------------------


def langgraph_run(served, tools: Tools, max_turns: int, **llm_fields) -> list:
    """The messages of one ReAct run; `max_turns` model replies at most (LangGraph's
    recursion limit counts the model's and the tools' steps)."""
    url, model = served
    llm = ChatOpenAI(base_url=f"{url}/v1", api_key="none", model=model, max_retries=0, **llm_fields)
    agent = create_react_agent(llm, [tool(f) for f in tools.functions()])
    out = agent.invoke({"messages": [("user", QUESTION)]}, {"recursion_limit": 2 * max_turns})
    return out["messages"]


@FAMILIES
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_langgraph_react_agent_runs_two_tools_to_an_answer(planted, streaming):
    tools = Tools()
    messages = langgraph_run(planted, tools, max_turns=3, temperature=0, streaming=streaming)
    assert [type(m) for m in messages] == [
        HumanMessage,
        AIMessage,
        ToolMessage,
        AIMessage,
        ToolMessage,
        AIMessage,
    ]
    assert [m.response_metadata["finish_reason"] for m in messages[1::2]] == [
        "tool_calls",
        "tool_calls",
        "stop",
    ]
    calls = [messages[1].tool_calls, messages[3].tool_calls]
    assert [[(c["name"], c["args"]) for c in turn] for turn in calls] == [[c] for c in LOOP_CALLS]
    results = [messages[2], messages[4]]
    assert [m.content for m in results] == list(LOOP_RESULTS)
    assert [m.tool_call_id for m in results] == [turn[0]["id"] for turn in calls]
    assert messages[-1].content == LOOP_ANSWER and not messages[-1].tool_calls
    assert tools.calls == EXPECTED_CALLS


def test_langgraph_react_agent_on_smollm2_ends_by_itself(smollm2):
    messages = langgraph_run(smollm2, Tools(), SMOKE_TURNS, temperature=0, max_tokens=64)
    replies = [m for m in messages if isinstance(m, AIMessage)]
    assert 1 <= len(replies) <= SMOKE_TURNS
    assert not replies[-1].tool_calls and not replies[-1].invalid_tool_calls


# --- the OpenAI Agents SDK over the Responses API --------------------------------------


def agents_run(served, tools: Tools, max_turns: int, stream: bool, **settings):
    """The RunResult of one Agents SDK run (`Runner.run_sync`, or `Runner.run_streamed`
    with every event read) with the server's Responses API as its model."""
    url, model_name = served
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    agent = Agent(
        name="assistant",
        model=OpenAIResponsesModel(model_name, client),
        model_settings=ModelSettings(**settings),
        tools=[function_tool(f) for f in tools.functions()],
    )
    if not stream:
        return Runner.run_sync(agent, QUESTION, max_turns=max_turns)

    async def streamed():
        result = Runner.run_streamed(agent, QUESTION, max_turns=max_turns)
        async for _ in result.stream_events():
            pass
        return result

    return asyncio.run(streamed())


@FAMILIES
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_agents_sdk_runs_two_tools_to_an_answer(planted, stream):
    tools = Tools()
    result = agents_run(planted, tools, max_turns=3, stream=stream, temperature=0)
    items = result.new_items
    # Each turn: the model's reasoning, then its call and the tool's output; then the answer.
    kinds = ["reasoning_item", "tool_call_item", "tool_call_output_item"]
    assert [item.type for item in items] == [
        *kinds,
        *kinds,
        "reasoning_item",
        "message_output_item",
    ]
    reasoning = [item.raw_item for item in items if item.type == "reasoning_item"]
    assert all([part.text for part in r.content] == [PLANTED_REASONING] for r in reasoning)
    calls = [item.raw_item for item in items if item.type == "tool_call_item"]
    outputs = [item.raw_item for item in items if item.type == "tool_call_output_item"]
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", '{"city": "Paris"}'),
    ]
    assert [o["call_id"] for o in outputs] == [c.call_id for c in calls]
    assert [o["output"] for o in outputs] == list(LOOP_RESULTS)
    assert ItemHelpers.text_message_outputs(items) == LOOP_ANSWER == result.final_output
    assert len(result.raw_responses) == 3 and tools.calls == EXPECTED_CALLS


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_agents_sdk_on_smollm2_ends_by_itself(smollm2, stream):
    # MaxTurnsExceeded, or any error of the server, fails the test.
    result = agents_run(smollm2, Tools(), SMOKE_TURNS, stream, temperature=0, max_tokens=64)
    assert 1 <= len(result.raw_responses) <= SMOKE_TURNS
    assert isinstance(result.final_output, str)


# --- the anthropic client's tool runner over the Messages API --------------------------


def anthropic_run(served, tools: Tools, max_turns: int, stream: bool = False, **fields):
    """(the replies, the request bodies sent) of one tool-runner run (streamed: each
    reply read from its stream of events).

    The runner asks for a server-held thread; qinfer refuses it in the words the runner
    reads to go on without one (tests/test_server_anthropic.py), so every turn sends the
    whole conversation."""
    url, model = served
    sent: list[dict] = []

    def record(request) -> None:
        sent.append(json.loads(request.content))

    http = anthropic.DefaultHttpxClient(event_hooks={"request": [record]})
    client = anthropic.Anthropic(
        base_url=url, api_key="none", max_retries=0, timeout=120, http_client=http
    )
    runner = client.beta.messages.tool_runner(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[beta_tool(f) for f in tools.functions()],
        max_iterations=max_turns,
        extra_body={"temperature": 0},  # this version's tool runner takes no temperature
        stream=stream,
        **fields,
    )
    if not stream:
        return list(runner), sent
    return [reply.get_final_message() for reply in runner], sent


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_tool_runner_runs_two_tools_to_an_answer(planted, stream):
    tools = Tools()
    replies, sent = anthropic_run(planted, tools, 3, stream, max_tokens=200)
    assert [reply.stop_reason for reply in replies] == ["tool_use", "tool_use", "end_turn"]
    assert all(
        reply.content[0].type == "thinking" and reply.content[0].thinking == PLANTED_REASONING
        for reply in replies
    )
    uses = [block for reply in replies[:2] for block in reply.content[1:]]
    assert [(u.type, u.name, u.input) for u in uses] == [("tool_use", *c) for c in LOOP_CALLS]
    assert [(b.type, b.text) for b in replies[2].content[1:]] == [("text", LOOP_ANSWER)]
    # The thread asked for and refused once, then each turn the whole conversation, whose
    # last user turn is the result of the call just made.
    assert [body.get("thread") for body in sent] == [{"type": "create"}, None, None, None]
    assert [len(body["messages"]) for body in sent[1:]] == [1, 3, 5]
    results = [block for body in sent[2:] for block in body["messages"][-1]["content"]]
    assert [(r["type"], r["tool_use_id"]) for r in results] == [("tool_result", u.id) for u in uses]
    assert [r["content"] for r in results] == list(LOOP_RESULTS)
    assert tools.calls == EXPECTED_CALLS


def test_anthropic_tool_runner_on_smollm2_ends_by_itself(smollm2):
    replies, _ = anthropic_run(smollm2, Tools(), SMOKE_TURNS, max_tokens=64)
    assert 1 <= len(replies) <= SMOKE_TURNS
    assert replies[-1].stop_reason in ("end_turn", "max_tokens")


# --- the planted Qwen3.5 itself ---------------------------------------------------------


def test_planted_qwen3_5_calls_alike_in_transformers_and_qinfer(tmp_path):
    """Offered the tools, with get_weather's result in, the planted Qwen3.5 (DeltaNet layers
    and all) greedily writes its get_time call in XML, in transformers and qinfer alike."""
    folder = build_planted_qwen3(
        tmp_path, tool_loop=True, family="qwen3_5", max_position_embeddings=2048
    )
    tokenizer = qinfer.load_tokenizer(folder)
    tools = [
        {"type": "function", "function": {"name": name, "description": description}}
        for name, description in (WEATHER_TOOL, TIME_TOOL)
    ]
    call = {"id": "c0", "type": "function", "function": {"name": "get_weather"}}
    call["function"]["arguments"] = LOOP_CALLS[0][1]
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c0", "content": LOOP_RESULTS[0]},
    ]
    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    params = qinfer.SamplingParams(temperature=0, max_tokens=12)
    ours = qinfer.generate(qinfer.load_model(folder, dtype=torch.float32), tokenizer, ids, params)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert ours.token_ids == out[0, len(ids) :].tolist()
    name, arguments = LOOP_CALLS[1]
    expected = f"{PLANTED_REASONING}</think>\n\n<tool_call>\n<function={name}>\n"
    expected += f"<parameter=city>\n{arguments['city']}\n</parameter>\n</function>\n</tool_call>"
    assert tokenizer.decode(ours.token_ids) == expected + "<|im_end|>"
