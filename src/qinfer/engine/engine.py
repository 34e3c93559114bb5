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

import logging
import time
import uuid
import weakref

import torch

from qinfer.attention.block_spaces import window_space_blocks
from qinfer.core.errors import AdapterError, AdapterSlotsBusyError, QinferError, RequestError
from qinfer.engine.block_manager import BlockManager
from qinfer.engine.config import EngineConfig
from qinfer.engine.disk_cache import DiskCache, model_fingerprint
from qinfer.engine.images import encode_images, prompt_images
from qinfer.engine.outputs import RequestOutput, TokenLogprob
from qinfer.engine.request import Request
from qinfer.engine.scheduler import Scheduler
from qinfer.engine.sequence import Sequence, scheduled_step
from qinfer.engine.speculative.speculator import Speculator
from qinfer.engine.stats import EngineStats, ThroughputMeter
from qinfer.engine.tasks import check_task_params, make_task
from qinfer.lora.adapters import Adapters
from qinfer.model.transformer import Transformer
from qinfer.request.pooling import PoolingParams
from qinfer.request.sampling import SamplingParams
from qinfer.request.scoring import ScoreParams
from qinfer.request.state import RequestState, sample_next
from qinfer.runtime.distributed import TensorParallelGroup
from qinfer.runtime.executor import Executor
from qinfer.text.prompts import Prompt, encode_prompt_parts
from qinfer.text.prompts import eos_token_ids as model_eos_ids
from qinfer.text.tokenizer import Tokenizer
from qinfer.vision.language_model import VisionLanguageModel

log = logging.getLogger(__name__)


class Engine:
    """Continuous batching over a paged KV pool, one `step()` at a time (not thread-safe).

    group: under tensor parallelism, the group whose rank 0 this is (model is rank 0's
    shard; the workers follow each step, see `Executor`); `close()` stops them.
    eos_token_ids: the ids that end a request (default: the model's and tokenizer's).
    vision: a vision-language checkpoint's tower and image settings over `model`, for
    prompts with images (`qinfer.engine.images`; None: images are refused, naming the
    first).
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        default_params: SamplingParams | None = None,
        group: TensorParallelGroup | None = None,
        eos_token_ids: frozenset[int] | None = None,
        vision: VisionLanguageModel | None = None,
    ) -> None:
        self.model = model
        self.vision = vision or VisionLanguageModel(model, None, None)
        self.tokenizer = tokenizer
        self.config = (config or EngineConfig()).for_model(model.config)
        self.default_params = default_params or SamplingParams()  # for requests without any
        self.executor = Executor(model, self.config.runtime, group)
        self.disk_cache = self._disk_cache()
        # close() on demand, else when the engine is collected or the interpreter exits
        self._close = weakref.finalize(self, _close, self.executor, self.disk_cache)
        blocks, windows = self.executor.num_blocks, self.executor.spaces.windows
        self.block_manager = BlockManager(
            blocks,
            self.config.block_size,
            self.config.enable_prefix_caching,
            windows,
            state_slots=self.executor.state_slots,
            disk=self.disk_cache,
            state_snapshots=self.executor.state_snapshots,
        )
        self.scheduler = Scheduler(self.config, self.block_manager, self._adapter_ready)
        self.speculator = None
        if self.config.speculative is not None:  # a draft model's pool mirrors space 0's
            self.speculator = Speculator(
                self.config.speculative, model, blocks[0], self.config.block_size
            )
        context = model.config.max_position_embeddings
        self.context_len = min(self.config.max_model_len or context, context)
        # The longest sequence: within the context, and its K/V (all but the last token,
        # which is never fed back) within the pool of space 0, unless that space keeps only
        # windows and holds the most blocks one sequence needs there.
        size, step_tokens = self.config.block_size, self.config.max_num_batched_tokens
        self.pool_tokens = blocks[0] * size
        if windows[0] is not None and blocks[0] >= window_space_blocks(
            windows[0], size, 1, step_tokens, self.config.num_speculative_tokens
        ):
            self.pool_tokens = context
        self.max_len = min(self.context_len, self.pool_tokens + 1)
        # The model's and tokenizer's EOS ids, unless the caller names its own (token-id
        # front-ends without a tokenizer: `qinfer.engine.generation.generate_ids`).
        if eos_token_ids is None:
            eos_token_ids = model_eos_ids(model.config, tokenizer)
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, Request] = {}
        # LoRA adapters, once the first loads (`load_lora`): none, and nothing changes
        self.adapters: Adapters | None = None
        for name, path in (self.config.lora_modules or {}).items():
            self.load_lora(name, path)
        self._throughput = ThroughputMeter()
        self._counts = dict.fromkeys(
            ["prompt", "prompt_computed", "generated", "finished", "aborted", "images_encoded"],
            0,
        )
        self._encoder_seconds = 0.0

    def _disk_cache(self) -> DiskCache | None:
        """The prefix cache's disk tier, if prompt_cache_dir asks for one and every block
        of this engine is one file's worth of K/V (else one log line says why not)."""
        config, executor = self.config, self.executor
        if config.prompt_cache_dir is None:
            return None
        why = None
        if not config.enable_prefix_caching:
            why = "prefix caching is off"
        elif executor.parallel.tensor > 1:
            why = "tensor parallelism (each rank holds part of every block)"
        elif any(window is not None for window in executor.spaces.windows):
            why = "sliding-window layers (their blocks are released before a prompt ends)"
        elif config.speculative is not None and config.speculative.method == "draft":
            why = "a draft model (its K/V are not kept on disk)"
        if why is not None:
            log.warning("prompt cache on disk is off for this engine: %s", why)
            return None
        fingerprint = model_fingerprint(self.model, config.block_size)
        runner = executor.runner
        return DiskCache(
            config.prompt_cache_dir,
            config.prompt_cache_size,
            fingerprint,
            runner.pools,
            runner.states,
        )

    # -- requests -------------------------------------------------------------------------

    def make_request(
        self,
        prompt: Prompt,
        params: SamplingParams | PoolingParams | ScoreParams | None = None,
        request_id: str | None = None,
        lora: str | None = None,
    ) -> Request:
        """Check and encode a request without touching the engine's state (thread-safe).

        lora: the name of a loaded LoRA adapter (`load_lora`) the request runs through
        (None: the base model); an unknown name is refused (`AdapterError`).

        params: SamplingParams to generate; PoolingParams to pool the prompt's hidden
        states into one vector instead (`qinfer.request.pooling`; the output's `embedding`);
        ScoreParams to score the prompt by two tokens' logits at its last row
        (`qinfer.request.scoring`; the output's `score`)."""
        params = self.default_params if params is None else params
        sampling = check_task_params(params, self.model.config)
        adapter = None
        if lora is not None:
            if self.adapters is None:
                raise AdapterError(f"LoRA adapter {lora!r} is not loaded (loaded: none)")
            adapter = self.adapters.get(lora)
        request_id = uuid.uuid4().hex if request_id is None else request_id
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id must be a non-empty string, got {request_id!r}")
        # The model runs these ids unchecked (`sequence.scheduled_step`): they are checked here.
        try:
            parts = encode_prompt_parts(
                self.tokenizer, prompt, vocab_size=self.model.config.vocab_size
            )
        except QinferError as error:
            raise RequestError(str(error)) from None
        ids, images = parts.token_ids, None
        if parts.images:
            if self.executor.parallel.tensor > 1:
                raise RequestError(
                    "images need tensor_parallel_size 1: the workers take no image embeddings",
                    "image",
                )
            ids, images = prompt_images(parts, self.vision)
        if len(ids) >= self.max_len:
            of_images = "" if images is None else f" ({images.num_image_tokens} for its images)"
            raise RequestError(
                f"prompt has {len(ids)} tokens{of_images}; this engine serves prompts of at most "
                f"{self.max_len - 1} (context {self.context_len} positions, KV pool "
                f"{self.pool_tokens} tokens)"
            )
        max_tokens = min(sampling.max_tokens, self.max_len - len(ids))
        task = make_task(params, len(ids), max_tokens)
        # A cache hit skips rows that prompt logprobs (and some poolings) need.
        seq = Sequence(
            request_id,
            ids,
            task.uses_prefix_cache and sampling.prompt_logprobs is None,
            images,
            adapter,
        )
        try:
            state = RequestState.create(
                seq.token_ids,
                sampling,
                max_tokens,
                self.eos_token_ids,
                self.tokenizer,
                self.model.device,
            )
        except QinferError as error:
            raise RequestError(str(error)) from None
        return Request(seq, prompt if isinstance(prompt, str) else None, state, task)

    def load_lora(self, name: str, path: str) -> None:
        """Load the LoRA adapter at `path` (a PEFT folder or a GGUF adapter file) under
        `name`, for requests from now on, resident at once (`qinfer.lora.Adapters`: at most
        config.max_loras resident, the least recently used one not in use evicted)."""
        if self.adapters is None:
            config = self.config
            self.adapters = Adapters(
                self.model, config.max_loras, config.max_lora_rank, config.lora_dtype
            )
        self.adapters.load(name, path, self._adapter_slots_in_use())

    def unload_lora(self, name: str) -> None:
        """Drop adapter `name`: refused while a request runs through it."""
        if self.adapters is None:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded (loaded: none)")
        key = self.adapters.get(name).key
        users = sum(
            request.seq.adapter is not None and request.seq.adapter.key == key
            for request in self.requests.values()
        )
        if users:
            raise AdapterError(
                f"LoRA adapter {name!r} is in use by {users} unfinished requests; "
                "unload it when they end"
            )
        self.adapters.unload(name)

    def _adapter_slots_in_use(self) -> set[int]:
        """The adapter slots unfinished requests run through (none may be evicted)."""
        return {
            request.seq.adapter_slot
            for request in self.requests.values()
            if request.seq.adapter_slot is not None
        }

    def _adapter_ready(self, seq: Sequence) -> bool:
        """Whether seq may run: no adapter, or its adapter resident in a slot (made so now,
        evicting the least recently used one no unfinished request holds); False while
        every slot is held (the scheduler keeps it waiting: `qinfer.lora.Adapters`)."""
        if seq.adapter is None or seq.adapter_slot is not None:
            return True
        try:
            seq.adapter_slot = self.adapters.acquire(seq.adapter, self._adapter_slots_in_use())
        except AdapterSlotsBusyError:
            return False
        return True

    def add(self, request: Request) -> None:
        """Queue a request made by `make_request` (its adapter is made resident when the
        scheduler admits it)."""
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
        """Write the blocks the disk tier still holds queued, stop its writer and the
        tensor-parallel workers, if any (idempotent)."""
        self._close()

    # -- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch through the model; outputs of the requests that moved or finished."""
        if self.speculator is not None:
            self._propose()
        seqs, num_new = self.scheduler.schedule()
        if not seqs:
            return []
        scheduled_requests = [self.requests[seq.request_id] for seq in seqs]
        # hidden_rows: the rows whose final-normed hidden states each task needs (None:
        # none); every row of a sampling sequence when an MTP head drafts from them
        drafts = self.speculator is not None and self.speculator.needs_hidden
        hidden_rows = [
            request.task.hidden_rows(request.seq.num_computed_tokens, n)
            or (list(range(n)) if drafts and request.task.samples else None)
            for request, n in zip(scheduled_requests, num_new, strict=True)
        ]
        firsts_run = [seq.num_computed_tokens for seq in seqs]  # each one's first position
        # how many rows of logits each sequence needs (`Request.num_logits`)
        num_logits = [
            request.num_logits(n) for request, n in zip(scheduled_requests, num_new, strict=True)
        ]
        self._encode_images(seqs, num_new)
        step = scheduled_step(
            seqs,
            num_new,
            num_logits,
            self.executor.spaces,
            self.config.block_size,
        )
        result = self.executor.execute(step, hidden_rows)
        _, spans = step.logits_rows()  # sequence b's rows of result.logits
        requests, firsts, outputs = [], [], []
        for request, n, span, rows in zip(
            scheduled_requests, num_new, spans, result.hidden, strict=True
        ):
            seq = request.seq
            request.task.take_hidden(seq.num_computed_tokens, rows)
            own = slice(span.start, span.stop)
            if request.prompt_logprobs is not None and span:
                request.prompt_logprobs.add(seq.num_computed_tokens, result.logits[own])
            prompt_left = max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
            self._counts["prompt_computed"] += min(n, prompt_left)
            self.scheduler.advance(seq, n - len(seq.proposed))  # a proposal counts once kept
            if seq.num_uncomputed_tokens == 0:
                if request.task.samples:  # its last rows: one, then one per proposed token
                    requests.append(request)
                    firsts.append(span.stop - 1 - len(seq.proposed))
                else:
                    outputs.append(self._prompt_ran(request, result.logits[own]))
        if requests:
            generated = self._sample(requests, firsts, result.logits)
            outputs += [request.output() for request in requests]
            self._throughput.add(generated)
            self._counts["generated"] += generated
        if drafts:  # the rows of the tokens now the sequences' own
            for seq, first, rows in zip(seqs, firsts_run, result.hidden, strict=True):
                self.speculator.took(seq, first, rows)
        return outputs

    def _encode_images(self, seqs: list[Sequence], num_new: list[int]) -> None:
        """Run the vision tower over the images of every sequence whose step reaches image
        tokens without embeddings (a first prefill, or a recompute after a preemption):
        one call for all of them, timed into the stats."""
        pending = [
            seq.images
            for seq, n in zip(seqs, num_new, strict=True)
            if seq.images is not None and seq.images.needs_encoding(seq.num_computed_tokens, n)
        ]
        if not pending:
            return
        start = time.perf_counter()
        encode_images(self.vision, pending)
        if self.model.device.type == "cuda":  # the tower's time, not its launches'
            torch.cuda.synchronize(self.model.device)
        self._encoder_seconds += time.perf_counter() - start
        self._counts["images_encoded"] += sum(len(images.spans) for images in pending)

    def _propose(self) -> None:
        """Let the speculator guess the next tokens of every decoding sequence (its prompt
        computed, one sampled token not yet), each within what its request may still
        generate."""
        decoding = []
        for seq in self.scheduler.running:
            request = self.requests[seq.request_id]
            if request.task.samples and seq.num_computed_tokens >= seq.num_prompt_tokens:
                state = request.state
                decoding.append((seq, state.max_tokens - state.num_generated_tokens))
        self.speculator.propose(decoding, self.block_manager)

    def _sample(self, requests: list[Request], firsts: list[int], logits: torch.Tensor) -> int:
        """Sample the next token of each request from its rows of logits (R, V), from row
        firsts[i] on: one row, or 1 + k for a sequence that ran k proposed tokens. Row j
        gives the distribution after the j-th proposal: its sample is accepted, and while
        it equals that proposal (exact rejection sampling for sampled rows) the next row's
        is too. Returns the number of tokens accepted.

        A request whose rows depend on its logits alone (`RequestState.rows_independent`:
        no penalties, no processors) has all its rows sampled in one call; the others row
        by row, each once the tokens before it are accepted (a grammar or a penalty must
        see them). Either way one batched `sample_next` call per round serves them all."""
        proposals = [request.seq.proposed for request in requests]
        kept = [0] * len(requests)
        next_row = dict.fromkeys(range(len(requests)), 0)  # the requests still sampling
        while next_row:
            picks = []  # (request, row) pairs of this round, each request's in order
            for i, j in next_row.items():
                last = len(proposals[i]) if requests[i].state.rows_independent else j
                picks += [(i, row) for row in range(j, last + 1)]
            guesses = [proposals[i][j] if j < len(proposals[i]) else None for i, j in picks]
            rows = [firsts[i] + j for i, j in picks]
            result = sample_next(
                _rows_of(logits, rows),
                [requests[i].state for i, _ in picks],
                guesses if any(g is not None for g in guesses) else None,
            )
            token_ids = result.token_ids.tolist()
            logprobs = [None] * len(picks) if result.logprobs is None else result.logprobs.tolist()
            going, stopped = {}, set()
            for r, (i, j) in enumerate(picks):
                if i in stopped:  # a row after one that ended this request's run
                    continue
                request = requests[i]
                self._accept(request, token_ids[r], logprobs[r], result.top_logprobs[r])
                if token_ids[r] == guesses[r] and not request.state.finished:
                    kept[i] += 1  # the proposal's K/V is its own
                    going[i] = j + 1
                else:
                    stopped.add(i)
                    going.pop(i, None)
            next_row = {i: j for i, j in going.items() if j <= len(proposals[i])}
        for request, proposed, n in zip(requests, proposals, kept, strict=True):
            if proposed:
                seq = request.seq
                if not seq.is_finished:  # (a finished one's blocks are freed)
                    seq.proposed = []
                    if n < len(proposed) and self.block_manager.state_slots:
                        # a hybrid model's state ran past the last accepted token: the next
                        # step sets it back to before the proposals and runs the n again
                        seq.state_rollback = True
                    else:
                        self.scheduler.advance(seq, n)
                self.speculator.verified(seq, len(proposed), n)
        return len(requests) + sum(kept)

    def _prompt_ran(self, request: Request, logits: torch.Tensor) -> RequestOutput:
        """Finish a request that does not sample, now that its prompt has run (logits: the
        (k, V) rows it asked for in this step) as its task says: a pooling request with
        its vector, a scoring one with its score, one with max_tokens 0 as "length"; its
        last output."""
        reason, request.results = request.task.prompt_ran(logits)
        self._finish(request, reason)
        return request.output()

    def _accept(self, request: Request, token_id: int, logprob: float | None, top) -> None:
        """Append a sampled token, extend the text, and finish the request if it is done."""
        if request.logprobs is not None:
            request.logprobs.append(TokenLogprob(token_id, logprob, dict(top or ())))
        state = request.state
        state.accept(token_id)
        if state.finished:
            # OpenAI's finish reasons: end-of-sequence is a "stop" like the others.
            self._finish(request, "stop" if state.finish_reason == "eos" else state.finish_reason)

    def _finish(self, request: Request, reason: str) -> None:
        if self.speculator is not None:
            self.speculator.finished(request.seq.request_id)
        request.finish_reason = reason
        request.state.finish(reason)  # releases its processors (a grammar's matcher)
        self.block_manager.save_to_disk(request.seq)
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
            kv_block_size=blocks.block_size,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
            prompt_tokens_total=self._counts["prompt"],
            prompt_tokens_computed_total=self._counts["prompt_computed"],
            prompt_tokens_from_disk_total=0
            if self.disk_cache is None
            else self.disk_cache.tokens_read,
            generation_tokens_total=self._counts["generated"],
            requests_finished_total=self._counts["finished"],
            requests_aborted_total=self._counts["aborted"],
            preemptions_total=self.scheduler.num_preempted,
            images_encoded_total=self._counts["images_encoded"],
            vision_encoder_seconds_total=self._encoder_seconds,
            generation_tokens_per_s=self._throughput.rate(),
            **self._speculation_stats(),
        )

    def _speculation_stats(self) -> dict[str, int]:
        if self.speculator is None:
            return {}
        counts = self.speculator.counts
        return {
            "spec_verifications_total": counts.verifications,
            "spec_proposed_tokens_total": counts.proposed,
            "spec_accepted_tokens_total": counts.accepted,
        }


def _close(executor: Executor, disk_cache: DiskCache | None) -> None:
    """What `Engine.close` (or the engine's collection) stops."""
    if disk_cache is not None:
        disk_cache.close()
    executor.close()


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows] (len(rows), V): a view when the rows follow each other (every decode
    step without proposals: no copy of B x V logits), else a gathered copy."""
    first = rows[0]
    if rows == list(range(first, first + len(rows))):
        return logits[first : first + len(rows)]
    return logits[torch.tensor(rows, device=logits.device)]
