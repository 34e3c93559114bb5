"""The real Gemma 3 270M GGUF (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors; sliding and
global layers with RoPE bases 10k and 1M; a 262k SentencePiece vocabulary) against
`transformers`' GGUF loader, which dequantizes the same file: config, logits, greedy text,
tokenizer and chat template. Each model is loaded once per module."""

from __future__ import annotations

import copy
from collections import Counter

import openai
import pytest
import torch
from checkpoints import int4_kind
from gguf import GGMLQuantizationType as Q
from gguf_files import (
    KL_OFFSETS,
    assert_greedy_follows,
    compare_greedy,
    gemma3_path,
    kl_to_reference,
    real_text_ids,
    reference_scorer,
)

import qinfer
from qinfer.cli import main
from qinfer.core.model_config import FULL_ATTENTION, SLIDING_ATTENTION
from qinfer.linear import DenseLinear, Int4BlockLinear, Int8BlockLinear
from qinfer.weights.gguf_file import read_gguf

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Grüße aus Köln! 東京は日本の首都です。 Привет 🙂",
]


@pytest.fixture(scope="module")
def gemma3():
    """(qinfer model, transformers model), both the file dequantized to fp32 on CPU."""
    from transformers import AutoModelForCausalLM

    path = gemma3_path()
    ours = qinfer.load_model(path, dtype="float32", device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    reference.generation_config.eos_token_id = None  # greedy for a fixed number of tokens
    reference.generation_config.pad_token_id = 0
    return ours, reference.eval()


@pytest.fixture(scope="module")
def tokenizers():
    """(ours, transformers') tokenizer of the file."""
    from transformers import AutoTokenizer

    path = gemma3_path()
    return qinfer.load_tokenizer(path), AutoTokenizer.from_pretrained(
        path.parent, gguf_file=path.name
    )


def test_the_file_holds_every_tensor_type_we_read():
    types = Counter(t.tensor_type for t in read_gguf(gemma3_path()).tensors)
    assert set(types) == {Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0, Q.F32}


def test_config_matches_transformers(gemma3):
    ours, reference = gemma3
    config, expected = ours.config, reference.config
    assert config.model_type == expected.model_type == "gemma3_text"
    assert config.layer_types == tuple(expected.layer_types)
    assert config.layer_types[4:6] == (SLIDING_ATTENTION, FULL_ATTENTION)
    assert config.sliding_window == expected.sliding_window == 512
    assert config.rope.theta == expected.rope_parameters[FULL_ATTENTION]["rope_theta"] == 1e6
    sliding_rope = config.wiring.sliding_rope
    assert sliding_rope.theta == expected.rope_parameters[SLIDING_ATTENTION]["rope_theta"]
    assert config.attention_scale == expected.query_pre_attn_scalar**-0.5
    assert (config.head_dim, config.num_key_value_heads) == (expected.head_dim, 1)
    assert config.rms_norm_eps == expected.rms_norm_eps
    assert config.tie_word_embeddings and expected.tie_word_embeddings
    assert config.wiring.hidden_act == expected.hidden_activation
    # <eos> and, as llama.cpp finds it by its text, <end_of_turn>
    assert config.eos_token_id == (1, 106)


def test_norms_are_not_shifted_twice(gemma3):
    """llama.cpp writes Gemma's norm scales as 1 + w; the loaded weights are w again."""
    ours, reference = gemma3
    expected = reference.model.layers[0].input_layernorm.weight.detach()
    assert torch.equal(ours.layers[0].attention_norm.weight, expected + 1)


def test_logits_match_transformers(gemma3, tokenizers):
    ours, reference = gemma3
    _, tokenizer = tokenizers
    for prompt in PROMPTS:
        tokens = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            expected = reference(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=0, atol=1e-4)


def test_greedy_tokens_match_transformers(gemma3, tokenizers):
    ours, reference = gemma3
    tokenizer, _ = tokenizers
    ids = tokenizer.encode(PROMPTS[0])
    steps = 32
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)
    params = qinfer.SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    out = qinfer.generate(ours, tokenizer, PROMPTS[0], params)
    assert out.token_ids == expected[0, len(ids) :].tolist()
    assert out.text.startswith(" the capital of the country of France. It is the largest city")


TEXTS = [
    "Hello, world! How are you today?",
    "def add(a, b):\n    return a + b  # sum\n\n\nclass X:\n\tpass\n",
    "日本語のテキストと中文，还有한국어. Привет, как дела? ¿Qué tal? مرحبا हिन्दी",
    "emoji 🤖🎉👍🏽 flags 🇫🇷 and a family 👨‍👩‍👧‍👦 done",
    "   leading, inner    runs and trailing spaces   ",
    "tabs\tand\r\nwindows newlines\n\n\n",
    "numbers 12345, 3.14159 and 2024-01-01; 1,000,000",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // https://example.com/?q=1&x=2",
    "ünïcödé Ωμέγα ™ ﬁ \u00a0nbsp",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_encodes_and_decodes_like_transformers(tokenizers, text):
    ours, reference = tokenizers
    for special in (True, False):
        ids = reference.encode(text, add_special_tokens=special)
        assert ours.encode(text, add_special_tokens=special) == ids
        for skip in (True, False):
            expected = reference.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == expected


# The chat template of Google's Gemma 3 instruction-tuned checkpoints (their
# tokenizer_config.json). This 270M base file carries none, and neither tokenizer invents one.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  What is the capital of France?  "},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": [{"type": "text", "text": "And of Japan? 🗾"}]},
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(tokenizers, add_generation_prompt):
    ours, reference = tokenizers
    assert not ours.has_chat_template and reference.chat_template is None  # none in the file
    ours, reference = copy.copy(ours), copy.copy(reference)
    ours.chat_template = reference.chat_template = GEMMA3_CHAT_TEMPLATE
    options = dict(add_generation_prompt=add_generation_prompt, tokenize=False)
    text = ours.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt)
    assert text == reference.apply_chat_template(CHAT, **options)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(
        text, add_special_tokens=False
    )


def test_cli_generate_continues_a_prompt_the_file_has_no_template_for(capsys):
    args = ["generate", "--model", str(gemma3_path()), "--dtype", "float32", "--device", "cpu"]
    args += ["--max-tokens", "8", "--temperature", "0", "The capital of France is"]
    assert main(args) == 0
    assert capsys.readouterr().out.startswith(" the capital of the country of France.")


def test_qinfer_serve_completes_on_it_and_refuses_chat_in_one_line(serve):
    """The real `openai` client against `qinfer serve` on the file (its default load: kept
    blocks, bf16): a greedy completion continues the prompt; the file has no chat template,
    so a chat request is a 400 that says so, and the server keeps serving."""
    url = serve("--model", str(gemma3_path()), timeout=180).url
    name = "gemma-3-270m-q4_k_m"  # the file's name, by default
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    reply = client.completions.create(
        model=name, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert reply.choices[0].text.startswith(" the capital of the country of France")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    assert "chat template" in refused.value.message
    assert client.completions.create(model=name, prompt="Hi", max_tokens=2).choices


def test_kept_blocks_keep_their_bits_and_greedy_parts_only_at_near_ties(gemma3, tokenizers):
    """The default load: Q4_K as int4 groups, the Q8_0 embedding (and tied head) and the
    Q5_0 and Q6_K projections as int8 blocks, their values exactly (the projections times
    int8 activations, the head times fp32 ones; bf16 activations on torch's kernels where
    qinfer's cannot be built); its greedy tokens follow the fp32 model but at
    near-ties its error explains."""
    reference, _ = gemma3
    tokenizer, _ = tokenizers
    fast = qinfer.load_model(gemma3_path(), device="cpu")
    assert fast.dtype == (torch.float32 if int4_kind() is Int4BlockLinear else torch.bfloat16)
    assert isinstance(fast.lm_head, Int8BlockLinear) and fast.lm_head is fast.embed_tokens
    assert isinstance(fast.layers[0].self_attn.wo, int4_kind())  # blk.0.attn_output is Q4_K
    assert isinstance(fast.layers[0].mlp.gate_up, Int8BlockLinear)  # blk.0.ffn_gate/up: Q5_0
    assert fast.layers[1].mlp.down.scales.shape[1] == 2048 // 16  # blk.1.ffn_down: Q6_K
    assert not any(isinstance(w, DenseLinear) for w in fast.linears().values())
    comparisons = [compare_greedy(fast, reference, tokenizer.encode(p)) for p in PROMPTS]
    # On the AVX512-BF16 development machine: 2 of 3 prompts, top-1 92/96 (real text: 92.9%
    # top-1 in the KL test below, as llama.cpp's own).
    assert_greedy_follows(comparisons, min_top1=0.9)


#: llama.cpp 0.3.36's own drift on the same file and text, by where the windows start
#: (`gguf_files.KL_OFFSETS`), from `python bench/kl_divergence.py --model <this file>
#: --kv-cache --quantize [--offset 300]` (tests/real_text.txt, 3 windows of 512; AMD EPYC,
#: AVX512-BF16, 2026-12-04): mean KL(fp32 reference || llama.cpp) and top-1 agreement.
#: qinfer's default path measured 0.00740 with a bf16 residual stream (2026-12-01); 0.00689
#: with it and the top logits in fp32; 0.00043 with the Q5_0, Q6_K and Q8_0 tensors kept in
#: their int8 blocks instead of re-rounded to one scale per row (2026-12-03); 0.00005 (top-1
#: 99.61%; from token 300 0.00011, 99.35%) with the Q4_K groups exact too and fp32
#: activations (2026-12-04), now `exact=True`. The default path, int8 activations per block of
#: 32 on the Q4_K groups (the int8 blocks still exact), measured 0.00067 (top-1 98.30%; from
#: token 300 0.00099, 97.91%) on the AVX512-VNNI/AMX Xeon (2026-12-05); with the int8 blocks
#: on int8 activations too (`kernels.int8_mm`, the head's kept exact) 0.00290 (top-1 96.34%;
#: from token 300 0.00467, 96.08%), same machine and day. Bounds: the default path 0.75x llama.cpp's, `exact` half of it (`KL_SHARE`).
LLAMA_CPP = {0: (0.00788, 0.9294), 300: (0.01220, 0.9216)}
#: The share of llama.cpp's KL each mode may drift: {exact: share}.
KL_SHARE = {False: 0.75, True: 0.5}


@pytest.fixture(scope="module")
def float32_log_probs(gemma3):
    """The fp32 dequantization's (the `gemma3` fixture's) log-probs of each KL window,
    computed once for the module's KL tests."""
    return reference_scorer(gemma3[0])


def kl_to_float32(float32_log_probs, tokenizers, offset: int, **load):
    """`perplexity` of the file loaded with `load` against the fp32 dequantization, on the
    real-text windows from token `offset`."""
    tokenizer, _ = tokenizers
    fast = qinfer.load_model(gemma3_path(), device="cpu", **load)
    return kl_to_reference(fast, real_text_ids(tokenizer, offset), float32_log_probs)


@pytest.mark.parametrize("exact", [False, True], ids=["int8_activations", "exact"])
@pytest.mark.parametrize("offset", KL_OFFSETS)
def test_default_path_drifts_from_float32_less_than_llama_cpp(
    float32_log_probs, tokenizers, offset, exact
):
    """The default load (Q4_K as int4 groups, Q5_0, Q6_K and Q8_0 as int8 blocks, the
    projections times int8 activations, the head times fp32 ones; `exact`: fp32 activations
    throughout) against the exact fp32
    dequantization on real text from the start and from mid-document, as llama-perplexity
    measures it: no more than 0.75x llama.cpp's own KL on the same file and windows
    (`exact`: half), and top-1 agreement above llama.cpp's."""
    result = kl_to_float32(float32_log_probs, tokenizers, offset, exact=exact)
    kl, top1 = LLAMA_CPP[offset]
    assert result.kl <= kl * KL_SHARE[exact], result
    assert result.top1 >= top1, result


#: The same runs with `--kv-cache`: llama.cpp with flash attention and its q8_0 K and V
#: cache (blocks of 32, an fp16 scale each; 0.00826 and 94.51% with its f16 cache from the
#: start). qinfer's default path with an int8 KV cache measured 0.01820 and 89.93% with one
#: scale per token and 256-wide head, 0.00807 and 92.68% with one per block of 32
#: (2026-12-03), 0.00156 and 97.26% with the int8 blocks of the weights kept too, 0.00113
#: and 97.91% (from token 300 0.00247, 96.47%) with every weight exact and fp32 activations
#: (2026-12-04), now `exact=True`; the fp32 reference with an int8 KV cache alone 0.00110.
#: Bounds as the default path's (`KL_SHARE`).
LLAMA_CPP_Q8_KV = {0: (0.01029, 0.9242), 300: (0.01393, 0.9229)}


@pytest.mark.parametrize("exact", [False, True], ids=["int8_activations", "exact"])
@pytest.mark.parametrize("offset", KL_OFFSETS)
def test_int8_kv_cache_drifts_from_float32_no_further_than_llama_cpp_q8_0(
    float32_log_probs, tokenizers, offset, exact
):
    """The default load with an int8 KV cache against the exact fp32 dequantization, on
    real text from the start and from mid-document: no more than 0.75x llama.cpp's KL with
    its q8_0 cache (`exact`: half), and top-1 agreement above llama.cpp's."""
    result = kl_to_float32(
        float32_log_probs, tokenizers, offset, kv_cache_dtype="int8", exact=exact
    )
    kl, top1 = LLAMA_CPP_Q8_KV[offset]
    assert result.kl <= kl * KL_SHARE[exact], result
    assert result.top1 >= top1, result


def test_quantize_int4_takes_only_the_wider_blocks_to_int4():
    """`quantize="int4"`: the Q5_0, Q6_K and Q8_0 projections become int4 groups from their
    exact values, the Q4_K ones keep their bits (as the default load has them), the Q8_0
    embedding and tied head keep their int8 blocks (a lookup table takes int8 under
    `Quantize`)."""
    fast = qinfer.load_model(gemma3_path(), device="cpu", quantize="int4")
    default = qinfer.load_model(gemma3_path(), device="cpu")
    assert isinstance(fast.lm_head, Int8BlockLinear) and fast.lm_head is fast.embed_tokens
    assert isinstance(fast.layers[0].mlp.gate_up, int4_kind())  # Q5_0 in the file
    assert isinstance(fast.layers[0].self_attn.wqkv, int4_kind())  # Q5_0
    kept, q4_k = fast.layers[0].self_attn.wo, default.layers[0].self_attn.wo
    assert torch.equal(kept.dequantize(), q4_k.dequantize())


#: The same runs with `--quantize`: llama.cpp's own requantization of the file to Q4_0
#: (llama-quantize --allow-requantize, the tied head kept at Q6_K). qinfer's `--quantize
#: int4` measured 0.35754 and 62.09% (from token 300 0.41461, 63.27%): Gemma 3 270M loses much
#: at 4 bits in either engine.
LLAMA_CPP_Q4_0 = {0: (0.65625, 0.5360), 300: (0.94603, 0.4732)}


@pytest.mark.parametrize("offset", KL_OFFSETS)
def test_quantize_int4_drifts_from_float32_no_further_than_llama_cpp_q4_0(
    float32_log_probs, tokenizers, offset
):
    """`quantize="int4"` on real text from the start and from mid-document drifts from fp32
    no further than llama.cpp's own Q4_0 requantization of the file, with top-1 agreement
    at least its."""
    result = kl_to_float32(float32_log_probs, tokenizers, offset, quantize="int4")
    kl, top1 = LLAMA_CPP_Q4_0[offset]
    assert result.kl <= kl, result
    assert result.top1 >= top1, result
