"""llama.cpp's GGUF LoRA adapters (`qinfer.lora.gguf_adapter`): the file llama.cpp's own
convert_lora_to_gguf.py writes from a PEFT folder gives the PEFT folder's logits (fp32) and
transformers + peft's merged model's, through the model and through the engine; a GGUF file that is not an adapter, and an adapter
for another base, are refused in one line naming the file."""

from __future__ import annotations

import pytest
import torch
from checkpoints import ALL, build_checkpoint, max_diff, random_tokens, save_lora_adapter
from gguf_files import run_llama_cpp_converter
from text_assets import save_qwen3_tokenizer

import qinfer
from qinfer.core.errors import AdapterError
from qinfer.engine import LLM
from qinfer.lora import Adapters
from qinfer.request.sampling import SamplingParams

pytest.importorskip("peft")

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores.
pytestmark = pytest.mark.slow

#: fp32 logits of order 1: the two adapters' pairs are the same numbers (F32 in the file),
#: summed in the same order; measured 0 difference.
SAME_ADAPTER = 1e-5
#: against transformers + peft's merged weights (another order of sums): as test_lora.py.
MERGED = 1e-4


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A random Qwen3 checkpoint, a PEFT adapter over it (every projection, B non-zero), the
    adapter as convert_lora_to_gguf.py writes it (F32), and transformers + peft merged."""
    root = tmp_path_factory.mktemp("gguf-lora")
    vocab = save_qwen3_tokenizer(root / "base").get_vocab_size()  # the converter reads it
    reference = build_checkpoint(root / "base", "qwen3", vocab_size=vocab)
    merged = save_lora_adapter(reference, root / "peft", ALL, r=8, alpha=24, seed=5)
    adapter = root / "adapter.gguf"
    run_llama_cpp_converter(
        "convert_lora_to_gguf.py",
        *("--base", str(root / "base"), "--outtype", "f32", "--outfile", str(adapter)),
        str(root / "peft"),
    )
    return root, adapter, merged


def test_gguf_adapter_equals_peft_folder(converted):
    root, adapter, merged = converted
    model = qinfer.load_model(root / "base", dtype=torch.float32, device="cpu")
    adapters = Adapters(model)
    adapters.load("gguf", adapter)
    adapters.load("peft", root / "peft")
    from_gguf, from_peft = adapters.resident["gguf"], adapters.resident["peft"]
    tokens = random_tokens(2, 12, seed=4)
    with torch.no_grad():
        expected = merged(tokens).logits.float()
    through_gguf = model(tokens, adapters=[from_gguf] * 2)
    assert max_diff(through_gguf, model(tokens, adapters=[from_peft] * 2)) < SAME_ADAPTER
    assert max_diff(through_gguf, expected) < MERGED
    assert max_diff(through_gguf, model(tokens)) > 1e-2  # the adapter changes the logits


def test_llama_adapter_q_k_rows_put_back(tmp_path):
    """A llama-architecture file stores q/k's B rows permuted for interleaved RoPE, as its
    base weights: read back in the checkpoint's order, it equals the PEFT folder."""
    reference = build_checkpoint(tmp_path / "base", "llama")
    merged = save_lora_adapter(reference, tmp_path / "peft", ALL, r=8, seed=2)
    adapter = tmp_path / "adapter.gguf"
    run_llama_cpp_converter(
        "convert_lora_to_gguf.py",
        *("--base", str(tmp_path / "base"), "--outtype", "f32", "--outfile", str(adapter)),
        str(tmp_path / "peft"),
    )
    model = qinfer.load_model(tmp_path / "base", dtype=torch.float32, device="cpu")
    adapters = Adapters(model)
    adapters.load("gguf", adapter)
    adapters.load("peft", tmp_path / "peft")
    tokens = random_tokens(2, 12, seed=4)
    through_gguf = model(tokens, adapters=[adapters.resident["gguf"]] * 2)
    through_peft = model(tokens, adapters=[adapters.resident["peft"]] * 2)
    assert max_diff(through_gguf, through_peft) < SAME_ADAPTER
    with torch.no_grad():
        assert max_diff(through_gguf, merged(tokens).logits.float()) < MERGED


def test_gguf_adapter_refusals(converted, tmp_path):
    root, adapter, _ = converted
    build_checkpoint(tmp_path / "other", "qwen3", hidden_size=32, head_dim=16)
    model = qinfer.load_model(tmp_path / "other", dtype=torch.float32, device="cpu")
    adapters = Adapters(model)
    with pytest.raises(AdapterError, match=rf"\({adapter}\): .* \(another base model\?\)"):
        adapters.load("other", adapter)
    base_file = tmp_path / "base.gguf"
    run_llama_cpp_converter(
        "convert_hf_to_gguf.py",
        *(str(root / "base"), "--outtype", "f32", "--outfile", str(base_file)),
    )
    with pytest.raises(AdapterError, match=rf"{base_file}: general.type 'model'.*not a LoRA"):
        adapters.load("model", base_file)
    lora_a = {"blk.0.attn_q.weight.lora_a": (8, 64)}
    for i, (tensors, alpha, refusal) in enumerate(
        (
            (lora_a, 16.0, "model.layers.0.self_attn.q_proj has no lora_b"),
            (lora_a, None, "adapter.lora.alpha is missing"),
            ({"blk.0.attn_q.weight.delta": (8, 64)}, 16.0, "'blk.0.attn_q.weight.delta' is not"),
        )
    ):
        made = write_adapter(tmp_path / f"made{i}.gguf", tensors, alpha)
        with pytest.raises(AdapterError, match=rf"{made}: .*{refusal}"):
            adapters.load("made", made)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(AdapterError, match=rf"{junk} is not a readable GGUF file"):
        adapters.load("junk", junk)
    assert adapters.names() == []


def test_gguf_adapter_through_the_engine(converted):
    """`lora_modules` takes the GGUF file as it takes the folder: greedy tokens through
    either are transformers + peft's merged model's."""
    root, adapter, merged = converted
    modules = {"gguf": str(adapter), "peft": str(root / "peft")}
    llm = LLM(root / "base", dtype=torch.float32, lora_modules=modules)
    prompt = random_tokens(1, 9, seed=6)[0].tolist()
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
    outputs = llm.generate([prompt] * 2, greedy, use_tqdm=False, lora=["gguf", "peft"])
    with torch.no_grad():
        expected = merged.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6
        )[0, len(prompt) :].tolist()
    assert [output.token_ids for output in outputs] == [expected, expected]


def write_adapter(path, tensors: dict[str, tuple[int, ...]], alpha: float | None):
    """A GGUF adapter file as convert_lora_to_gguf.py lays one out: `tensors` (name ->
    shape, random F32), adapter.lora.alpha unless None."""
    import gguf

    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    if alpha is not None:
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name, shape in tensors.items():
        writer.add_tensor(name, torch.randn(shape).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
