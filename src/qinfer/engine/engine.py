"""The synchronous engine: requests in, one batched model step at a time, outputs out.

    engine = Engine(model, tokenizer, EngineConfig(...))
    engine.add_request("Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for output in engine.step(): ...

Each step asks the scheduler for a batch (decode tokens of running sequences plus prefill
chunks of new ones), runs it through the model over the paged KV pool, samples a token
for every sequence whose pending tokens are all computed (each with its own
SamplingParams and generator), detokenizes, checks the stop conditions, and frees the
blocks of every sequence that finished. `LLM` (offline) and `AsyncEngine` (server) wrap it.
"""

from __future__ import annotations

import uuid
import weakref
from functools import partial
from pathlib import Path

from qinfer.checkpoint import resolve_model
from qinfer.distributed import TensorParallelGroup, init_tensor_parallel, load_on_every_rank
from qinfer.engine.block_manager import BlockManager
from qinfer.engine.config import EngineConfig
from qinfer.engine.outputs import RequestOutput, TokenLogprob
from qinfer.engine.scheduler import Scheduler
from qinfer.engine.sequence import Sequence
from qinfer.engine.stats import EngineStats, ThroughputMeter
from qinfer.errors import QinferError, RequestError, TokenizerError
from qinfer.model import Transformer, load_model
from qinfer.pooling import PoolingParams, PoolingState
from qinfer.request_state import RequestState, sample_next
from qinfer.runtime.executor import Executor, follow
from qinfer.runtime.runner import step_inputs
from qinfer.sampling import SamplingParams
from qinfer.text.prompts import Prompt, encode_prompt
from qinfer.text.prompts import eos_token_ids as model_eos_ids
from qinfer.text.tokenizer import Tokenizer, load_tokenizer


class Request:
    """A sequence plus what turns its tokens into a response: its RequestState (params,
    generator, text, stop rule, processors), its logprobs and what was already sent.

    The state appends sampled ids to the sequence's own token list. A pooling request
    (`pooling` set) samples nothing: it finishes when its prompt has run, with `embedding`.
    """

    def __init__(
        self,
        seq: Sequence,
        prompt: str | None,
        state: RequestState,
        pooling: PoolingState | None = None,
    ) -> None:
        self.seq = seq
        self.prompt = prompt
        self.state = state
        self.pooling = pooling
        self.embedding = None  # the pooled vector, once a pooling request has finished
        self.logprobs: list[TokenLogprob] | None = [] if state.params.logprobs is not None else None
        self.finish_reason: str | None = None  # OpenAI's: EOS is a "stop"
        self.num_sent_tokens = 0  # tokens already handed out in outputs
        self.num_sent_chars = 0

    @property
    def params(self) -> SamplingParams:
        return self.state.params

    def output(self) -> RequestOutput:
        """The request as it stands, with what is new since the previous output."""
        seq, text = self.seq, self.state.text
        token_ids = self.state.output_token_ids
        out = RequestOutput(
            request_id=seq.request_id,
            prompt=self.prompt,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            text=text,
            token_ids=token_ids,
            delta_text=text[self.num_sent_chars :],
            delta_token_ids=token_ids[self.num_sent_tokens :],
            finished=seq.is_finished,
            finish_reason=self.finish_reason,
            stop_reason=self.state.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            num_generated_tokens=self.state.num_generated_tokens,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            prompt_opened_think=self.state.prompt_opened_think,
            embedding=self.embedding,
        )
        self.num_sent_tokens, self.num_sent_chars = len(token_ids), len(text)
        return out


class Engine:
    """Continuous batching over a paged KV pool, one `step()` at a time (not thread-safe).

    group: under tensor parallelism, the group whose rank 0 this is (model is rank 0's
    shard; the workers follow each step, see `Executor`); `close()` stops them.
    eos_token_ids: the ids that end a request (default: the model's and tokenizer's).
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        default_params: SamplingParams | None = None,
        group: TensorParallelGroup | None = None,
        eos_token_ids: frozenset[int] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.default_params = default_params or SamplingParams()  # for requests without any
        self.executor = Executor(model, self.config, group)
        # close() on demand, else when the engine is collected or the interpreter exits
        self._close = weakref.finalize(self, self.executor.close)
        self.block_manager = BlockManager(
            self.executor.num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.config, self.block_manager)
        context = model.config.max_position_embeddings
        self.context_len = min(self.config.max_model_len or context, context)
        # The longest sequence: within the context, and its K/V (all but the last token,
        # which is never fed back) within the pool.
        self.max_len = min(self.context_len, self.executor.num_blocks * self.config.block_size + 1)
        # The model's and tokenizer's EOS ids, unless the caller names its own (token-id
        # front-ends without a tokenizer: `qinfer.generation.generate_ids`).
        if eos_token_ids is None:
            eos_token_ids = model_eos_ids(model, tokenizer)
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, Request] = {}
        self._throughput = ThroughputMeter()
        self._counts = dict.fromkeys(
            ["prompt", "prompt_computed", "generated", "finished", "aborted", "preempted"], 0
        )

    # -- requests -------------------------------------------------------------------------

    def make_request(
        self,
        prompt: Prompt,
        params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Check and encode a request without touching the engine's state (thread-safe).

        params: SamplingParams to generate; PoolingParams to pool the prompt's hidden
        states into one vector instead (`qinfer.pooling`; the output's `embedding`)."""
        params = self.default_params if params is None else params
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is not None:
            pooling.check_hidden_size(self.model.config.hidden_size)
            params = SamplingParams(max_tokens=1)  # a state for the output; never sampled
        if not isinstance(params, SamplingParams):
            raise RequestError(
                f"params must be a SamplingParams or PoolingParams, got {type(params).__name__}"
            )
        request_id = uuid.uuid4().hex if request_id is None else request_id
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id must be a non-empty string, got {request_id!r}")
        # The model runs these ids unchecked (`runner.step_inputs`): encode_prompt checks them.
        try:
            ids = encode_prompt(self.tokenizer, prompt, vocab_size=self.model.config.vocab_size)
        except QinferError as error:
            raise RequestError(str(error)) from None
        if len(ids) >= self.max_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens; this engine serves prompts of at most "
                f"{self.max_len - 1} (context {self.context_len} positions, KV pool "
                f"{self.executor.num_blocks * self.config.block_size} tokens)"
            )
        seq = Sequence(request_id, ids, pooling is None or pooling.uses_prefix_cache)
        try:
            state = RequestState.create(
                seq.token_ids,
                params,
                min(params.max_tokens, self.max_len - len(ids)),
                self.eos_token_ids,
                self.tokenizer,
                self.model.device,
            )
        except QinferError as error:
            raise RequestError(str(error)) from None
        return Request(
            seq,
            prompt if isinstance(prompt, str) else None,
            state,
            None if pooling is None else PoolingState(pooling, len(ids)),
        )

    def add(self, request: Request) -> None:
        """Queue a request made by `make_request`."""
        request_id = request.seq.request_id
        if request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in use")
        self.requests[request_id] = request
        self.scheduler.add(request.seq)
        self._counts["prompt"] += request.seq.num_prompt_tokens

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a prompt (text, token ids or chat messages); returns its request id."""
        request = self.make_request(prompt, params, request_id)
        self.add(request)
        return request.seq.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; its last output (finish_reason "abort"),
        or None if the id is unknown or already finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        request.state.abort()  # the text held back so far is still the reply's
        self._finish(request, "abort")
        self._counts["aborted"] += 1
        return request.output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; nothing at world 1)."""
        self._close()

    # -- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch through the model; outputs of the requests that moved or finished."""
        scheduled = self.scheduler.schedule()
        self._counts["preempted"] += scheduled.num_preempted
        if not scheduled.seqs:
            return []
        poolings = [self.requests[seq.request_id].pooling for seq in scheduled.seqs]
        hidden_rows = [
            None if pooling is None else pooling.rows(seq.num_computed_tokens, n)
            for seq, n, pooling in zip(scheduled.seqs, scheduled.num_new, poolings, strict=True)
        ]
        # logits (R, V): one row per sampling sequence whose pending tokens are now all
        # computed, in order; hidden: the rows each pooling sequence asked for
        num_logits = [
            int(pooling is None and n == seq.num_uncomputed_tokens)
            for seq, n, pooling in zip(scheduled.seqs, scheduled.num_new, poolings, strict=True)
        ]
        step = step_inputs(scheduled.seqs, scheduled.num_new, num_logits)
        result = self.executor.execute(step, hidden_rows)
        done, outputs = [], []
        for seq, n, pooling, rows in zip(
            scheduled.seqs, scheduled.num_new, poolings, result.hidden, strict=True
        ):
            if pooling is not None:
                pooling.add(seq.num_computed_tokens, rows)
            prompt_left = max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
            self._counts["prompt_computed"] += min(n, prompt_left)
            seq.num_computed_tokens += n
            self.block_manager.register_computed(seq)
            if seq.num_uncomputed_tokens == 0:
                if pooling is None:
                    done.append(seq)
                else:
                    outputs.append(self._pooled(self.requests[seq.request_id]))
        if not done:
            return outputs
        requests = [self.requests[seq.request_id] for seq in done]
        result = sample_next(result.logits, [r.state for r in requests])
        token_ids, logprobs = result.token_ids.tolist(), result.logprobs.tolist()
        for i, request in enumerate(requests):
            self._accept(request, token_ids[i], logprobs[i], result.top_logprobs[i])
            outputs.append(request.output())
        self._throughput.add(len(requests))
        self._counts["generated"] += len(requests)
        return outputs

    def _pooled(self, request: Request) -> RequestOutput:
        """Finish a pooling request whose prompt has run: its vector, its last output."""
        request.embedding = request.pooling.result()
        self._finish(request, "stop")
        return request.output()

    def _accept(self, request: Request, token_id: int, logprob: float, top) -> None:
        """Append a sampled token, extend the text, and finish the request if it is done."""
        if request.logprobs is not None:
            request.logprobs.append(TokenLogprob(token_id, logprob, dict(top or ())))
        state = request.state
        state.accept(token_id)
        if state.finished:
            # OpenAI's finish reasons: end-of-sequence is a "stop" like the others.
            self._finish(request, "stop" if state.finish_reason == "eos" else state.finish_reason)

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        request.state.finish(reason)  # releases its processors (a grammar's matcher)
        self.scheduler.finish(request.seq)
        self.requests.pop(request.seq.request_id, None)
        self._counts["finished"] += 1

    # -- stats ----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        blocks = self.block_manager
        queries, hits = self.scheduler.prefix_queries, self.scheduler.prefix_hits
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=blocks.num_blocks,
            kv_blocks_used=blocks.num_blocks - blocks.num_free_blocks,
            kv_blocks_free=blocks.num_free_blocks,
            kv_blocks_cached=blocks.num_cached_free_blocks,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
            prompt_tokens_total=self._counts["prompt"],
            prompt_tokens_computed_total=self._counts["prompt_computed"],
            generation_tokens_total=self._counts["generated"],
            requests_finished_total=self._counts["finished"],
            requests_aborted_total=self._counts["aborted"],
            preemptions_total=self._counts["preempted"],
            generation_tokens_per_s=self._throughput.rate(),
        )


def build_engine(
    model_or_path: Transformer | str | Path | None,
    tokenizer: Tokenizer | str | Path | None,
    load_args: dict,
    engine_args: dict,
    tensor_parallel_size: int = 1,
) -> Engine:
    """An Engine from a loaded model or a checkpoint (None: the embedded SmolLM2; a path or
    hub id, as `qinfer.checkpoint.resolve_model` finds it), whose tokenizer is loaded too
    when it has one and none is given, and whose generation_config.json gives the sampling
    defaults of requests that bring no SamplingParams. load_args: `load_model`'s keywords
    (dtype, device, quantize, group_size) for a checkpoint.

    tensor_parallel_size N > 1: the checkpoint is split over N ranks (`qinfer.distributed`:
    N - 1 workers spawned here, or the ranks of torchrun); this process is rank 0, and
    the workers are stopped by `Engine.close()`, or when the engine is collected or this
    process exits.
    """
    config = EngineConfig.from_kwargs(**engine_args)
    if isinstance(model_or_path, Transformer):
        if tensor_parallel_size != 1:
            raise QinferError(
                "tensor_parallel_size needs a checkpoint, not a loaded model: "
                "every rank loads its own part"
            )
        return Engine(model_or_path, _tokenizer(tokenizer, None), config)
    path = resolve_model(None if model_or_path is None else str(model_or_path))
    tokenizer = _tokenizer(tokenizer, path)
    default_params = SamplingParams.from_generation_config(path)
    if tensor_parallel_size == 1:
        return Engine(load_model(path, **load_args), tokenizer, config, default_params)
    worker = partial(follow_engine, path, load_args, config)
    group = init_tensor_parallel(tensor_parallel_size, load_args.get("device"), worker)
    model = load_on_every_rank(group, partial(_load_shard, path, load_args, group))
    return Engine(model, tokenizer, config, default_params, group)


def follow_engine(
    path: Path, load_args: dict, config: EngineConfig, group: TensorParallelGroup
) -> None:
    """A worker rank of a tensor-parallel engine: load its shard, size the same pool as
    every rank, and run rank 0's steps until it stops."""
    model = load_on_every_rank(group, partial(_load_shard, path, load_args, group))
    follow(model, config, group)


def _load_shard(path: Path, load_args: dict, group: TensorParallelGroup) -> Transformer:
    return load_model(path, **{**load_args, "device": group.device}, parallel=group.parallel)


def _tokenizer(tokenizer: Tokenizer | str | Path | None, path: Path | None) -> Tokenizer | None:
    """The tokenizer given (or loaded from its path), else the checkpoint's at path, else
    None: a checkpoint without a tokenizer serves token ids only."""
    if isinstance(tokenizer, (str, Path)):
        return load_tokenizer(tokenizer)
    if tokenizer is None and path is not None:
        try:
            return load_tokenizer(path)
        except TokenizerError:
            return None
    return tokenizer
