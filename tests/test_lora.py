"""LoRA adapters (`qinfer.lora`, `qinfer.linear.lora`): a PEFT folder made with `peft` over a
random checkpoint gives transformers + peft's merged model's logits in float32, on qinfer's
fused q/k/v and gate/up projections; rows of different adapters (and none) share a batch,
each as if alone, and rows of none are the base model's bit for bit; bad adapters are
refused in one line naming what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import (
    ALL,
    ATTENTION,
    build_checkpoint,
    max_diff,
    random_tokens,
    save_lora_adapter,
)

import qinfer
from qinfer.cli import build_parser
from qinfer.core.errors import AdapterError, QinferError
from qinfer.engine import LLM
from qinfer.linear.lora import LoraLinear
from qinfer.lora import Adapters
from qinfer.request.sampling import SamplingParams

pytest.importorskip("peft")

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3")
    return build_checkpoint(folder, "qwen3"), folder


def logits(model, tokens, adapters=None):
    return model(tokens, adapters=adapters)


@pytest.mark.parametrize(
    ("family", "targets", "rslora"),
    [
        ("qwen3", ALL, False),
        ("qwen3", ["q_proj", "v_proj", "up_proj"], True),
        ("qwen3_moe", ATTENTION, False),
    ],
)
def test_peft_adapter_equals_merged_model(tmp_path, family, targets, rslora):
    reference = build_checkpoint(tmp_path / "base", family)
    merged = save_lora_adapter(reference, tmp_path / "adapter", targets, rslora=rslora)
    model = qinfer.load_model(tmp_path / "base", dtype=torch.float32, device="cpu")
    adapters = Adapters(model)
    adapters.load("mine", tmp_path / "adapter")
    slot = adapters.resident["mine"]
    tokens = random_tokens(2, 12)
    with torch.no_grad():
        expected = merged(tokens).logits.float()
        base = reference(tokens).logits.float()
    got = logits(model, tokens, [slot, slot])
    assert max_diff(got, expected) < 1e-4
    assert max_diff(expected, base) > 1e-2  # the adapter changes the logits
    # targeted projections only, fused ones whole
    wrapped = {name for name, m in model.named_modules() if isinstance(m, LoraLinear)}
    assert all(name.endswith(("wqkv", "wo", "gate_up", "down")) for name in wrapped)
    assert max_diff(logits(model, tokens), base) < 1e-4  # no adapter: the base model


def test_mixed_batch_rows_as_if_alone(qwen3, tmp_path):
    """Three adapters and the base in one batch: each row bit for bit as alone; the base's
    row bit for bit the model's without any adapter loaded."""
    reference, folder = qwen3
    model = qinfer.load_model(folder, dtype=torch.float32, device="cpu", batch_invariant=True)
    tokens = random_tokens(4, 10, seed=3)
    before = logits(model, tokens)
    adapters = Adapters(model)
    slots = []
    for i, targets in enumerate((ALL, ATTENTION, ["gate_proj", "down_proj"])):
        save_lora_adapter(reference, tmp_path / f"a{i}", targets, r=4 + 4 * i, seed=i)
        adapters.load(f"a{i}", tmp_path / f"a{i}")
        slots.append(adapters.resident[f"a{i}"])
    rows = [slots[0], None, slots[1], slots[2]]
    mixed = logits(model, tokens, rows)
    for b, slot in enumerate(rows):
        alone = logits(model, tokens[b : b + 1], [slot])
        assert torch.equal(mixed[b], alone[0]), f"row {b} (slot {slot})"
    assert torch.equal(mixed[1], before[1])
    assert not torch.equal(mixed[0], before[0])
    # unloaded: its projections hold no pair for its slot; the base's rows unchanged
    adapters.unload("a0")
    assert "a0" not in adapters
    with pytest.raises(AdapterError, match="'a0' is not loaded"):
        adapters.get("a0")
    assert torch.equal(logits(model, tokens), before)


def test_bfloat16_adapters(qwen3, tmp_path):
    """lora_dtype="bfloat16" holds the adapters in bf16 (half the bytes a step reads): the
    adapter's effect on the logits within 1% of transformers + peft's, a mixed batch's rows
    still as alone; a dtype the op does not take is refused in one line."""
    reference, folder = qwen3
    merged = save_lora_adapter(reference, tmp_path / "adapter", ALL, seed=5)
    model = qinfer.load_model(folder, dtype=torch.float32, device="cpu", batch_invariant=True)
    adapters = Adapters(model, lora_dtype="bfloat16")
    adapters.load("mine", tmp_path / "adapter")
    slot = adapters.resident["mine"]
    held = [m.a.dtype for m in model.modules() if isinstance(m, LoraLinear)]
    assert held and set(held) == {torch.bfloat16}
    tokens = random_tokens(2, 12, seed=4)
    with torch.no_grad():
        expected = merged(tokens).logits.float()
        base = reference(tokens).logits.float()
    got = logits(model, tokens, [slot, None])
    effect = max_diff(expected[0], base[0])
    assert effect > 1e-2
    assert 0 < max_diff(got[0], expected[0]) < 0.01 * effect  # rounded, within 1%
    assert torch.equal(got[0], logits(model, tokens[:1], [slot])[0])
    assert torch.equal(got[1], logits(model, tokens[1:])[0])
    with pytest.raises(QinferError, match="unknown lora_dtype 'float16'; use one of auto"):
        Adapters(model, lora_dtype="float16")
    with pytest.raises(QinferError, match="unknown lora_dtype 'float16'"):
        LLM(model, lora_dtype="float16")
    assert build_parser().parse_args(["serve", "--lora-dtype", "bfloat16"]).lora_dtype == "bfloat16"


def test_refusals(qwen3, tmp_path):
    reference, folder = qwen3
    model = qinfer.load_model(folder, dtype=torch.float32, device="cpu")
    adapters = Adapters(model, max_loras=1, max_lora_rank=8)
    save_lora_adapter(reference, tmp_path / "big", ATTENTION, r=16)
    with pytest.raises(AdapterError, match="rank 16 is above max_lora_rank 8"):
        adapters.load("big", tmp_path / "big")
    save_lora_adapter(reference, tmp_path / "head", ["lm_head"], r=4, save_embedding_layers=False)
    with pytest.raises(AdapterError, match="targets lm_head, which is not"):
        adapters.load("head", tmp_path / "head")
    other = build_checkpoint(tmp_path / "other", "qwen3", hidden_size=32, head_dim=16)
    save_lora_adapter(other, tmp_path / "other_adapter", ATTENTION, r=4)
    with pytest.raises(AdapterError, match="another base model"):
        adapters.load("other", tmp_path / "other_adapter")
    with pytest.raises(AdapterError, match="neither a folder with adapter_config.json"):
        adapters.load("x", tmp_path / "nowhere")
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        adapters.load("x", folder)
    save_lora_adapter(reference, tmp_path / "ok", ["q_proj"], r=4)
    config_file = tmp_path / "ok" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "lora_alpha": None}))
    with pytest.raises(AdapterError, match="lora_alpha is missing"):
        adapters.load("ok", tmp_path / "ok")
    config_file.write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora"):
        adapters.load("ok", tmp_path / "ok")
    config_file.write_text(json.dumps(config))
    adapters.load("ok", tmp_path / "ok")
    with pytest.raises(AdapterError, match="already loaded"):
        adapters.load("ok", tmp_path / "ok")
    with pytest.raises(AdapterError, match="all max_loras=1 resident adapters .* in use"):
        adapters.load("ok2", tmp_path / "ok", in_use={adapters.resident["ok"]})
    assert adapters.names() == ["ok"]
    assert not any(isinstance(m, LoraLinear) for m in model.layers[0].mlp.modules())
    with pytest.raises(QinferError, match="lora_modules: LoRA adapters run in one process"):
        LLM(folder, tensor_parallel_size=2, lora_modules={"ok": str(tmp_path / "ok")})


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)


@pytest.fixture(scope="module")
def served(qwen3, tmp_path_factory):
    """An LLM over the qwen3 checkpoint (batch-invariant) with three adapters loaded at start,
    and transformers + peft's merged models of each."""
    reference, folder = qwen3
    root = tmp_path_factory.mktemp("adapters")
    merged, modules = {}, {}
    for i, targets in enumerate((ALL, ATTENTION, ["gate_proj", "down_proj"])):
        merged[f"a{i}"] = save_lora_adapter(reference, root / f"a{i}", targets, r=8, seed=10 + i)
        modules[f"a{i}"] = str(root / f"a{i}")
    merged[None] = reference
    llm = LLM(folder, dtype=torch.float32, batch_invariant=True, lora_modules=modules, block_size=4)
    return llm, merged


def test_generate_per_request_adapter(served):
    """Greedy tokens through each adapter equal transformers + peft's merged model's; a
    batch of three adapters and the base gives each its tokens alone."""
    llm, merged = served
    prompts = [random_tokens(1, 9, seed=20 + i)[0].tolist() for i in range(4)]
    names = ["a0", None, "a1", "a2"]
    together = llm.generate(prompts, GREEDY, use_tqdm=False, lora=names)
    for prompt, name, output in zip(prompts, names, together, strict=True):
        alone = llm.generate([prompt], GREEDY, use_tqdm=False, lora=name)[0]
        assert output.token_ids == alone.token_ids, name
        with torch.no_grad():
            expected = merged[name].generate(
                torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6
            )[0, len(prompt) :]
        assert output.token_ids == expected.tolist(), name


def test_prefix_cache_keyed_by_adapter(served):
    """A prompt's blocks cached under one adapter serve it again, never the base or another
    adapter."""
    llm, _ = served
    prompt = random_tokens(1, 14, seed=40)[0].tolist()
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora="a0")[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora="a0")[0]
    base = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    other = llm.generate([prompt], GREEDY, use_tqdm=False, lora="a1")[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert base.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again.token_ids == first.token_ids


def test_engine_load_unload(served, tmp_path):
    llm, _ = served
    with pytest.raises(AdapterError, match="'nope' is not loaded"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora="nope")
    llm.load_lora("late", llm.engine.adapters.get("a1").path)
    late = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora="late")[0]
    a1 = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora="a1")[0]
    assert late.token_ids == a1.token_ids
    llm.unload_lora("late")
    with pytest.raises(AdapterError, match="'late' is not loaded"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora="late")


def test_lru_eviction_past_max_loras(qwen3, served):
    """max_loras=2 over three adapters: a load past the bound evicts the least recently
    used resident one, a request naming an evicted one makes it resident again (evicting
    the next), each giving the tokens of an engine that holds all three resident; in a
    batch naming three adapters the third waits until a slot frees, and every request
    gets its adapter's tokens."""
    served_llm, _ = served
    paths = {name: served_llm.engine.adapters.get(name).path for name in ("a0", "a1", "a2")}
    llm = LLM(
        qwen3[1],
        dtype=torch.float32,
        batch_invariant=True,
        lora_modules={"a0": paths["a0"], "a1": paths["a1"]},
        max_loras=2,
        block_size=4,
    )
    adapters = llm.engine.adapters
    prompt = random_tokens(1, 9, seed=50)[0].tolist()

    def tokens(engine_llm, name):
        return engine_llm.generate([prompt], GREEDY, use_tqdm=False, lora=name)[0].token_ids

    assert tokens(llm, "a0") == tokens(served_llm, "a0")  # a0 used last: a1 is the LRU
    llm.load_lora("a2", paths["a2"])
    assert list(adapters.resident) == ["a0", "a2"] and adapters.names() == ["a0", "a1", "a2"]
    assert tokens(llm, "a1") == tokens(served_llm, "a1")  # back in a0's slot
    assert list(adapters.resident) == ["a2", "a1"]
    assert tokens(llm, "a0") == tokens(served_llm, "a0")
    batch = llm.generate([prompt] * 3, GREEDY, use_tqdm=False, lora=["a0", "a1", "a2"])
    want = [tokens(served_llm, name) for name in ("a0", "a1", "a2")]
    assert [out.token_ids for out in batch] == want
    assert llm.engine.stats().num_running == 0 and list(adapters.resident) == ["a1", "a2"]


def test_generate_and_chat_take_an_adapter(tmp_path, capsys, monkeypatch):
    """`qinfer generate --lora DIR` prints the greedy reply through the adapter (the
    engine's with that adapter, not the base model's); `chat --lora` replies through it
    too; a folder that is not an adapter is refused in one line naming it."""
    import io

    from text_assets import save_qwen3_tokenizer

    from qinfer.cli import main

    backend = save_qwen3_tokenizer(tmp_path)
    reference = build_checkpoint(tmp_path, "qwen3", vocab_size=backend.get_vocab_size())
    adapter = tmp_path / "adapter"
    save_lora_adapter(reference, adapter, ALL, r=8, seed=3)
    flags = ["--model", str(tmp_path), "--max-tokens", "6", "--temperature", "0"]
    flags += ["--dtype", "float32", "--device", "cpu", "--lora", str(adapter)]
    assert main(["generate", *flags, "Hi"]) == 0
    printed = capsys.readouterr().out
    llm = LLM(tmp_path, dtype=torch.float32, lora_modules={"a": str(adapter)})
    chat = [{"role": "user", "content": "Hi"}]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    through, base = (
        llm.generate([chat], params, use_tqdm=False, lora=name)[0].text for name in ("a", None)
    )
    assert printed == through + "\n" and through != base
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    assert main(["chat", *flags]) == 0
    assert capsys.readouterr().out.count(through) == 1
    flags[-1] = str(tmp_path / "nothing")
    assert main(["generate", *flags, "Hi"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert "nothing" in line
