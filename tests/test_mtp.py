"""A Qwen3.5 checkpoint's MTP head as the speculative draft (`--speculative-method mtp`).

On a random Qwen3.5 checkpoint given random `mtp.*` tensors (tests/test_qwen3_5_gguf.py's
`add_mtp_head`), in float32:
- the head's logits at every position of a prompt equal a plain-torch reference of its
  formula (fc over the normed embedding and hidden state, transformers' own decoder layer,
  the norm, the shared head), fed transformers' final hidden states; the engine's first
  proposal is the reference's greedy chain (each guess on the head's own output);
- greedy tokens through `LLM.generate` are the same with the head proposing and without,
  for a batch of prompts in chunks and with a pool small enough to preempt; proposals are
  made and counted where /metrics reads them (random weights keep few: acceptance says
  nothing here); with its guesses replaced by mostly right ones, every decode step
  proposes, each after the hybrid state's rollback too, and the tokens are the same;
- llama.cpp's converter writes the head as nextn tensors: the GGUF file's head computes the
  folder's logits, and its greedy tokens are the same on and off;
- `qinfer generate --speculative-method mtp` prints the text it prints without, and
  `qinfer serve` with it answers the same and counts the proposals in /metrics;
- Qwen3.5-MoE's head (its layer's MLP the experts') drafts as the dense one;
- a head saved as `model.mtp.*` loads as `mtp.*`; a checkpoint without the head and a
  model loaded without it are one-line errors.
"""

import copy
import shutil

import httpx
import pytest
import torch
from checkpoints import (
    HYBRID,
    build_chat_checkpoint,
    build_checkpoint,
    random_tokens,
)
from safetensors.torch import load_file, save_file
from servers import metric_values, serving
from test_qwen3_5_gguf import add_mtp_head
from test_vl_gguf import convert

import qinfer
from qinfer.cli import main
from qinfer.core.errors import QinferError
from qinfer.engine import LLM
from qinfer.layers.moe import SparseMoE
from qinfer.request.sampling import SamplingParams
from qinfer.runtime.step import ScheduledStep

#: small blocks, chunks of 16 tokens
SMALL = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3}
pytestmark = pytest.mark.slow

PROMPTS = [random_tokens(1, n, seed=3 + i)[0].tolist() for i, n in enumerate([3, 21, 70])]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random Qwen3.5 checkpoint (with a tokenizer) with an MTP head, and transformers'
    model of it."""
    path = tmp_path_factory.mktemp("qwen3_5_mtp")
    reference = build_chat_checkpoint(path, "qwen3_5", **HYBRID["qwen3_5"])
    add_mtp_head(path)
    return path, reference


def load(path, **kwargs) -> qinfer.Transformer:
    return qinfer.load_model(path, dtype=torch.float32, device="cpu", mtp=True, **kwargs)


def greedy(model, ids, **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, **{**SMALL, **engine_args})
    return [out.token_ids for out in llm.generate(ids, GREEDY, use_tqdm=False)], llm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def reference_mtp(
    reference, tensors: dict, next_tokens: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head at positions 0 .. P - 1, position i reading next_tokens[i] (P,) (the token
    at i + 1) and h[i] (P, H) (the model's final-normed hidden state at i, or the head's
    own output there when chaining): (logits (P, V), the head's output g (P, H))."""
    eps = reference.config.rms_norm_eps
    with torch.no_grad():
        e = reference.model.embed_tokens(next_tokens)  # (P, H)
        x = torch.cat(
            [
                rms_norm(e, tensors["mtp.pre_fc_norm_embedding.weight"], eps),
                rms_norm(h, tensors["mtp.pre_fc_norm_hidden.weight"], eps),
            ],
            dim=-1,
        )
        x = (x @ tensors["mtp.fc.weight"].T)[None]  # (1, P, H)
        layer = copy.deepcopy(reference.model.layers[1])  # a full-attention layer's shape
        own = {k[13:]: v for k, v in tensors.items() if k.startswith("mtp.layers.0.")}
        layer.load_state_dict(own)
        positions = torch.arange(x.shape[1])[None]
        rotation = reference.model.rotary_emb(x, positions)
        P = x.shape[1]
        mask = torch.full((P, P), float("-inf")).triu(1)[None, None]  # causal
        x = layer(x, position_embeddings=rotation, attention_mask=mask, position_ids=positions)
        g = rms_norm(x[0], tensors["mtp.norm.weight"], eps)
        return reference.lm_head(g).float(), g


def final_hidden(reference, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' final-normed hidden states (L, H) of tokens (1, L)."""
    with torch.no_grad():
        return reference.model(tokens).last_hidden_state[0]


def test_head_logits_equal_a_plain_torch_reference(folder):
    """Every position of a 40-token prompt through the head (its K/V written over a block
    table, the causal attention over them), fed transformers' hidden states."""
    path, reference = folder
    tensors = load_file(path / "model.safetensors")
    tokens = random_tokens(1, 40)
    h = final_hidden(reference, tokens)[:-1]
    expected, _ = reference_mtp(reference, tensors, tokens[0, 1:], h)
    model = load(path)
    draft = LLM(model, **SMALL, num_kv_blocks=32, speculative=MTP).engine.speculator.draft
    L = tokens.shape[1] - 1
    step = ScheduledStep([tokens[0, 1:].tolist()], [0], [[list(range(10))]], [L])
    batch = draft.runner.forward_batch(step)
    ours = draft.head.logits(draft.head.hidden(batch, h, model), model)
    assert (ours - expected).abs().max() < 1e-4


def test_chained_proposals_are_the_references(folder):
    """The engine's first proposal of 3 tokens after a prompt: the reference's greedy chain,
    each guess run at the next position on the head's own output; the logits of each
    round are the reference's."""
    path, reference = folder
    tensors = load_file(path / "model.safetensors")
    prompt = PROMPTS[1]
    model = load(path)
    llm = LLM(model, **SMALL, num_kv_blocks=32, speculative=MTP)
    draft, made, rounds = llm.engine.speculator.draft, [], []
    propose, logits_of = draft.propose, draft.head.logits
    draft.propose = lambda seqs, ks: made.append(propose(seqs, ks)) or made[-1]
    draft.head.logits = lambda g, target: rounds.append(logits_of(g, target)) or rounds[-1]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    tokens = torch.tensor([prompt + out[0].token_ids[:1]])  # through the first sampled one
    h = final_hidden(reference, tokens[:, :-1])  # (n, H)
    next_tokens, chain = tokens[0, 1:], []
    for ours in rounds[:3]:
        logits, g = reference_mtp(reference, tensors, next_tokens, h)
        assert (ours[0] - logits[-1]).abs().max() < 1e-4
        chain.append(int(logits[-1].argmax()))
        next_tokens = torch.cat([next_tokens, torch.tensor(chain[-1:])])
        h = torch.cat([h, g[-1:]])
    assert made[0] == [chain]


def test_greedy_tokens_equal_with_and_without_the_head(folder):
    """A batch of prompts in chunks, then again over a pool of 30 blocks that preempts:
    the tokens without speculation, proposals made and counted (/metrics' counter)."""
    model = load(folder[0])
    plain, _ = greedy(model, PROMPTS, num_kv_blocks=96)
    tokens, llm = greedy(model, PROMPTS, num_kv_blocks=96, speculative=MTP)
    assert tokens == plain
    stats = llm.engine.stats()
    assert stats.spec_proposed_tokens_total > 0
    tokens, llm = greedy(model, PROMPTS, num_kv_blocks=30, speculative=MTP)
    assert tokens == plain
    assert llm.engine.stats().preemptions_total > 0


def test_kept_guesses_keep_the_heads_rows_in_step(folder):
    """The head's guesses (random weights: all rejected) replaced after it ran by the plain
    run's next tokens, all but the last right: verifications keep some, the hybrid state
    rolls back and runs them again, the head catches up from the rows of those kept, and
    the tokens are the plain run's."""
    model = load(folder[0])
    plain, _ = greedy(model, PROMPTS, num_kv_blocks=96)
    llm = LLM(model, **SMALL, num_kv_blocks=96, speculative=MTP)
    draft, kept = llm.engine.speculator.draft, []
    propose, verified = draft.propose, llm.engine.speculator.verified

    def planted(seqs, ks):
        guesses = propose(seqs, ks)  # the head runs (its K/V, its rows spent)
        for seq, own in zip(seqs, guesses, strict=True):
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            done = seq.num_tokens - seq.num_prompt_tokens
            right = plain[PROMPTS.index(prompt)][done : done + len(own)]
            own[:] = right[:-1] + [(right[-1] + 1) % 256] if len(own) > 1 else right
        return guesses

    def counted(seq, proposed, accepted):
        kept.append((proposed, accepted))
        verified(seq, proposed, accepted)

    draft.propose, llm.engine.speculator.verified = planted, counted
    tokens = [out.token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert tokens == plain
    # every step with room for a guess proposed, each time after a rollback: per request
    # of 16 tokens, the prompt's, 4 verifications of 3 (2 kept), 1 of 2 (1 kept), the last
    assert sorted(kept) == sorted(([(3, 2)] * 4 + [(2, 1)]) * len(PROMPTS))


def test_a_gguf_file_with_nextn_tensors_drafts_as_the_folder(folder, tmp_path):
    """llama.cpp's converter writes the head as `blk.4.nextn.*` and block 4's tensors: read
    back, its logits are the folder head's, and greedy tokens are the same on and off."""
    path, _ = folder
    gguf = tmp_path / "mtp.gguf"
    convert(path, ["--outtype", "f32", "--outfile", str(gguf)])
    ours, theirs = load(gguf), load(path)
    hidden = torch.randn(9, ours.config.hidden_size, generator=torch.Generator().manual_seed(1))
    logits = []
    for model in (ours, theirs):
        llm = LLM(model, **SMALL, num_kv_blocks=8, speculative=MTP)
        draft = llm.engine.speculator.draft
        batch = draft.runner.forward_batch(ScheduledStep([list(range(9))], [0], [[[0, 1, 2]]], [9]))
        logits.append(draft.head.logits(draft.head.hidden(batch, hidden, model), model))
    assert (logits[0] - logits[1]).abs().max() < 1e-4
    plain, _ = greedy(ours, PROMPTS[:2], num_kv_blocks=96)
    tokens, llm = greedy(ours, PROMPTS[:2], num_kv_blocks=96, speculative=MTP)
    assert tokens == plain and llm.engine.stats().spec_proposed_tokens_total > 0


def test_cli_generate_with_the_head_prints_the_same_text(folder, capsys):
    """`qinfer generate --speculative-method mtp` loads the head from the checkpoint's path."""
    args = ["generate", "abcabc", "--model", str(folder[0]), "--dtype", "float32"]
    args += ["--max-tokens", "16", "--no-chat", "--temperature", "0"]
    assert main(args) == 0
    want = capsys.readouterr().out
    assert main([*args, "--speculative-method", "mtp", "--num-speculative-tokens", "2"]) == 0
    assert capsys.readouterr().out == want


def test_the_server_drafts_with_the_head_and_counts_it_in_metrics(folder):
    """`qinfer serve --speculative-method mtp`: the completion's text is the one without
    the head, and /metrics counts the head's proposals."""
    body = {"model": "m", "prompt": "abcabc", "max_tokens": 16, "temperature": 0}
    args = ["--model", str(folder[0]), "--dtype", "float32", "--served-model-name", "m"]
    texts, values = [], None
    for extra in ([], ["--speculative-method", "mtp", "--num-speculative-tokens", "2"]):
        with serving(*args, *extra) as server:
            reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
            texts.append(reply["choices"][0]["text"])
            with httpx.Client(base_url=server.url) as http:
                values = metric_values(http)
    assert texts[0] == texts[1]
    assert values["qinfer_spec_decode_proposed_tokens_total"] > 0


def test_a_head_saved_under_the_model_loads_the_same(folder, tmp_path):
    """`model.mtp.*` (a head saved inside the model's prefix) reads as `mtp.*`."""
    path, _ = folder
    tensors = load_file(path / "model.safetensors")
    moved = {("model." if k.startswith("mtp.") else "") + k: v for k, v in tensors.items()}
    save_file(moved, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(path / "config.json", tmp_path / "config.json")
    head = load(tmp_path).mtp
    assert torch.equal(head.fc.weight, load(path).mtp.fc.weight)


def test_no_head_is_one_error(folder, tmp_path):
    """A checkpoint without `mtp.*` tensors and a model loaded without its head: each
    refused in one line naming what is missing."""
    build_checkpoint(tmp_path, "qwen3_5", **HYBRID["qwen3_5"])
    with pytest.raises(QinferError, match=r"holds no MTP head \(no tensor 'mtp.fc.weight'") as e:
        load(tmp_path)
    assert "\n" not in str(e.value)
    model = qinfer.load_model(folder[0], dtype=torch.float32, device="cpu")
    with pytest.raises(QinferError, match="needs the model's MTP head"):
        LLM(model, speculative=MTP)


def test_a_mixture_of_experts_head_drafts_too(tmp_path):
    """Qwen3.5-MoE's head: its layer's MLP is the experts' (a copy of layer 1's here)."""
    build_checkpoint(tmp_path, "qwen3_5_moe", **HYBRID["qwen3_5_moe"])
    add_mtp_head(tmp_path)
    model = load(tmp_path)
    assert isinstance(model.mtp.layers[0].mlp, SparseMoE)
    plain, _ = greedy(model, PROMPTS[:2], num_kv_blocks=96)
    tokens, llm = greedy(model, PROMPTS[:2], num_kv_blocks=96, speculative=MTP)
    assert tokens == plain and llm.engine.stats().spec_proposed_tokens_total > 0
