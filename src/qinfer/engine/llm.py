"""The offline API: many prompts in, their completions out, batched by the engine.

llm = LLM("path/to/checkpoint", max_num_seqs=16)
outputs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
for delta in llm.stream("Hello"): print(delta, end="")   # one prompt, as text deltas
vectors = llm.embed(["a query", "a document"])              # pooled hidden states
scores = llm.score("a query", ["a document", "another"])    # a reranker's P(yes) each
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from qinfer.core.errors import RequestError
from qinfer.engine.build import LoadConfig, build_engine
from qinfer.engine.engine import Engine
from qinfer.engine.outputs import RequestOutput
from qinfer.engine.run import TextStream, run_requests
from qinfer.model.transformer import Transformer
from qinfer.request.pooling import PoolingMethod, PoolingParams
from qinfer.request.sampling import SamplingParams
from qinfer.request.scoring import reranker_params, reranker_prompt
from qinfer.text.prompts import Prompt, is_batch
from qinfer.text.tokenizer import Tokenizer
from qinfer.vision.language_model import VisionLanguageModel


class LLM:
    """A model with a batching engine, for offline generation.

    model_or_path: a loaded `Transformer` (a `VisionLanguageModel` for prompts with
        images), or a checkpoint (folder or .gguf) to load, a vision-language one with its
        vision tower (a GGUF text model's is llama.cpp's projector file, `mmproj`).
    tokenizer: a `Tokenizer` or its path; by default the checkpoint's (without one, prompts
        must be token ids).
    load: how a checkpoint loads (`qinfer.engine.build.LoadConfig`); its fields (dtype,
        device, quantize, group_size, kv_cache_dtype, batch_invariant, exact,
        tensor_parallel_size, mmproj) may be given as keywords instead. `close()` or this process's exit stops
        tensor-parallel workers.
    The other keywords: `qinfer.engine.EngineConfig`'s (lora_modules, max_loras,
    max_lora_rank and lora_dtype among them: LoRA adapters).
    """

    def __init__(
        self,
        model_or_path: Transformer | VisionLanguageModel | str | Path,
        tokenizer: Tokenizer | str | Path | None = None,
        *,
        load: LoadConfig | None = None,
        **keywords,
    ) -> None:
        load, engine_args = LoadConfig.split(keywords, load)
        self.engine: Engine = build_engine(model_or_path, tokenizer, load, engine_args)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (text, token ids, chat messages, whose content parts may
        hold images, or an `ImagePrompt`; or a list of them); the outputs come back in the
        prompts' order. params: one for all, or one each. lora: the loaded LoRA adapter
        (`lora_modules`, `load_lora`) for all, or one each (None: the base model)."""
        if isinstance(prompts, (list, tuple)) and not prompts:
            raise RequestError("prompts is empty: give at least one prompt")
        prompts = list(prompts) if is_batch(prompts) else [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif len(params) != len(prompts):
            raise RequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if lora is None or isinstance(lora, str):
            lora = [lora] * len(prompts)
        elif len(lora) != len(prompts):
            raise RequestError(f"got {len(lora)} lora names for {len(prompts)} prompts")
        outputs = self._run(prompts, params, use_tqdm, list(lora))
        return [_whole(output) for output in outputs]

    def load_lora(self, name: str, path: str | Path) -> None:
        """Load the LoRA adapter at `path` (a PEFT folder) under `name`."""
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Drop the LoRA adapter `name`."""
        self.engine.unload_lora(name)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: PoolingMethod = "last",
        normalize: bool = True,
        dimensions: int | None = None,
        use_tqdm: bool = False,
    ) -> list[list[float]]:
        """One vector per prompt (text or token ids, or a list of them), in the prompts'
        order, as a list of floats: the final-normed hidden states of the prompt pooled by
        `pooling` ("last": the last token's, as Qwen3-Embedding; "mean"; "cls": the first
        token's), cut to its first `dimensions` numbers (Matryoshka) when given, then
        L2-normalised when `normalize`. Batched through the engine with any other requests
        (see `qinfer.request.pooling`, which also says how the prefix cache is used)."""
        params = PoolingParams(pooling, normalize, dimensions)
        if isinstance(prompts, (list, tuple)) and not prompts:
            raise RequestError("prompts is empty: give at least one prompt")
        prompts = list(prompts) if is_batch(prompts) else [prompts]
        outputs = self._run(prompts, [params] * len(prompts), use_tqdm)
        return [output.embedding.tolist() for output in outputs]

    def score(
        self,
        query: str,
        documents: str | Sequence[str],
        instruction: str | None = None,
        use_tqdm: bool = False,
    ) -> list[float]:
        """How well each document meets `query`, in the documents' order: a reranker's
        P(yes) in [0, 1] (Qwen3-Reranker's prompt and yes/no logits, see `qinfer.request.scoring`;
        instruction: the task, by default web search). Batched through the engine."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise RequestError("scoring needs a tokenizer; this LLM has none")
        documents = [documents] if isinstance(documents, str) else list(documents)
        if not documents:
            raise RequestError("documents is empty: give at least one document")
        for name, text in [("query", query), *(("documents", d) for d in documents)]:
            if not isinstance(text, str):
                raise RequestError(f"{name} must hold text, got {type(text).__name__}")
        params = reranker_params(tokenizer)
        prompts = [reranker_prompt(tokenizer, query, d, instruction) for d in documents]
        outputs = self._run(prompts, [params] * len(prompts), use_tqdm)
        return [output.score for output in outputs]

    def _run(
        self, prompts: list[Prompt], params: list, use_tqdm: bool, loras: list | None = None
    ) -> list[RequestOutput]:
        """Run every (prompt, params[, lora]) request to its end; their last outputs, in
        order."""
        engine = self.engine
        loras = loras or [None] * len(prompts)
        # Check every prompt before queueing any, so a bad one leaves the engine untouched.
        requests = [
            engine.make_request(p, sp, lora=lora)
            for p, sp, lora in zip(prompts, params, loras, strict=True)
        ]
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(requests), desc="requests", disable=not use_tqdm) as bar:
            for output in run_requests(engine, requests):
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
        return [finished[r.seq.request_id] for r in requests]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, lora: str | None = None
    ) -> TextStream:
        """One prompt as a stream of text deltas, as `qinfer.stream_generate` gives it. The
        prompt is checked here; the engine runs as the stream is read. lora: the loaded
        LoRA adapter it runs through (None: the base model)."""
        return TextStream(self.engine, self.engine.make_request(prompt, params, lora=lora))

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        self.engine.close()


def _whole(output: RequestOutput) -> RequestOutput:
    """The final output with its deltas covering the whole completion."""
    return replace(output, delta_text=output.text, delta_token_ids=output.token_ids)
