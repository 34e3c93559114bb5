"""Rerank and score: Qwen3-Reranker's yes/no judgement through the engine, `LLM.score`,
`POST /v1/rerank` and `POST /v1/score`.

Parity in fp32 against transformers computing the model card's yes/no softmax by hand on
a random Qwen3 whose vocabulary has "yes" and "no"; the same score alone, in chunks,
batched with decoding and on a prefix-cache hit; a server whose checkpoint's name makes
it a reranker (`--task` chosen from the checkpoint); hostile bodies; a smoke test on the
embedded SmolLM2 GGUF.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from checkpoints import build_checkpoint, build_tokenizer
from servers import serving, wait_until_idle

from qinfer import LLM
from qinfer.core.errors import RequestError
from qinfer.request.sampling import SamplingParams
from qinfer.request.scoring import reranker_params, reranker_prompt
from qinfer.server.app import checkpoint_task
from qinfer.server.vllm.scores import MAX_SCORED_DOCUMENTS

MODEL = "tiny-reranker"
QUERY = "What is the capital of China?"
DOCUMENTS = [
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other.",
    "no",
    "Beijing, yes: a city of many millions, and the capital of China since 1949.",
]
BLOCK = 4

# The model card's code, written out here as the reference (Qwen/Qwen3-Reranker-0.6B).
CARD_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CARD_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # Named like the real one: the server picks the rerank task from the name.
    folder = tmp_path_factory.mktemp("scores") / "Qwen3-Reranker-tiny"
    folder.mkdir()
    build_checkpoint(folder, "qwen3", vocab_size=264)
    build_tokenizer(folder, words=("yes", "no"))
    return folder


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    # 8 tokens a step: every reranker prompt is prefilled in many chunks; blocks of 4 let
    # the prompts after the first start from the cached blocks of their shared prefix.
    return LLM(
        str(checkpoint),
        dtype="float32",
        device="cpu",
        max_num_seqs=4,
        max_num_batched_tokens=8,
        block_size=BLOCK,
    )


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' tokenizer and fp32 model, as the model card loads them."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return tokenizer, model.eval()


def card_scores(reference, query: str, documents: list[str], instruction=None) -> list[float]:
    """The model card's computation: prefix + pair + suffix ids, the last logits, the
    log-softmax over [no, yes], exp of yes."""
    tokenizer, model = reference
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    scores = []
    for document in documents:
        pair = (
            f"<Instruct>: {instruction or CARD_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}"
        )
        ids = [t for part in (CARD_PREFIX, pair, CARD_SUFFIX) for t in tokenizer.encode(part)]
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1]
        pair_logits = torch.stack([last[no], last[yes]])
        scores.append(torch.log_softmax(pair_logits, dim=0)[1].exp().item())
    return scores


def test_scores_match_the_model_cards_yes_no_softmax(llm, reference):
    got = llm.score(QUERY, DOCUMENTS)
    expected = card_scores(reference, QUERY, DOCUMENTS)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-6, rtol=0)
    assert max(expected) - min(expected) > 1e-3  # the documents' scores differ
    # The prompts share their prefix: the later ones started from cached blocks.
    assert llm.engine.stats().prefix_cache_hits > 0


def test_instruction_changes_the_prompt_and_matches_the_card(llm, reference):
    instruction = "Find the passage that names a city"
    got = llm.score(QUERY, DOCUMENTS[:2], instruction=instruction)
    expected = card_scores(reference, QUERY, DOCUMENTS[:2], instruction)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-6, rtol=0)


def test_reranker_prompt_is_the_cards(llm, reference):
    tokenizer = llm.engine.tokenizer
    pair = f"<Instruct>: {CARD_INSTRUCTION}\n<Query>: {QUERY}\n<Document>: {DOCUMENTS[0]}"
    expected = reference[0].encode(CARD_PREFIX + pair + CARD_SUFFIX)
    assert reranker_prompt(tokenizer, QUERY, DOCUMENTS[0]) == expected


def test_a_score_is_the_same_batched_with_decoding_requests(llm):
    alone = llm.score(QUERY, DOCUMENTS)
    tokenizer = llm.engine.tokenizer
    params = reranker_params(tokenizer)
    decode = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = [llm.engine.make_request(p, decode) for p in ("Once upon a time", "Hello there")]
    requests += [
        llm.engine.make_request(reranker_prompt(tokenizer, QUERY, d), params) for d in DOCUMENTS
    ]
    from qinfer.engine.run import run_requests

    finished = {o.request_id: o for o in run_requests(llm.engine, requests) if o.finished}
    outputs = [finished[r.seq.request_id] for r in requests]
    assert [o.num_generated_tokens for o in outputs[:2]] == [12, 12]
    for output, score in zip(outputs[2:], alone, strict=True):
        assert output.token_ids == [] and output.finish_reason == "stop"
        assert output.score == pytest.approx(score, abs=1e-6)


@pytest.mark.parametrize(
    ("documents", "message"),
    [([], "documents is empty"), ([1], "documents must hold text"), ("x", None)],
)
def test_llm_score_checks_its_documents(llm, documents, message):
    if message is None:
        assert len(llm.score(QUERY, documents)) == 1  # one text is one document
    else:
        with pytest.raises(RequestError, match=message):
            llm.score(QUERY, documents)


def test_a_model_without_yes_and_no_cannot_score(tmp_path):
    build_checkpoint(tmp_path, "qwen3", vocab_size=264)
    build_tokenizer(tmp_path)
    plain = LLM(str(tmp_path), dtype="float32", device="cpu", max_num_seqs=4)
    with pytest.raises(RequestError, match="no 'yes' or 'no' token"):
        plain.score(QUERY, DOCUMENTS)


def test_checkpoint_task_reads_the_name(tmp_path):
    assert checkpoint_task(tmp_path / "Qwen3-Reranker-0.6B") == "rerank"
    snapshot = tmp_path / "models--Qwen--Qwen3-Embedding-0.6B" / "snapshots" / "0123abc"
    assert checkpoint_task(snapshot) == "embed"
    assert checkpoint_task(tmp_path / "embedding0") == "generate"  # a word of the name only
    assert checkpoint_task(tmp_path / "SmolLM2-135M-Instruct-Q8_0.gguf") == "generate"


# -- the server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http(checkpoint):
    with (
        serving(
            *("--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "float32"),
            *("--device", "cpu", "--block-size", str(BLOCK)),
        ) as server,
        httpx.Client(base_url=server.url, timeout=120) as client,
    ):
        yield client


def test_rerank_orders_documents_best_first_with_top_n(http, llm):
    expected = llm.score(QUERY, DOCUMENTS)
    body = {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 3}
    response = http.post("/v1/rerank", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])[:3]
    assert [r["index"] for r in answer["results"]] == order
    for result in answer["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-6)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    prompts = [reranker_prompt(llm.engine.tokenizer, QUERY, d) for d in DOCUMENTS]
    assert answer["usage"]["total_tokens"] == sum(len(p) for p in prompts)
    assert answer["model"] == MODEL


def test_rerank_without_documents_in_the_results(http):
    body = {"query": QUERY, "documents": DOCUMENTS[:2], "return_documents": False}
    results = http.post("/v1/rerank", json=body).json()["results"]
    assert len(results) == 2 and all("document" not in r for r in results)


def test_score_pairs_texts_and_broadcasts_one_query(http, llm):
    one_to_many = http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS[:2]})
    assert one_to_many.status_code == 200, one_to_many.text
    answer = one_to_many.json()
    expected = llm.score(QUERY, DOCUMENTS[:2])
    assert [d["index"] for d in answer["data"]] == [0, 1]
    assert [d["object"] for d in answer["data"]] == ["score", "score"]
    got = [d["score"] for d in answer["data"]]
    assert got == pytest.approx(expected, abs=1e-6)
    pairs = http.post("/v1/score", json={"text_1": ["a", QUERY], "text_2": ["b", DOCUMENTS[0]]})
    got = [d["score"] for d in pairs.json()["data"]]
    assert got == pytest.approx([llm.score("a", "b")[0], expected[0]], abs=1e-6)


def test_the_rerank_task_does_not_serve_generation(http):
    response = http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert response.status_code == 404
    assert "'rerank' task" in response.json()["error"]["message"]
    assert http.post("/v1/embeddings", json={"input": "hi"}).status_code == 404


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": QUERY}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": "one"}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a", 7]}, "documents.1"),
        ("/v1/rerank", {"query": 3, "documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
        (
            "/v1/rerank",
            {"query": QUERY, "documents": ["a"] * (MAX_SCORED_DOCUMENTS + 1)},
            "documents",
        ),
        ("/v1/rerank", {"query": QUERY, "documents": ["a", "x" * 100_000]}, "documents.1"),
        ("/v1/score", {"text_1": QUERY, "text_2": []}, "text_2"),
        ("/v1/score", {"text_1": [], "text_2": ["a"]}, "text_1"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/v1/score", {"text_1": {"a": 1}, "text_2": "b"}, "text_1"),
    ],
)
def test_hostile_score_requests_are_400_naming_the_field(http, route, body, param):
    response = http.post(route, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert wait_until_idle(http)["qinfer_kv_blocks_used"] == 0
    ok = http.post("/v1/score", json={"text_1": QUERY, "text_2": "b"})
    assert ok.status_code == 200


def test_unknown_model_is_404(http):
    response = http.post("/v1/rerank", json={"model": "nope", "query": QUERY, "documents": ["a"]})
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"


def test_smollm2_gguf_serves_rerank(serve):
    """The real embedded model through the endpoint (task generate serves it too): one
    score per document in [0, 1], the same alone and in a batch."""
    url = serve().url
    with httpx.Client(base_url=url, timeout=120) as client:
        query = "What is the capital of France?"
        documents = ["Paris is the capital of France.", "Bananas are yellow."]
        batch = client.post("/v1/rerank", json={"query": query, "documents": documents})
        alone = client.post("/v1/score", json={"text_1": query, "text_2": documents[1]})
    assert batch.status_code == 200, batch.text
    scores = {r["index"]: r["relevance_score"] for r in batch.json()["results"]}
    assert sorted(scores) == [0, 1] and all(0 <= s <= 1 for s in scores.values())
    assert alone.json()["data"][0]["score"] == pytest.approx(scores[1], abs=2e-3)
