"""`qinfer.analysis.inspection` and `POST /v1/inspect`: the attention weights are the seed's own
(causal distributions, equal to a direct call of `scaled_dot_product_attention_grouped`,
and to transformers' eager attention), the next-token and logit-lens probabilities are the
model's and transformers' (its hidden states through the final norm and lm_head), and an
inspection through the server changes no other request's result."""

from __future__ import annotations

import concurrent.futures

import httpx
import numpy as np
import pytest
import torch
from checkpoints import random_tokens, use_features
from servers import serving

from qinfer.analysis.inspection import MAX_INSPECT_TOKENS, MAX_TOP_K, inspect_tokens
from qinfer.attention.reference import ReferenceAttention
from qinfer.attention.sdpa import scaled_dot_product_attention_grouped, sdpa_for
from qinfer.core.errors import RequestError
from qinfer.core.features import Features
from qinfer.core.forward_batch import ForwardBatch
from qinfer.model.loading import load_model
from qinfer.text.tokenizer import load_tokenizer

LENGTH = 20  # past the windows of the windowed families (6 and 8 tokens)


@pytest.fixture(scope="module")
def pair(windowed_pair):
    """(transformers model, qinfer model computing attention by the reference path)."""
    reference, model = windowed_pair
    use_features(model, Features(fast_sdpa=False))
    return reference, model


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return random_tokens(1, LENGTH)[0].tolist()


def all_layers(model) -> list[int]:
    return list(range(model.config.num_hidden_layers))


def test_attention_rows_are_causal_distributions(pair, tokens):
    _, model = pair
    seen = inspect_tokens(model, tokens, all_layers(model))
    for weights in seen.attention.values():  # (Hq, L, L)
        assert weights.shape == (model.config.num_attention_heads, LENGTH, LENGTH)
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:2]))
        assert (weights.triu(diagonal=1) == 0).all()


class Recording:
    """A layer's attention function that keeps what the layer handed it, then attends as
    the model's own (`ReferenceAttention`'s per-layer hook)."""

    def __init__(self, sdpa):
        self.sdpa = sdpa

    def __call__(self, q, keys, values, scale, mask):
        self.inputs = (q, keys, values, scale, mask)
        return self.sdpa(q, keys, values, scale, mask)


def test_attention_equals_a_direct_call_of_the_seed_function(pair, tokens):
    _, model = pair
    seen = inspect_tokens(model, tokens, all_layers(model))
    # The same forward with attention functions that record each layer's inputs.
    sdpa = sdpa_for(model.features)
    recorders = {layer: Recording(sdpa) for layer in all_layers(model)}
    caches = model.make_cache(1, max_length=LENGTH)
    attention = ReferenceAttention(caches, 1, LENGTH, "causal", sdpa, recorders)
    model.forward(ForwardBatch.from_rows(torch.tensor([tokens]), 0, attention))
    for layer, recorder in recorders.items():
        q, keys, values, scale, mask = recorder.inputs
        S = keys.shape[2]
        # With the values an identity, the seed's function returns its attention weights.
        identity = torch.eye(S).expand(1, keys.shape[1], S, S)
        direct = scaled_dot_product_attention_grouped(q, keys, identity, scale, mask)[0]
        torch.testing.assert_close(seen.attention[layer], direct, atol=1e-6, rtol=0)
        # ... and those weights, applied to the values, give the layer's attention output.
        out = scaled_dot_product_attention_grouped(q, keys, values, scale, mask)[0]
        H, L, D = out.shape
        grouped = values[0].repeat_interleave(H // values.shape[1], dim=0)  # (Hq, S, D)
        torch.testing.assert_close(seen.attention[layer] @ grouped, out, atol=1e-5, rtol=0)


def test_attention_equals_transformers_eager_attention(pair, tokens):
    reference, model = pair
    seen = inspect_tokens(model, tokens, all_layers(model))
    reference.config._attn_implementation = "eager"
    with torch.no_grad():
        expected = reference(torch.tensor([tokens]), output_attentions=True).attentions
    for layer, weights in enumerate(expected):  # (1, Hq, L, L) each, sliding windows included
        torch.testing.assert_close(seen.attention[layer], weights[0], atol=1e-5, rtol=0)


def test_next_tokens_and_logit_lens_match_transformers(pair, tokens):
    reference, model = pair
    k = 4
    seen = inspect_tokens(model, tokens, [0], top_k=k)
    with torch.no_grad():
        out = reference(torch.tensor([tokens]), output_hidden_states=True)
    probs, ids = torch.softmax(out.logits[0].float(), -1).topk(k, -1)
    torch.testing.assert_close(seen.next_tokens.probs, probs, atol=1e-5, rtol=0)
    assert torch.equal(seen.next_tokens.ids, ids)
    # hidden_states[i + 1] is the residual after layer i (the last one already normed).
    for layer, hidden in enumerate(out.hidden_states[1:-1]):
        with torch.no_grad():
            logits = reference.lm_head(reference.model.norm(hidden))[0]
        cap = getattr(reference.config, "final_logit_softcapping", None)
        if cap is not None:  # the model's head squashes every layer's logits alike
            logits = torch.tanh(logits / cap) * cap
        probs = torch.softmax(logits.float(), -1).topk(k, -1).values
        torch.testing.assert_close(seen.logit_lens[layer].probs, probs, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "asked, param",
    [
        (dict(layers=[99]), "layers"),
        (dict(layers=[-1]), "layers"),
        (dict(heads=[4]), "heads"),
        (dict(heads=[]), "heads"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=MAX_TOP_K + 1), "top_k"),
    ],
)
def test_bad_inspections_name_their_field(pair, tokens, asked, param):
    _, model = pair
    with pytest.raises(RequestError) as refused:
        inspect_tokens(model, tokens, **asked)
    assert refused.value.param == param and str(refused.value).startswith(param)


def test_a_prompt_past_the_cap_is_refused(pair):
    _, model = pair
    with pytest.raises(RequestError, match=f"1 to {MAX_INSPECT_TOKENS}") as refused:
        inspect_tokens(model, [1] * (MAX_INSPECT_TOKENS + 1))
    assert refused.value.param == "prompt"


@pytest.mark.parametrize("bad_id", [-1, 256])
def test_a_token_id_outside_the_vocabulary_is_refused(pair, bad_id):
    _, model = pair
    assert model.config.vocab_size == 256
    with pytest.raises(RequestError, match=f"^prompt: token id {bad_id} is outside") as refused:
        inspect_tokens(model, [1, bad_id])
    assert refused.value.param == "prompt"


# --- through the server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(qwen3_chat_folder):
    with (
        serving("--model", str(qwen3_chat_folder), "--dtype", "float32") as running,
        httpx.Client(base_url=running.url, timeout=120) as client,
    ):
        yield client


def test_served_inspection_equals_the_direct_one(server, qwen3_chat_folder):
    model = load_model(qwen3_chat_folder, dtype="float32")
    tokenizer = load_tokenizer(qwen3_chat_folder)
    messages = [{"role": "user", "content": "Where is the lighthouse?"}]
    body = server.post("/v1/inspect", json={"prompt": messages, "layers": [1], "top_k": 3}).json()
    ids = [token["id"] for token in body["tokens"]]
    assert ids == tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True),
        add_special_tokens=False,
    )
    seen = inspect_tokens(model, ids, [1], top_k=3)
    assert body["attention"][0]["layer"] == 1
    torch.testing.assert_close(
        torch.tensor(body["attention"][0]["weights"]), seen.attention[1], atol=1e-6, rtol=0
    )
    assert [[c["id"] for c in row] for row in body["next_tokens"]] == seen.next_tokens.ids.tolist()
    assert len(body["logit_lens"]) == model.config.num_hidden_layers


@pytest.mark.parametrize(
    "asked, param",
    [
        (dict(layers=[2]), "layers"),
        (dict(heads=[16]), "heads"),
        (dict(top_k=MAX_TOP_K + 1), "top_k"),
        (dict(prompt="a" * (MAX_INSPECT_TOKENS + 1)), "prompt"),
        (dict(layers="0"), "layers"),
    ],
)
def test_bad_inspect_requests_are_400s_naming_the_field(server, asked, param):
    response = server.post("/v1/inspect", json={"prompt": "Hello", **asked})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert server.get("/health").status_code == 200


def test_an_unknown_inspect_field_is_ignored(server):
    """As on every request model (server/schema.py): ignored and logged once, not a 400."""
    response = server.post("/v1/inspect", json={"prompt": "Hello", "lookahead": 1})
    assert response.status_code == 200, response.text


def test_inspections_do_not_change_other_requests(server):
    body = {"prompt": "The lighthouse keeper", "max_tokens": 48, "temperature": 0}
    alone = server.post("/v1/completions", json=body).json()["choices"][0]["text"]
    inspect = {"prompt": "Once upon a time " * 8, "layers": [0, 1]}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        completions = [pool.submit(server.post, "/v1/completions", json=body) for _ in range(2)]
        inspections = [pool.submit(server.post, "/v1/inspect", json=inspect) for _ in range(4)]
        assert all(future.result().status_code == 200 for future in inspections)
        texts = [future.result().json()["choices"][0]["text"] for future in completions]
    assert texts == [alone, alone]
    assert server.post("/v1/completions", json=body).json()["choices"][0]["text"] == alone


# --- qinfer inspect ---------------------------------------------------------------------


def test_inspect_command_writes_the_heatmap_png(qwen3_chat_folder, tmp_path, capsys):
    from PIL import Image

    from qinfer.analysis.heatmap import BACKGROUND, MASKED, colours, layout, token_label
    from qinfer.cli import main

    out = tmp_path / "attn.png"
    args = ["--model", str(qwen3_chat_folder), "--dtype", "float32", "--layer", "1"]
    assert main(["inspect", "Hello there", *args, "--head", "3", "--out", str(out)]) == 0
    assert "next token after" in capsys.readouterr().out
    image = Image.open(out).convert("RGB")
    tokenizer = load_tokenizer(qwen3_chat_folder)
    ids = tokenizer.encode("Hello there")
    title = f"{qwen3_chat_folder.name}: layer 1, head 3"
    at = layout(len(ids), [token_label(tokenizer.decode([i])) for i in ids], title)
    assert image.size == (at.width, at.height)
    # The heatmap's bottom-right cell is the last query on itself; its top-right cell
    # (the first query, the last key) is masked.
    right, bottom = at.left + len(ids) * at.cell - 2, at.top + len(ids) * at.cell - 2
    model = load_model(qwen3_chat_folder, dtype="float32")
    last = inspect_tokens(model, ids, [1], [3]).attention[1][0, -1, -1].item()
    assert image.getpixel((right, bottom)) == tuple(colours(torch.tensor(last).numpy()))
    assert image.getpixel((right, at.top + 1)) == MASKED
    # The colour bar runs from weight 1 at the top of the grid to 0 at its bottom.
    assert image.getpixel((at.bar_left + 2, at.top)) == tuple(colours(np.float64(1.0)))
    assert image.getpixel((at.bar_left + 2, bottom + 1)) == tuple(colours(np.float64(0.0)))
    # The title and the row labels are drawn: text pixels where they go.
    title_band = image.crop((0, 0, at.width, at.top - at.left))
    row_labels = image.crop((0, at.top, at.left, bottom))
    for part in (title_band, row_labels):
        assert any(colour != BACKGROUND for _, colour in part.getcolors(4096))
    assert main(["inspect", "Hello", *args, "--head", "99"]) == 2
    assert "head 99 does not exist" in capsys.readouterr().err


def test_inspect_refuses_an_out_folder_that_does_not_exist_before_loading(tmp_path, capsys):
    from qinfer.cli import main

    out = tmp_path / "missing" / "attn.png"
    assert main(["inspect", "Hi", "--model", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "--out" in capsys.readouterr().err
