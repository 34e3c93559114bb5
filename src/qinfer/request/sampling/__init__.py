"""Sampling: choose the next token of every row from its logits, each row with its own settings.

The order of the steps is the one `transformers` uses, so its logits processors are the
reference the tests check against:

0. each row's own logits processors (`LogitsProcessor`: a request's `logit_bias`, a
   grammar's mask), in order, on the raw logits;
1. penalties:
   - `repetition_penalty` (HF / CTRL): every id in the row's *prompt and generated* tokens
     has its logit divided by the penalty when positive, multiplied when negative;
   - `presence_penalty`, `frequency_penalty` (OpenAI): counted over the *generated* tokens
     only (the ids of a history after its `prompt_len` first ones):
     `logit -= frequency_penalty * count + presence_penalty * (count > 0)`;
2. greedy rows (temperature 0, or top_k 1) take the argmax of the penalised logits;
3. the other rows: divide by temperature, keep the top_k highest, keep the smallest set
   whose probability reaches top_p, drop tokens below min_p x the top probability; then
   draw from the softmax with the row's own `torch.Generator` (seeded rows reproduce,
   whichever rows share their batch). Rows with a top_k do all of this on their k best
   candidates only, never touching the rest of the vocabulary.

A row may come with a *proposed* token (speculative decoding, `qinfer.engine.speculative`): a
guess of a proposer that put all its probability on it. The row then keeps the exact
distribution of step 3 by rejection sampling (Leviathan et al. 2023, Chen et al. 2023,
with a point-mass proposal): the proposal is accepted with probability p(proposal), else
the token is drawn from p with the proposal removed (the residual distribution), so
P(x) = p(x) for every x. A greedy row accepts the proposal when it is the argmax.

Log-probabilities returned are those of the model's distribution after the penalties and
before temperature and truncation: `log_softmax(penalised logits)`. They say how likely
the model found each token, whatever the sampling settings, and are never -inf for the
chosen token.

The package: `params.py` (SamplingParams), `processors.py` (what changes the logits),
`sampler.py` (`sample`), `argmax.py` (greedy picks).
"""

from qinfer.request.sampling.argmax import (
    ARGMAX_LOGITS_PER_THREAD,
    ARGMAX_SLICE,
    ARGMAX_SLICED_FROM,
    argmax_rows,
    sliced_argmax,
)
from qinfer.request.sampling.params import (
    CONSTRAINTS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    SamplingParams,
    checkpoint_sampling,
)
from qinfer.request.sampling.processors import (
    LogitBias,
    LogitsProcessor,
    ThinkingBudget,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    process_logits,
)
from qinfer.request.sampling.sampler import (
    SampleResult,
    make_generator,
    sample,
    sampling_distribution,
)

__all__ = [
    "ARGMAX_LOGITS_PER_THREAD",
    "ARGMAX_SLICE",
    "ARGMAX_SLICED_FROM",
    "CONSTRAINTS",
    "LogitBias",
    "LogitsProcessor",
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_STOP_STRINGS",
    "SampleResult",
    "SamplingParams",
    "ThinkingBudget",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k",
    "apply_top_p",
    "argmax_rows",
    "checkpoint_sampling",
    "make_generator",
    "process_logits",
    "sample",
    "sampling_distribution",
    "sliced_argmax",
]
