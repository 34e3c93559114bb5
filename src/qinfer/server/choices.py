"""One API request through the engine: prompts in, OpenAI choices, chunks and usage out.

A request becomes `len(prompts) x n` engine requests (choice `i * n + j` is sample j of
prompt i, seeded `seed + j`), whose streams run concurrently and are merged. Each choice
is a `Choice` that turns the engine's cumulative outputs into deltas of text,
reasoning, tool calls and logprobs. Streaming and non-streaming answers are both built from
those deltas, so the two always carry the same text and the same calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qinfer.engine.outputs import TokenLogprob
from qinfer.request.sampling import SamplingParams
from qinfer.request.tool_calls import (
    ParsedDelta,
    ToolCallDelta,
    ToolCallParser,
    ToolUse,
    XmlCallParser,
)
from qinfer.server.metrics import RequestTimer, ServerMetrics
from qinfer.text.reasoning import ReasoningStream

if TYPE_CHECKING:
    from qinfer.engine import AsyncEngine, RequestOutput
    from qinfer.text.prompts import PromptParts


@dataclass
class Delta:
    """What one engine output adds to one choice."""

    index: int
    text_offset: int = 0  # where `content` starts in the choice's whole content
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    cut_call: int | None = None  # a call whose arguments the reply's end cut (the last one)

    @property
    def empty(self) -> bool:
        return not (
            self.content or self.reasoning or self.tool_calls or self.logprobs or self.finish_reason
        )

    def extend(self, later: Delta) -> None:
        """Append a later delta of the same choice (to build a whole answer); a call it
        says was cut is left out, so an answer never holds unparsable arguments."""
        self.content += later.content
        self.reasoning += later.reasoning
        for call in later.tool_calls:  # a call's first delta, or more of its arguments
            if call.index < len(self.tool_calls):
                self.tool_calls[call.index].arguments += call.arguments
            else:
                self.tool_calls.append(dataclasses.replace(call))
        if later.cut_call is not None:
            self.tool_calls = [c for c in self.tool_calls if c.index != later.cut_call]
        self.logprobs += later.logprobs
        self.finish_reason = later.finish_reason or self.finish_reason


class Choice:
    """One choice and the engine request behind it; turns its outputs into deltas.

    split_reasoning: split a `<think>` block off the text (chat answers of thinking models),
    where the engine's request says where its prompt left the block
    (`RequestOutput.prompt_opened_think`); else all text is content.
    tools: the tools the request offers, whose calls are parsed out of the content, or None;
    a reply that repeats one of its calls ends there (`finish_reason` "stop", as if the
    model had stopped: the caller aborts the engine request and ignores its later outputs).
    echo: text the content starts with (a text completion's `echo`: its prompt); with
    `params.prompt_logprobs`, the logprobs start with the prompt tokens' (the first's None).
    prompt: the prompt's ids, or its `PromptParts` when it holds images (which the engine
    reads, and whose placeholders it expands).
    """

    def __init__(
        self,
        index: int,
        request_id: str,
        prompt: list[int] | PromptParts,
        params: SamplingParams,
        split_reasoning: bool,
        tools: ToolUse | None = None,
        echo: str = "",
    ):
        self.index, self.request_id = index, request_id
        self.prompt, self.params = prompt, params
        self.split_reasoning = split_reasoning
        self.reasoning: ReasoningStream | None = None  # made at the first output
        self.tools = tools
        self.echo = echo  # not yet handed out
        self.echo_logprobs = params.prompt_logprobs is not None  # not yet handed out
        self.tool_parser: ToolCallParser | XmlCallParser | None = (
            None if tools is None else tools.parser()
        )
        # The XML calls a model writes inside <think> are calls too (`xml_calls`).
        self.think_parser = None if tools is None else tools.reasoning_parser(self.tool_parser)
        self.num_logprobs = 0  # logprobs already handed out
        self.content_length = 0  # characters of content already handed out
        self.output: RequestOutput | None = None  # the latest engine output
        # Once the reply ended: the engine's finish reason, or "stop" (a repeated call).
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def reasoning_tokens(self, think_close: int) -> int:
        """The reply's tokens of reasoning: through `</think>`, or all of them while the
        block is still open; none when the reply did not think."""
        if self.reasoning is None or self.output is None or not self.reasoning.opened:
            return 0
        generated = self.output.token_ids
        return generated.index(think_close) + 1 if think_close in generated else len(generated)

    def advance(self, output: RequestOutput) -> Delta:
        """The delta of `output`, the engine's latest output for this choice."""
        if self.output is None and self.split_reasoning:
            if output.prompt_opened_think is not None:  # decided once, by the request
                self.reasoning = ReasoningStream(output.prompt_opened_think)
        self.output = output
        self.finish_reason = output.finish_reason if output.finished else None
        delta = Delta(self.index, text_offset=self.content_length)
        if output.logprobs is not None:
            delta.logprobs = output.logprobs[self.num_logprobs :]
            self.num_logprobs = len(output.logprobs)
        if self.echo_logprobs and output.prompt_logprobs is not None:
            first = TokenLogprob(output.prompt_token_ids[0], None, {})  # nothing predicts it
            delta.logprobs = [first, *output.prompt_logprobs[1:], *delta.logprobs]
            self.echo_logprobs = False
        if self.reasoning is None:
            delta.content = output.delta_text
        else:
            delta.reasoning, delta.content = self.reasoning.push(output.delta_text)
            if output.finished:
                tail_reasoning, tail_content = self.reasoning.finish()
                delta.reasoning += tail_reasoning
                delta.content += tail_content
        delta.finish_reason = self.finish_reason
        thought = ParsedDelta()  # the calls written inside <think>
        if self.think_parser is not None and self.reasoning is not None:
            thought = self.think_parser.push(delta.reasoning)
            if self.finished:
                tail = self.think_parser.finish()
                thought.content += tail.content
                thought.tool_calls += tail.tool_calls
                thought.cut_call = tail.cut_call
            delta.reasoning = thought.content
        if self.tool_parser is not None:
            parsed = self.tool_parser.push(delta.content)
            parsed.tool_calls = thought.tool_calls + parsed.tool_calls
            repeated = self.think_parser is not None and self.think_parser.repeated
            if self.tool_parser.repeated or repeated:  # the reply is over: its calls are made
                self.finish_reason = "stop"
            if self.finished:
                tail = self.tool_parser.finish()
                parsed.content += tail.content
                parsed.tool_calls += tail.tool_calls
                delta.cut_call = thought.cut_call if tail.cut_call is None else tail.cut_call
                made_calls = self.tool_parser.made_calls
                delta.finish_reason = finish_reason(self.tools, self.finish_reason, made_calls)
            delta.content, delta.tool_calls = parsed.content, parsed.tool_calls
        delta.content, self.echo = self.echo + delta.content, ""
        self.content_length += len(delta.content)
        return delta


def finish_reason(tools: ToolUse, reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's finish reason of a reply that was offered tools: "tool_calls" when a reply
    that stopped made calls, but "stop" when a named tool was forced (as OpenAI answers)."""
    if reason != "stop" or not made_calls or tools.forced not in (None, "required"):
        return reason
    return "tool_calls"


def usage(
    outputs: Sequence[RequestOutput], n: int, reasoning_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI `usage` of a request's final outputs, choice `i * n + j` at position i * n + j.

    The n samples of one prompt share it, so its tokens (and cached tokens) count once.
    reasoning_tokens: the choices' tokens of reasoning (None: not a thinking model's chat).
    """
    per_prompt = outputs[::n]
    prompt_tokens = sum(o.num_prompt_tokens for o in per_prompt)
    completion_tokens = sum(o.num_generated_tokens for o in outputs)
    counts = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in per_prompt)},
    }
    if reasoning_tokens is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return counts


class Completion:
    """The engine requests behind one API request, and their merged stream of deltas.

    prompts: token ids of each prompt (its `PromptParts` when it holds images); params: the
    sampling of choice 0 of every prompt (choice j gets `seed + j`); split_reasoning: split
    `<think>` blocks off the text; tools: parse tool calls out of the content (chat
    requests that offer tools); echo: the text each prompt's choices start with (a text
    completion's `echo`), or None; lora: the LoRA adapter every choice runs through (None:
    the base model); think_close: the id of `</think>` when the reasoning is split off
    (usage then counts each choice's reasoning tokens).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        prompts: Sequence[list[int] | PromptParts],
        params: SamplingParams,
        n: int,
        id_prefix: str,
        split_reasoning: bool = False,
        tools: ToolUse | None = None,
        echo: Sequence[str] | None = None,
        lora: str | None = None,
        think_close: int | None = None,
    ):
        self.engine, self.metrics, self.n, self.lora = engine, metrics, n, lora
        self.think_close = think_close
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                index = i * n + j
                seeded = params if params.seed is None else params.replace(seed=params.seed + j)
                echoed = "" if echo is None else echo[i]
                request_id = f"{self.id}-{index}"
                self.choices.append(
                    Choice(index, request_id, prompt, seeded, split_reasoning, tools, echoed)
                )

    def usage(self) -> dict[str, Any]:
        outputs = [choice.output for choice in self.choices]
        if self.think_close is None:
            return usage(outputs, self.n)
        spent = sum(choice.reasoning_tokens(self.think_close) for choice in self.choices)
        return usage(outputs, self.n, spent)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas of all choices as the engine produces them, interleaved.

        Engine errors (overloaded, bad request) surface from the first `__anext__`.
        Closing this iterator early (the client left) aborts every unfinished request.
        """
        queue: asyncio.Queue[tuple[Choice, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            """Relay one engine request's outputs to the queue, then None (or its error)."""
            timer = RequestTimer(self.metrics)
            stream = self.engine.generate(
                choice.prompt, choice.params, choice.request_id, self.lora
            )
            try:
                async for output in stream:
                    timer.tokens_arrived(len(output.delta_token_ids))
                    await queue.put((choice, output))
                timer.finished()
                await queue.put(None)
            except Exception as error:  # handed to the consumer, which raises it
                await queue.put(error)

        tasks = [asyncio.create_task(pump(choice)) for choice in self.choices]
        running = len(tasks)
        try:
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    choice, output = item
                    if choice.finished:  # the reply ended before its request (aborted below)
                        continue
                    delta = choice.advance(output)
                    if choice.finished and not output.finished:
                        self.engine.abort(choice.request_id)
                    if not delta.empty:
                        yield delta
        finally:
            for task in tasks:
                task.cancel()
            for choice in self.choices:
                if not choice.finished:
                    self.engine.abort(choice.request_id)
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self) -> list[Delta]:
        """Run every choice to its end; the whole answer of each, in choice order."""
        answers = [Delta(choice.index) for choice in self.choices]
        # aclosing: when this is cancelled (the client left), the deltas close at once.
        async with contextlib.aclosing(self.deltas()) as deltas:
            async for delta in deltas:
                answers[delta.index].extend(delta)
        return answers
