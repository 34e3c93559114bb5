"""GGUF checkpoints: dequantization against the `gguf` package, config and tensor mapping
against `transformers`, and the embedded SmolLM2 file end to end (logits and greedy text)."""

import gguf
import numpy as np
import pytest
import torch
from checkpoints import YARN_ROPE, build_checkpoint, llama3_rope
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf_files import (
    describe_model,
    smollm2_path,
    synthetic_tensor,
    write_gguf,
    write_gguf_model,
)

import qinfer
from qinfer.core.errors import ConfigError, WeightsError
from qinfer.weights.gguf import GGUFWeights, open_gguf
from qinfer.weights.gguf_quants import SUPPORTED_TYPES, dequantize

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """One torch thread for this module: on a machine whose cores are shared by parallel
    test runs, torch's thread pool oversubscribed runs the SmolLM2 tests ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- dequantization


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_reference_on_synthetic_tensors(qtype):
    data = synthetic_tensor(qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(data, qtype))
    ours = dequantize(data, qtype)
    assert ours.dtype == torch.float32 and ours.shape == (6, 512)
    assert torch.equal(ours, reference)


def test_dequantize_equals_gguf_reference_on_every_smollm2_tensor_type(smollm2_reader):
    first_of_type = {}
    for tensor in smollm2_reader.tensors:
        first_of_type.setdefault(tensor.tensor_type, tensor)
    assert {Q.Q4_1, Q.Q8_0, Q.F32} <= set(first_of_type)
    for qtype, tensor in first_of_type.items():
        reference = torch.from_numpy(gguf.quants.dequantize(np.array(tensor.data), qtype))
        assert torch.equal(dequantize(tensor.data, qtype), reference), tensor.name


# ---------------------------------------------------- random models written as GGUF

FAMILIES = {
    "llama": ("llama", dict(tie_word_embeddings=False)),
    "llama-head-dim": ("llama", dict(head_dim=32, num_key_value_heads=1)),
    "llama3-rope-freqs": ("llama", llama3_rope(8192)),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-yarn": ("qwen2", YARN_ROPE),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),
    # llama.cpp's Gemma 3 rules: every sixth layer global, the sliding layers' RoPE base 10k,
    # attention scaled by 1/sqrt(head_dim); scaling (linear here) on the global layers only.
    "gemma3-windows": (
        "gemma3",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            num_hidden_layers=7,
            sliding_window=4,
            rope_parameters={
                "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                "sliding_attention": dict(rope_type="default", rope_theta=1e4),
            },
        ),
    ),
}


@pytest.mark.parametrize("case", FAMILIES)
def test_gguf_of_a_random_model_gives_transformers_logits(tmp_path, case):
    arch, overrides = FAMILIES[case]
    reference = build_checkpoint(tmp_path / "hf", arch, **overrides)
    path = write_gguf_model(reference, tmp_path / "model.gguf", arch)
    model = qinfer.load_model(path, device="cpu")
    tokens = torch.tensor([[3, 17, 42, 99, 5, 200, 7, 64, 1, 250]])
    with torch.no_grad():
        expected = reference(tokens).logits
    torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)


def test_gguf_loads_in_float32_unless_asked(tmp_path):
    reference = build_checkpoint(tmp_path / "hf", "qwen3")
    path = write_gguf_model(reference, tmp_path / "model.gguf", "qwen3")
    assert qinfer.load_model(path, device="cpu").dtype == torch.float32
    assert qinfer.load_model(path, dtype="bfloat16", device="cpu").dtype == torch.bfloat16


def test_tensors_are_dequantized_only_when_asked(tmp_path, monkeypatch):
    reference = build_checkpoint(tmp_path / "hf", "qwen3")
    path = write_gguf_model(reference, tmp_path / "model.gguf", "qwen3")
    read = []
    original = GGUFWeights._read
    monkeypatch.setattr(
        GGUFWeights, "_read", lambda self, n, *part: read.append(n) or original(self, n, *part)
    )
    _, weights = open_gguf(
        path, lambda config, quantized, exact: torch.float32, torch.device("cpu")
    )
    assert read == []
    weights.tensor("model.layers.1.mlp.up_proj.weight")
    assert read == ["model.layers.1.mlp.up_proj.weight"]


# ----------------------------------------------------------------------- errors


def tiny_llama_description(writer):
    """The metadata of a one-layer llama (hidden 32, 2 heads of 16)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    describe_model(config, "llama")(writer)


def test_end_of_turn_tokens_join_the_eos_ids(tmp_path):
    def describe(writer):
        tiny_llama_description(writer)  # eos 2
        writer.add_eot_token_id(5)  # Llama 3 Instruct's <|eot_id|> is stored like this
        writer.add_eom_token_id(6)

    path = write_gguf(tmp_path / "eot.gguf", "llama", {}, describe)
    config, _ = open_gguf(path, lambda config, quantized, exact: torch.float32, torch.device("cpu"))
    assert config.eos_token_id == (2, 5, 6)


def test_unsupported_quant_type_names_the_tensor_and_type(tmp_path):
    block_size, type_size = GGML_QUANT_SIZES[Q.IQ4_NL]
    weights = np.zeros((32, 32 // block_size * type_size), np.uint8)  # a (32, 32) IQ4_NL tensor
    path = write_gguf(
        tmp_path / "iq4.gguf",
        "llama",
        {"blk.0.attn_q.weight": weights},
        tiny_llama_description,
        raw_types={"blk.0.attn_q.weight": Q.IQ4_NL},
    )
    with pytest.raises(WeightsError, match=r"'blk\.0\.attn_q\.weight'.*IQ4_NL"):
        qinfer.load_model(path, device="cpu")


def test_unsupported_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "gemma.gguf", "gemma2", {"token_embd.weight": np.ones((4, 4))})
    with pytest.raises(ConfigError, match=r"architecture 'gemma2'.*llama, qwen2, qwen3"):
        qinfer.load_model(path, device="cpu")


def test_missing_metadata_names_the_key(tmp_path):
    path = write_gguf(tmp_path / "bare.gguf", "qwen3", {"token_embd.weight": np.ones((4, 4))})
    with pytest.raises(ConfigError, match=r"qwen3\.\w+.* is missing"):
        qinfer.load_model(path, device="cpu")


def test_rope_freqs_of_an_unknown_scaling_are_refused(tmp_path):
    freqs = np.linspace(1, 3, 8, dtype=np.float32)  # head_dim 16 -> 8 frequencies
    path = write_gguf(
        tmp_path / "freqs.gguf", "llama", {"rope_freqs.weight": freqs}, tiny_llama_description
    )
    with pytest.raises(ConfigError, match="rope_freqs.weight"):
        qinfer.load_model(path, device="cpu")


@pytest.mark.parametrize("content", [b"not a gguf file at all" * 10, b""], ids=["garbage", "empty"])
def test_a_file_that_is_not_gguf_is_named(tmp_path, content):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(WeightsError, match=r"broken\.gguf is not a readable GGUF file"):
        qinfer.load_model(path, device="cpu")


def test_a_truncated_gguf_is_named(tmp_path):
    path = tmp_path / "truncated.gguf"
    path.write_bytes(smollm2_path().read_bytes()[:1_000_000])
    with pytest.raises(WeightsError, match=r"truncated\.gguf"):
        qinfer.load_model(path, device="cpu")


# ------------------------------------------------------- the embedded SmolLM2 file


@pytest.fixture(scope="module")
def smollm2(smollm2_hf_tokenizer):
    """(qinfer model, transformers model, transformers tokenizer), all fp32 on CPU: the file
    dequantized to fp32 (dtype float32), the reference path."""
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    ours = qinfer.load_model(path, dtype="float32", device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    reference.generation_config.eos_token_id = None  # greedy for a fixed number of tokens
    reference.generation_config.pad_token_id = 0
    return ours, reference.eval(), smollm2_hf_tokenizer


def test_smollm2_config_matches_transformers(smollm2):
    ours, reference, _ = smollm2
    config, expected = ours.config, reference.config
    assert (config.model_type, config.vocab_size, config.hidden_size) == (
        expected.model_type,
        expected.vocab_size,
        expected.hidden_size,
    )
    assert config.num_hidden_layers == expected.num_hidden_layers
    assert config.num_attention_heads == expected.num_attention_heads
    assert config.num_key_value_heads == expected.num_key_value_heads
    assert config.head_dim == expected.head_dim
    assert config.rms_norm_eps == expected.rms_norm_eps
    assert config.rope.theta == expected.rope_parameters["rope_theta"]
    assert config.max_position_embeddings == expected.max_position_embeddings
    assert config.tie_word_embeddings == expected.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_id) == (expected.bos_token_id, (2,))


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]


def test_smollm2_logits_match_transformers(smollm2):
    ours, reference, tokenizer = smollm2
    for prompt in PROMPTS:
        tokens = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            expected = reference(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=0, atol=1e-4)


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding with the KV cache: prefill the prompt, then one token per step."""
    cache = model.make_cache()
    logits = model(torch.tensor([prompt]), cache=cache, last_only=True)
    generated = []
    for _ in range(steps):
        generated.append(int(logits[0, -1].argmax()))
        logits = model(torch.tensor([generated[-1:]]), cache=cache)
    return generated


CHATS = [
    [{"role": "user", "content": "What is the tallest mountain in the world?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.mark.parametrize(
    "prompt", [*PROMPTS[:2], *CHATS], ids=["plain-capital", "plain-code", "chat-fact", "chat-haiku"]
)
def test_smollm2_greedy_generation_matches_transformers(smollm2, prompt):
    ours, reference, tokenizer = smollm2
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
    steps = 32
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)[
            0, len(ids) :
        ].tolist()
    assert greedy(ours, ids, steps) == expected


def test_the_parsed_header_holds_the_vocabulary_compact_with_the_readers_values():
    """The cached header keeps `tokenizer.ggml.*` arrays compact (`StringArray`, `array`):
    the same strings and numbers as gguf's reader gives, indexed, sliced and iterated as a
    list is; every other field as the reader gives it."""
    from array import array

    from qinfer.weights.gguf_file import StringArray, read_gguf

    path = smollm2_path()
    meta = read_gguf(path).metadata
    fields = gguf.GGUFReader(path).fields
    tokens = meta["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringArray) and isinstance(meta["tokenizer.ggml.token_type"], array)
    expected = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == len(expected) == 49152
    assert list(tokens) == expected and tokens == expected
    assert (
        tokens[0] == expected[0] and tokens[-1] == expected[-1] and tokens[7:12] == expected[7:12]
    )
    with pytest.raises(IndexError):
        tokens[49152]
    assert list(meta["tokenizer.ggml.merges"]) == fields["tokenizer.ggml.merges"].contents()
    assert list(meta["tokenizer.ggml.token_type"]) == fields["tokenizer.ggml.token_type"].contents()
    assert meta["general.architecture"] == fields["general.architecture"].contents() == "llama"
