"""Quantized KV caches (`qinfer.attention.kv_quant`, `Features.kv_cache_dtype`): the round trip's
error, cache invariance and paged == reference within the quantized path, batched ==
alone, and the pool's size in blocks and in concurrent sequences.

The quality cost on real text (KL against the fp32 reference) is measured with the real
files: tests/test_quantize.py (SmolLM2) and tests/test_gemma3_gguf.py (Gemma 3).
"""

import httpx
import pytest
import torch
from checkpoints import max_diff, random_tokens, tiny_config

import qinfer
from qinfer.attention.block_spaces import BlockSpaces
from qinfer.attention.kv_pool import KVPool
from qinfer.attention.kv_quant import KVFormat, kv_format
from qinfer.core.errors import QinferError
from qinfer.core.features import Features
from qinfer.engine import LLM
from qinfer.engine.config import EngineConfig
from qinfer.engine.sequence import Sequence, scheduled_step
from qinfer.request.sampling import SamplingParams
from qinfer.runtime.config import RuntimeConfig
from qinfer.runtime.executor import Executor
from qinfer.runtime.runner import kv_pool_blocks

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow

INT8, FP8 = kv_format("int8", torch.float32), kv_format("fp8", torch.float32)


def vectors(seed: int = 0, head_dim: int = 64) -> torch.Tensor:
    """(64, 3, head_dim) K-like vectors: of magnitudes from 1e-3 to 1e3, one outlier per row."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 3, head_dim, generator=generator)
    x = x * torch.logspace(-3, 3, 64)[:, None, None]
    x[:, :, 5] *= 8  # an outlier channel, as keys have
    return x


def test_int8_round_trip_is_within_half_a_step_of_each_block():
    x = vectors()
    data, scales = INT8.quantize(x)
    assert data.dtype == torch.int8 and scales.shape == (64, 3, 2) and scales.dtype == torch.float16
    blocks = data.view(64, 3, 2, 32)
    assert torch.equal(blocks.abs().amax(-1), torch.full((64, 3, 2), 127, dtype=torch.int8))
    error = (INT8.dequantize(data, scales, torch.float32) - x).view(64, 3, 2, 32).abs()
    # half an int8 step of each block of 32 (of its fp16 scale, within 2^-11 of the fp32
    # one): the outlier in block 0 leaves block 1's alone
    step = x.view(64, 3, 2, 32).abs().amax(-1, keepdim=True) / 127
    assert (error <= step * (0.5 + 2**-11)).all()
    one_scale = KVFormat(torch.int8, 127.0, block=64)  # one scale per vector, as before
    coarse = (one_scale.round_trip(x) - x).view(64, 3, 2, 32)[:, :, 1].abs()
    assert error[:, :, 1].mean() < coarse.mean() / 2


def test_a_head_dim_that_32_does_not_divide_takes_one_scale_per_vector():
    x = vectors(head_dim=80)
    data, scales = INT8.quantize(x)
    assert scales.shape == (64, 3, 1) and INT8.element_bytes(80) == 80 + 2
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((INT8.dequantize(data, scales, torch.float32) - x).abs() <= step * (0.5 + 2**-11)).all()


def test_fp8_round_trip_keeps_three_mantissa_bits():
    x = vectors()
    data, scales = FP8.quantize(x)
    assert data.dtype == torch.float8_e4m3fn
    error = (FP8.round_trip(x) - x).abs().view(64, 3, 2, 32)
    # e4m3: relative error 2^-4 for normal values; below 2^-6 * scale, absolute 2^-10 * scale
    bound = x.abs().view(64, 3, 2, 32) / 16 + scales[..., None] * 2**-10 * (1 + 1e-5)
    assert (error <= bound).all()


def test_a_zero_vector_stays_zero_and_unquantized_formats_only_cast():
    x = torch.zeros(2, 3, 8)
    assert torch.equal(INT8.round_trip(x), x) and torch.equal(FP8.round_trip(x), x)
    y = vectors()
    assert torch.equal(kv_format("bf16", torch.float32).round_trip(y), y.bfloat16().float())
    assert kv_format("auto", torch.bfloat16) == KVFormat(torch.bfloat16)


def test_bad_kv_cache_dtype_is_named():
    message = "unknown kv_cache_dtype 'int4'; use one of auto, bf16, int8, fp8"
    with pytest.raises(QinferError, match=message):
        Features(kv_cache_dtype="int4")
    with pytest.raises(QinferError, match=message):
        LLM(random_model(), kv_cache_dtype="int4")
    with pytest.raises(QinferError, match="kv_cache_dtype 'int8' is chosen when a model loads"):
        LLM(random_model(), kv_cache_dtype="int8")


def test_bytes_per_block_count_the_quantized_elements_and_their_scales():
    config = tiny_config("qwen3", head_dim=64)  # 2 layers, 2 KV heads
    assert KVPool.bytes_per_block(config, 16, torch.bfloat16) == 2 * 2 * 2 * 128 * 16
    assert KVPool.bytes_per_block(config, 16, INT8) == 2 * 2 * 2 * (64 + 2 * 2) * 16
    assert KVPool.bytes_per_block(config, 16, FP8) == 2 * 2 * 2 * (64 + 2 * 2) * 16
    pool = KVPool(config, 3, 16, INT8, "cpu")
    assert pool.keys.dtype == torch.int8 and pool.key_scales.shape == (2, 2, 48, 2)
    assert pool.layers[1].value_scales.data_ptr() == pool.value_scales[1].data_ptr()


# ------------------------------------------------------------- caches in a quantized format

FAMILIES = {  # a window-free GQA model, one with a sliding window shorter than the text
    "qwen3": ("qwen3", dict(head_dim=32)),
    "mistral-window": ("mistral", dict(sliding_window=6)),
}


def random_model(family: str = "qwen3", kv_cache_dtype: str = "auto", dtype=torch.float32):
    name, overrides = FAMILIES[family]
    features = Features(kv_cache_dtype=kv_cache_dtype)
    return qinfer.Transformer.random(
        tiny_config(name, **overrides), seed=3, dtype=dtype, features=features
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_reference_caches_give_one_forward_of_the_whole_sequence_in_pieces(family, kv_cache_dtype):
    """Prefill 12 then decode 8 through a quantized cache == one forward of the 20 (whose
    queries read the same stored K/V); and the quantization is really there."""
    model = random_model(family, kv_cache_dtype)
    tokens = random_tokens(1, 20)
    whole = model(tokens)
    cache = model.make_cache(1)
    assert cache[0].keys is None  # made at the first step
    pieces = [model(tokens[:, :12], cache=cache)]
    pieces += [model(tokens[:, i : i + 1], cache=cache) for i in range(12, 20)]
    assert cache[0].keys.dtype == kv_format(kv_cache_dtype, torch.float32).dtype
    assert max_diff(torch.cat(pieces, dim=1), whole) < 1e-5
    exact = max_diff(whole, random_model(family)(tokens))
    assert 1e-4 < exact < 0.05, exact


def engine_tokens(
    model, prompts: list[list[int]], decode: int, backend: str = "auto"
) -> list[list[int]]:
    """`decode` greedy tokens of each prompt through the engine's paged pool, the prompts
    run together (prefilled in chunks, beside the others' decode tokens)."""
    params = SamplingParams(temperature=0, max_tokens=decode, ignore_eos=True)
    llm = LLM(
        model, max_num_batched_tokens=32, max_num_seqs=8, block_size=4, attention_backend=backend
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [output.token_ids for output in outputs]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("backend", ["paged", "gathered"])
def test_paged_pool_follows_the_reference_caches_in_int8(family, backend):
    """Greedy tokens of the engine (paged int8 pool: chunked prefill, decode groups of
    different histories) == those of the reference int8 caches, step by step; batched ==
    alone; through each attention backend."""
    model = random_model(family, "int8")
    prompts = [random_tokens(1, n, seed=40 + n)[0].tolist() for n in (5, 13, 22)]
    batched = engine_tokens(model, prompts, 10, backend)
    alone = [engine_tokens(model, [ids], 10, backend)[0] for ids in prompts]
    assert batched == alone
    for ids, got in zip(prompts, batched, strict=True):
        cache = model.make_cache(1)
        logits = model(torch.tensor([ids]), cache=cache)[0, -1]
        want = []
        for _ in range(len(got)):
            want.append(int(logits.argmax()))
            logits = model(torch.tensor([[want[-1]]]), cache=cache)[0, -1]
        assert got == want


@pytest.mark.parametrize("backend", ["paged", "gathered"])
def test_paged_logits_equal_the_reference_caches_in_int8_and_fp8(backend):
    """Mixed steps over a quantized pool: each sequence's logits == its reference-cache
    logits (the same K/V stored, read back on the other path), through each backend."""
    for kv_cache_dtype in ("int8", "fp8"):
        model = random_model("mistral-window", kv_cache_dtype)
        config = RuntimeConfig(block_size=4, num_kv_blocks=32, attention_backend=backend)
        executor = Executor(model, config)
        prompts = [random_tokens(1, n, seed=60 + n)[0].tolist() for n in (9, 17)]
        seqs = [Sequence(str(b), ids) for b, ids in enumerate(prompts)]
        free = iter(range(executor.num_blocks[0]))
        for seq in seqs:  # every block kept (a window space's step reads its window's)
            seq.tables[0] = [next(free) for _ in range(-(-(len(seq.token_ids) + 3) // 4))]
        spaces = executor.spaces
        logits = executor.execute(scheduled_step(seqs, [9, 17], [1, 1], spaces, 4)).logits
        want = [model(torch.tensor([ids]))[0, -1] for ids in prompts]
        assert max_diff(logits[0], want[0]) < 1e-4 and max_diff(logits[1], want[1]) < 1e-4
        for seq in seqs:
            seq.num_computed_tokens = len(seq.token_ids)
            seq.token_ids.append(7)
        logits = executor.execute(scheduled_step(seqs, [1, 1], [1, 1], spaces, 4)).logits
        for row, ids in enumerate(prompts):
            want = model(torch.tensor([ids + [7]]))[0, -1]
            assert max_diff(logits[row], want) < 1e-4, kv_cache_dtype


# ------------------------------------------------------------- the pool's size


def test_the_same_budget_holds_about_twice_the_blocks_and_sequences_in_int8():
    """A bf16 model's pool of 8 blocks' worth of bytes: 15 int8 blocks (D = 64: 68 bytes per
    token and head, two fp16 scales included, against 128: llama.cpp's q8_0), and as many one-block sequences
    running at once."""
    config = tiny_config("qwen3", head_dim=64)
    budget = 8 * KVPool.bytes_per_block(config, 16, torch.bfloat16)
    running = {}
    for kv_cache_dtype in ("auto", "int8"):
        model = qinfer.Transformer.random(
            config, dtype=torch.bfloat16, features=Features(kv_cache_dtype=kv_cache_dtype)
        )
        engine_config = EngineConfig(kv_cache_memory=budget, block_size=16)
        (blocks,) = kv_pool_blocks(model, engine_config.runtime, BlockSpaces.of(model.config))
        llm = LLM(model, kv_cache_memory=budget, block_size=16, enable_prefix_caching=False)
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        engine = llm.engine
        for b in range(20):  # 12 prompt + 3 new tokens: one block each
            engine.add_request(random_tokens(1, 12, seed=b)[0].tolist(), params)
        peak = 0
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, engine.stats().num_running)
        running[kv_cache_dtype] = (blocks, peak)
    assert running == {"auto": (8, 8), "int8": (15, 15)}


def test_the_server_serves_with_an_int8_cache_what_llm_gives(tmp_path, serve):
    """`qinfer serve --kv-cache-dtype int8` answers what `LLM(kv_cache_dtype="int8")` does
    on the same checkpoint, and its pool holds the quantized blocks (more than bf16's)."""
    from checkpoints import build_chat_checkpoint
    from servers import metric_values

    build_chat_checkpoint(tmp_path, "qwen3")
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_dtype="int8")
    params = SamplingParams(temperature=0.0, max_tokens=12)
    expected = llm.generate(["Hello there"], params, use_tqdm=False)[0].text
    url = serve(
        *("--model", str(tmp_path), "--dtype", "float32", "--served-model-name", "m"),
        *("--kv-cache-dtype", "int8"),
    ).url
    body = {"model": "m", "prompt": "Hello there", "max_tokens": 12, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    with httpx.Client(base_url=url) as http:
        blocks = metric_values(http)["qinfer_kv_blocks_total"]
    assert reply["choices"][0]["text"] == expected
    assert blocks == llm.engine.block_manager.num_blocks
