"""LoRA adapters over quantized bases: int8 rows and int4 groups (`quantize`) and a GGUF
file's Q8_0 blocks as llama.cpp's convert_hf_to_gguf.py writes them. The adapter stays
fp32 beside the base's kernel: each projection's output is the base kernel's plus the
adapter's x A^T B^T, the same numbers a plain-torch product gives; the model's logits equal
transformers + peft's over the base's dequantized weights; a batch mixing adapters and the
base gives every row its bits alone."""

from __future__ import annotations

import copy

import pytest
import torch
from checkpoints import ALL, ATTENTION, build_checkpoint, max_diff, random_tokens, save_lora_adapter
from gguf_files import run_llama_cpp_converter
from text_assets import save_qwen3_tokenizer

import qinfer
from qinfer.core.forward_batch import AdapterRows
from qinfer.linear import Linear
from qinfer.linear.lora import LoraLinear
from qinfer.lora import Adapters, read_adapter

peft = pytest.importorskip("peft")

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores.
pytestmark = pytest.mark.slow

BASES = ["int8", "int4", "q8_0"]
#: a projection's adapter rows (outputs of order 1) against base(x) + (x A^T) B^T in plain
#: torch: the same fp32 products (the packed form's other slots add exact zeros), summed in
#: another order; measured 1.1e-6 on each base
DELTA = 1e-5
#: fp32 logits of order 1 against transformers + peft merged over the dequantized weights
#: (W + B A summed before the product, qinfer after; the kernels' sums in their order);
#: measured 2.6e-6 (int8), 3.3e-6 (int4), 6.0e-6 (Q8_0), the adapter moving them by ~1.3
MERGED = 5e-5


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A random Qwen3 checkpoint (with a tokenizer, which the converter reads), three PEFT
    adapters over it, and transformers' model."""
    root = tmp_path_factory.mktemp("lora-quantized")
    vocab = save_qwen3_tokenizer(root / "base").get_vocab_size()
    reference = build_checkpoint(root / "base", "qwen3", vocab_size=vocab)
    for i, targets in enumerate((ALL, ATTENTION, ["gate_proj", "down_proj"])):
        save_lora_adapter(reference, root / f"a{i}", targets, r=4 + 4 * i, seed=60 + i)
    return root, reference


def load(files, kind: str, **features) -> torch.nn.Module:
    """The checkpoint with its weights of `kind`: quantized as it loads, or the Q8_0 file."""
    root, _ = files
    if kind == "q8_0":
        path = root / "q8_0.gguf"
        if not path.exists():
            run_llama_cpp_converter(
                "convert_hf_to_gguf.py",
                *(str(root / "base"), "--outtype", "q8_0", "--outfile", str(path)),
            )
        return qinfer.load_model(path, device="cpu", **features)
    return qinfer.load_model(root / "base", dtype=torch.float32, quantize=kind, **features)


def dequantized_reference(reference: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """A copy of transformers' model holding `model`'s weights as its kernels see them
    (each Linear's dequantize(), fused parts split back by their checkpoint names)."""
    copied = copy.deepcopy(reference)
    for module in model.modules():
        if not isinstance(module, Linear) or module.source is None:
            continue
        rows = [out for out, _ in module.source.shapes]
        for name, part in zip(module.source.names, module.dequantize().split(rows), strict=True):
            target = copied.get_submodule(name)  # a new Parameter: unties a tied head too
            target.weight = torch.nn.Parameter(part.float().clone(), requires_grad=False)
    return copied


@pytest.mark.parametrize("kind", BASES)
def test_adapter_delta_over_a_quantized_base(files, kind):
    root, reference = files
    model = load(files, kind, exact=True)  # fp32 activations: the reference mode
    # K/V in fp32 as the reference's (a GGUF file's blocks keep them in bf16 by default)
    model.kv_auto_dtype = None
    adapters = Adapters(model)
    adapters.load("a0", root / "a0")
    slot = adapters.resident["a0"]
    quantized = {type(m.base).__name__ for m in model.modules() if isinstance(m, LoraLinear)}
    assert quantized.isdisjoint({"DenseLinear"}), quantized
    # each projection: base kernel + the adapter's product, against plain torch
    pairs = read_adapter(root / "a0").modules
    generator = torch.Generator().manual_seed(7)
    for module in model.modules():
        if not isinstance(module, LoraLinear):
            continue
        x = torch.randn(5, module.in_features, generator=generator)
        rows = AdapterRows(torch.tensor([1, 3]), torch.tensor([slot, slot]))
        got = module(x, rows)
        base = module.base(x)
        parts = [pairs.get(name) for name in module.base.source.names]
        delta = torch.cat(
            [
                torch.zeros(x.shape[0], out) if pair is None else (x @ pair[0].t()) @ pair[1].t()
                for pair, (out, _) in zip(parts, module.base.source.shapes, strict=True)
            ],
            dim=1,
        )
        assert torch.equal(got[[0, 2, 4]], base[[0, 2, 4]])  # rows of no adapter untouched
        assert max_diff(got[[1, 3]], base[[1, 3]] + delta[[1, 3]]) < DELTA
    # the model: transformers + peft merged over the weights the kernels multiply
    merged = peft.PeftModel.from_pretrained(dequantized_reference(reference, model), root / "a0")
    merged = merged.merge_and_unload().eval()
    tokens = random_tokens(2, 12, seed=8)
    with torch.no_grad():
        expected = merged(tokens).logits.float()
    got = model(tokens, adapters=[slot, slot])
    assert max_diff(got, expected) < MERGED
    assert max_diff(got, model(tokens)) > 1e-2


@pytest.mark.parametrize("kind", BASES)
def test_mixed_batch_over_a_quantized_base(files, kind):
    """int8 activations (the default): three adapters and the base in one batch, each row
    bit for bit as alone, the base's row the model's without adapters."""
    root, _ = files
    model = load(files, kind, batch_invariant=True)
    tokens = random_tokens(4, 10, seed=9)
    before = model(tokens)
    adapters = Adapters(model)
    for i in range(3):
        adapters.load(f"a{i}", root / f"a{i}")
    rows = [adapters.resident["a0"], None, adapters.resident["a1"], adapters.resident["a2"]]
    mixed = model(tokens, adapters=rows)
    for b, slot in enumerate(rows):
        assert torch.equal(mixed[b], model(tokens[b : b + 1], adapters=[slot])[0]), b
    assert torch.equal(mixed[1], before[1])
    assert not torch.equal(mixed[0], before[0])
