"""Embeddings: pooling requests through the engine, `LLM.embed`, and `POST /v1/embeddings`.

Parity in fp32 against sentence-transformers (a random Qwen3 built like Qwen3-Embedding:
last-token pooling, normalised) and against transformers (mean and first-token pooling);
the same vector alone, batched with decoding requests, in chunks and on a prefix-cache
hit; the real `openai` client and LangChain's `OpenAIEmbeddings` against `qinfer serve`;
hostile bodies; a smoke test on the embedded SmolLM2 GGUF.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from checkpoints import build_chat_checkpoint
from gguf_files import smollm2_path
from langchain_openai import OpenAIEmbeddings
from servers import serving, wait_until_idle

from qinfer import LLM
from qinfer.engine.run import run_requests
from qinfer.request.pooling import PoolingParams
from qinfer.request.sampling import SamplingParams
from qinfer.server.app import served_name
from qinfer.server.openai.embeddings import MAX_EMBEDDING_INPUTS

MODEL = "tiny-embedding"
TEXTS = [
    "What is the capital of China?",
    "Explain gravity",
    "The capital of China is Beijing, a city of many millions.",
]
BLOCK = 4  # small blocks: a short prompt spans several, and can hit the prefix cache


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("embedding")
    build_chat_checkpoint(folder, "qwen3")
    return folder


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    # 8 tokens a step: every prompt of TEXTS is prefilled in several chunks.
    return LLM(
        str(checkpoint),
        dtype="float32",
        device="cpu",
        max_num_seqs=4,
        max_num_batched_tokens=8,
        block_size=BLOCK,
    )


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    import transformers

    return transformers.AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()


def encode(llm: LLM, text: str) -> list[int]:
    return llm.engine.tokenizer.encode(text)


def hidden_states(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' final-normed hidden states (L, hidden) of one unpadded prompt."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).last_hidden_state[0]


def test_last_token_pooling_matches_sentence_transformers(llm, checkpoint):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    # The plain text modality: with a chat template in the tokenizer, sentence-transformers
    # would otherwise wrap each text in a chat message (Qwen3-Embedding embeds raw text).
    transformer = models.Transformer(
        str(checkpoint),
        modality_config={"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
        module_output_name="token_embeddings",
    )
    reference = SentenceTransformer(
        modules=[
            transformer,
            models.Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken"),
            models.Normalize(),
        ],
        device="cpu",
    )
    expected = reference.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS))
    got = torch.tensor(llm.embed(TEXTS))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_mean_and_cls_pooling_match_transformers(llm, hf_model, pooling):
    ids = [encode(llm, text) for text in TEXTS]
    got = torch.tensor(llm.embed(ids, pooling=pooling, normalize=False))
    expected = [hidden_states(hf_model, p) for p in ids]
    expected = torch.stack([h.mean(0) if pooling == "mean" else h[0] for h in expected])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_dimensions_truncate_then_renormalise(llm, hf_model):
    ids = encode(llm, TEXTS[0])
    (got,) = llm.embed([ids], dimensions=16)
    expected = torch.nn.functional.normalize(hidden_states(hf_model, ids)[-1, :16], dim=0)
    assert len(got) == 16
    torch.testing.assert_close(torch.tensor(got), expected, atol=1e-5, rtol=1e-4)


def test_dimensions_larger_than_the_hidden_size_are_refused(llm):
    with pytest.raises(Exception, match="dimensions is 100000, larger than"):
        llm.embed("hi", dimensions=100000)


def run_together(llm: LLM, prompts_and_params) -> list:
    """Every (prompt, params) request in one engine run; their final outputs in order."""
    requests = [llm.engine.make_request(p, params) for p, params in prompts_and_params]
    finished = {o.request_id: o for o in run_requests(llm.engine, requests) if o.finished}
    return [finished[r.seq.request_id] for r in requests]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embedding_is_the_same_alone_and_batched_with_decoding_requests(llm, pooling):
    params = PoolingParams(pooling)
    alone = [torch.tensor(v) for v in llm.embed(TEXTS, pooling=pooling)]
    decode = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # Two decoding requests start first, so the embeddings' chunks share steps with them.
    outputs = run_together(
        llm,
        [("Once upon a time", decode), ("Hello there", decode)]
        + [(text, params) for text in TEXTS],
    )
    assert [o.num_generated_tokens for o in outputs[:2]] == [12, 12]
    for vector, output in zip(alone, outputs[2:], strict=True):
        assert output.token_ids == [] and output.finish_reason == "stop"
        torch.testing.assert_close(output.embedding, vector, atol=1e-5, rtol=1e-4)


def test_last_token_embedding_is_the_same_on_a_prefix_cache_hit(llm):
    params = PoolingParams("last")
    first, again = run_together(llm, [(TEXTS[2], params)]), run_together(llm, [(TEXTS[2], params)])
    assert again[0].num_cached_tokens >= BLOCK  # the second run started from cached blocks
    torch.testing.assert_close(again[0].embedding, first[0].embedding, atol=1e-5, rtol=1e-4)


def test_mean_pooling_does_not_start_from_the_prefix_cache(llm, hf_model):
    params = PoolingParams("mean", normalize=False)
    run_together(llm, [(TEXTS[2], SamplingParams(max_tokens=1))])  # caches the prompt's blocks
    (output,) = run_together(llm, [(TEXTS[2], params)])
    assert output.num_cached_tokens == 0
    expected = hidden_states(hf_model, encode(llm, TEXTS[2])).mean(0)
    torch.testing.assert_close(output.embedding, expected, atol=1e-5, rtol=1e-4)


# -- the server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(checkpoint):
    with serving(
        *("--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "float32"),
        *("--device", "cpu", "--block-size", str(BLOCK)),
    ) as server:
        yield server.url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=120) as client:
        yield client


def test_openai_client_gets_float_embeddings_with_usage(client, llm):
    response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    expected = llm.embed(TEXTS)
    assert [d.index for d in response.data] == [0, 1, 2]
    for data, vector in zip(response.data, expected, strict=True):
        np.testing.assert_allclose(data.embedding, vector, atol=1e-5)
    assert response.model == MODEL
    assert response.usage.prompt_tokens == sum(len(encode(llm, t)) for t in TEXTS)


def test_openai_client_gets_base64_embeddings_with_dimensions(client, llm):
    # Without encoding_format the client asks for base64 and decodes it itself; asked for
    # base64 explicitly, it hands the string back: little-endian float32 bytes.
    decoded = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=8)
    raw = client.embeddings.create(
        model=MODEL, input=[encode(llm, TEXTS[0])], encoding_format="base64", dimensions=8
    )
    expected = llm.embed(TEXTS[0], dimensions=8)[0]
    np.testing.assert_allclose(decoded.data[0].embedding, expected, atol=1e-5)
    vector = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
    np.testing.assert_allclose(vector, expected, atol=1e-5)


def test_token_id_inputs_equal_their_text(client, llm):
    ids = [encode(llm, t) for t in TEXTS[:2]]
    by_ids = client.embeddings.create(model=MODEL, input=ids).data
    one = client.embeddings.create(model=MODEL, input=ids[0]).data
    by_text = client.embeddings.create(model=MODEL, input=TEXTS[:2]).data
    np.testing.assert_allclose(by_ids[0].embedding, by_text[0].embedding, atol=1e-6)
    np.testing.assert_allclose(by_ids[1].embedding, by_text[1].embedding, atol=1e-6)
    np.testing.assert_allclose(one[0].embedding, by_text[0].embedding, atol=1e-6)


def test_langchain_openai_embeddings_against_the_server(server, llm):
    embeddings = OpenAIEmbeddings(
        model=MODEL,
        base_url=f"{server}/v1",
        api_key="none",
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    documents = embeddings.embed_documents(TEXTS[1:])
    query = embeddings.embed_query(TEXTS[0])
    expected = llm.embed(TEXTS)
    np.testing.assert_allclose(query, expected[0], atol=1e-5)
    np.testing.assert_allclose(documents, expected[1:], atol=1e-5)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input.0"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input.0"),
        ({"input": 42}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, "input"),
        ({"input": [[1, 2], [10**9]]}, "input.1"),
        ({"input": [-1]}, "input.0"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "dimensions": 100000}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_hostile_embedding_requests_are_400_naming_the_field(http, body, param):
    response = http.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    # The inputs queued before the one refused were stopped or finished: no block is held.
    assert wait_until_idle(http)["qinfer_kv_blocks_used"] == 0
    assert http.get("/health").status_code == 200


def test_unknown_model_is_refused_and_the_server_keeps_serving(http):
    response = http.post("/v1/embeddings", json={"input": "hi", "model": "nope"})
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"
    ok = http.post("/v1/embeddings", json={"input": "hi"})
    assert ok.status_code == 200


def test_chat_keeps_working_on_the_same_server(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )  # greedy: the chat defaults sample, and a sampled EOS could end the reply early
    assert reply.usage.completion_tokens == 4


def test_smollm2_gguf_serves_embeddings(serve):
    """The real embedded model through the endpoint: unit vectors of its hidden size, the
    same for a prompt alone and in a batch."""
    url = serve().url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    model = served_name(smollm2_path())
    texts = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Stock prices fell."]
    batch = [np.array(d.embedding) for d in client.embeddings.create(model=model, input=texts).data]
    alone = np.array(client.embeddings.create(model=model, input=texts[0]).data[0].embedding)
    assert batch[0].shape == (576,)
    np.testing.assert_allclose([np.linalg.norm(v) for v in batch], 1.0, atol=1e-4)
    np.testing.assert_allclose(alone, batch[0], atol=2e-3)


def test_a_preempted_pooling_request_starts_over_and_gets_the_same_vector(checkpoint, llm):
    # 16 blocks of 4 tokens: the decoding request and the embeddings' prompts do not all
    # fit, so the newest running sequences are preempted and computed again later.
    small = LLM(
        str(checkpoint),
        dtype="float32",
        device="cpu",
        max_num_seqs=4,
        max_num_batched_tokens=8,
        block_size=BLOCK,
        num_kv_blocks=16,
        enable_prefix_caching=False,
    )
    decode = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    pooled = [(text, PoolingParams(pooling)) for text in TEXTS[1:] for pooling in ("mean", "cls")]
    outputs = run_together(small, [("Once upon a time", decode), *pooled])
    assert small.engine.stats().preemptions_total > 0
    for output, (text, params) in zip(outputs[1:], pooled, strict=True):
        (expected,) = llm.embed(text, pooling=params.method)
        torch.testing.assert_close(output.embedding, torch.tensor(expected), atol=1e-5, rtol=1e-4)
