"""The log-probabilities of a prompt's own tokens (`SamplingParams.prompt_logprobs`).

Row p of the logits predicts token p + 1, so a request that wants them asks the runner
for the logits of every row of each prompt chunk (chunked prefill: chunk by chunk) and
keeps, for positions 1 .. L - 1, the log-softmax of the raw logits (no temperature, no
processor: the model's own distribution, as vLLM and OpenAI give them) at the prompt's
next token, with the `top_n` most likely alternatives. Position 0 has none: nothing
predicts it (its entry is None, as vLLM's).

Prefix cache: a cache hit would skip the rows of the cached prefix, so such a request
does not look it up (`Sequence.uses_prefix_cache`, as mean pooling); its blocks are still
registered for later requests. A preempted request recomputes its prompt from position
0 while its logprobs are incomplete, and writes the same entries again; once complete,
it asks for no more rows.
"""

from __future__ import annotations

import torch

from qinfer.engine.outputs import TokenLogprob


class PromptLogprobs:
    """The prompt logprobs of one request, gathered step by step."""

    def __init__(self, prompt_ids: list[int], top_n: int) -> None:
        self.prompt_ids = prompt_ids
        self.top_n = top_n
        # entries[p]: the logprob of prompt token p given the tokens before it
        self.entries: list[TokenLogprob | None] = [None] * len(prompt_ids)
        self.num_known = 1  # positions 0 .. num_known - 1 are known (0 has no logprob)

    @property
    def complete(self) -> bool:
        return self.num_known >= len(self.prompt_ids)

    def add(self, start: int, logits: torch.Tensor) -> None:
        """Take the logits (n, V) of a step's rows at positions start .. start + n - 1;
        those that predict a prompt token (position < L - 1) give its entry."""
        count = min(logits.shape[0], len(self.prompt_ids) - 1 - start)
        if count <= 0:
            return
        logprobs = torch.log_softmax(logits[:count].float(), dim=-1)  # (count, V)
        targets = torch.tensor(
            self.prompt_ids[start + 1 : start + 1 + count], device=logprobs.device
        )
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        if self.top_n:
            values, ids = torch.topk(logprobs, self.top_n, dim=-1)  # (count, top_n)
            pairs = zip(ids.tolist(), values.tolist(), strict=True)
            tops = [dict(zip(i, v, strict=True)) for i, v in pairs]
        else:
            tops = [{}] * count
        for i in range(count):
            position = start + 1 + i
            self.entries[position] = TokenLogprob(self.prompt_ids[position], chosen[i], tops[i])
        self.num_known = max(self.num_known, start + 1 + count)
