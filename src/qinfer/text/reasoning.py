"""Reasoning split: separate a thinking model's `<think>...</think>` block from its answer.

Qwen3 writes `<think>\\n...reasoning...\\n</think>\\n\\nanswer`. Two cases:

- the model opens the block itself (Qwen3 with `enable_thinking=True`): the text starts
  with `<think>` (text without it is all answer);
- the chat template already put `<think>\\n` at the end of the prompt (Qwen3-2507
  thinking models, QwQ): the text starts inside the block and only `</think>` appears.

The reasoning loses the newlines around it and the answer its leading newlines, the same
trimming Qwen3's chat template applies when it reads `reasoning_content` back in.

`ReasoningStream` does the split on streamed deltas (the server sends `reasoning_content`
and `content` deltas separately); `split_reasoning` runs it on a whole text, so the two
always agree.
"""

from __future__ import annotations

from qinfer.text.detokenizer import partial_match_length

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# Where the stream is: before any text (the block may open), inside the block, after it
# (leading newlines still to drop), in the answer.
_START, _REASONING, _AFTER_THINK, _ANSWER = "start", "reasoning", "after_think", "answer"


def splits_reasoning(tokenizer) -> bool:
    """True for a thinking model's tokenizer: one whose vocabulary has `</think>` (Qwen3,
    and the models whose template opens the block, which write only `</think>`)."""
    return tokenizer.token_to_id(THINK_CLOSE) is not None


def prompt_opened_think(prompt: str) -> bool:
    """True when the prompt ends inside an open `<think>` block (the model continues it)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


# Where a thinking model's prompt leaves its `<think>...</think>` block (`prompt_thinking`):
ANSWER = "answer"  # the block is closed (or cannot open): every token is answer
MAY_THINK = "may_think"  # the model may open the block with its first token
THINKING = "thinking"  # the prompt ends inside an open block: the model is thinking


def prompt_thinking(tokenizer, prompt_ids: list[int]) -> str | None:
    """Where a request starts with respect to the `<think>` block, computed once per request
    (the prompt decoded once): THINKING, MAY_THINK or ANSWER for a thinking model's
    tokenizer (`splits_reasoning`), None for any other (no reasoning split). ANSWER when
    the prompt ends with the block closed, as Qwen3's template writes it with
    `enable_thinking=False`, or when the vocabulary has no `<think>` to open one."""
    if tokenizer is None or not splits_reasoning(tokenizer):
        return None
    prompt = tokenizer.decode(prompt_ids)
    if prompt_opened_think(prompt):
        return THINKING
    if prompt.rstrip().endswith(THINK_CLOSE) or tokenizer.token_to_id(THINK_OPEN) is None:
        return ANSWER
    return MAY_THINK


class ReasoningStream:
    """Splits streamed text into reasoning deltas and answer deltas.

    prompt_opened_think: the prompt ended inside `<think>` (see `prompt_opened_think`).
    `push(delta)` and `finish()` return (reasoning_delta, answer_delta); either may be "".
    Text that may still be part of `<think>` / `</think>` or of newlines to trim is held.
    """

    def __init__(self, prompt_opened_think: bool = False) -> None:
        self._state = _REASONING if prompt_opened_think else _START
        self.opened = prompt_opened_think  # the text is (or was) inside a <think> block
        self._held = ""
        self._reasoning_started = False  # leading newlines of the reasoning are dropped

    def push(self, delta: str) -> tuple[str, str]:
        self._held += delta
        reasoning, answer = "", ""
        while True:  # a single delta may cross from one state into the next
            state = self._state
            if state == _START:
                answer += self._start()
            elif state == _REASONING:
                reasoning += self._reasoning()
            elif state == _AFTER_THINK:
                self._held = self._held.lstrip("\n")
                if self._held:
                    self._state = _ANSWER
            else:
                answer, self._held = answer + self._held, ""
            if self._state == state:
                return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """End of the text: release what was held (an unclosed block is all reasoning)."""
        held, self._held = self._held, ""
        if self._state == _REASONING:
            return (held if self._reasoning_started else held.lstrip("\n")).rstrip("\n"), ""
        if self._state == _START:
            return "", held
        return "", ""

    def _start(self) -> str:
        """Before any text: wait to see whether the text opens a think block."""
        head = self._held.lstrip()
        if head.startswith(THINK_OPEN):
            self._held = head[len(THINK_OPEN) :]
            self._state, self.opened = _REASONING, True
        elif not THINK_OPEN.startswith(head):
            self._state = _ANSWER
        return ""

    def _reasoning(self) -> str:
        """Inside the block: emit reasoning up to `</think>` or to what may be its start."""
        if not self._reasoning_started:
            self._held = self._held.lstrip("\n")
            self._reasoning_started = bool(self._held)
        end = self._held.find(THINK_CLOSE)
        if end >= 0:
            out = self._held[:end].rstrip("\n")
            self._held = self._held[end + len(THINK_CLOSE) :]
            self._state = _AFTER_THINK
            return out
        keep = partial_match_length(self._held, [THINK_CLOSE])
        body = self._held[: len(self._held) - keep]
        out = body.rstrip("\n")  # newlines right before </think> are trimmed
        self._held = self._held[len(out) :]
        return out


def split_reasoning(text: str, prompt_opened_think: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a whole generated text; see `ReasoningStream`."""
    stream = ReasoningStream(prompt_opened_think)
    reasoning, answer = stream.push(text)
    tail_reasoning, tail_answer = stream.finish()
    return reasoning + tail_reasoning, answer + tail_answer
