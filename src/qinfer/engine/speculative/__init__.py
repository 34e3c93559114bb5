"""Speculative decoding: guess the next tokens cheaply, let the model check them all at once.

A decoding sequence runs one token per step. With a proposer, it runs its last sampled
token followed by k proposed ones (`Sequence.proposed`) in the same step: the forward
returns 1 + k rows of logits (`ScheduledStep.num_logits`), and the engine samples row by row,
keeping proposals while they match what it samples (`qinfer.request.sampling`: exact rejection
sampling, so greedy output is token for token and sampled output distribution for
distribution what it would be without speculation). One step then yields from 1 to k + 1
tokens, for the price of a forward over k + 1 rows, which on a CPU or GPU costs little
more than one row.

config.py       `SpeculativeConfig`: method (ngram, draft, mtp), k, the draft model, n-gram sizes
ngram.py        prompt lookup: propose what followed the last n tokens earlier on
draft.py        a draft model with its own KV pool over the target's block tables
mtp.py          the checkpoint's own MTP head as the draft, its K/V pool beside the target's
speculator.py   the engine's side: who proposes, how many (adaptive k), and the counters

What a rejected proposal wrote is undone by counting: its K/V slots lie past
`num_computed_tokens` (overwritten by the next step), its blocks are hashed for the prefix
cache only once computed, and the request's state (penalties, grammar, detokenizer, stop
strings, max_tokens, logprobs) only ever sees accepted tokens. A hybrid model's recurrent
state (Gated DeltaNet) cannot be undone by counting: the verification keeps the state
before the proposals in a checkpoint row (`attention.state_pool`), and when one is
rejected the next step sets the state back to it and runs the accepted ones again
(`Sequence.state_rollback`), at most k tokens more in a step that runs k + 1 already.
"""
