"""Build, then load: a model built from its config holds empty slots; `load` fills them from
a checkpoint (the whole model or one layer), `init_random` with random weights; the result is
a `torch.nn.Module` tree (named_modules, forward hooks, state_dict).

References: `qinfer.load_model` (build + load of the same checkpoint) and the model's own
layers.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from checkpoints import build_checkpoint, random_model, random_tokens, tiny_config
from gguf_files import smollm2_path

import qinfer
import qinfer.core.module
from qinfer.core.errors import QinferError
from qinfer.core.features import Features
from qinfer.core.parallel import Parallel
from qinfer.layers.attention import Attention
from qinfer.linear import DenseLinear
from qinfer.models import config_from_file
from qinfer.weights import SafetensorsWeights
from qinfer.weights.load import init_random, load
from qinfer.weights.slots import GroupedSlot, LinearSlot

#: Tied embeddings (one slot in two places), QK-norm, GQA.
QWEN3 = dict(tie_word_embeddings=True, head_dim=32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-tied")
    build_checkpoint(folder, "qwen3", **QWEN3)
    return folder


def weights_of(folder) -> SafetensorsWeights:
    return SafetensorsWeights(folder, torch.float32, "cpu")


def slots(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, LinearSlot | GroupedSlot)]


def test_a_built_model_holds_no_weights_and_says_so_when_called():
    model = qinfer.Transformer(tiny_config("qwen3_moe", num_hidden_layers=2))
    assert slots(model) == [
        "embed_tokens",
        "layers.0.self_attn.wqkv",
        "layers.0.self_attn.wo",
        "layers.0.mlp.router",
        "layers.0.mlp.gate_up",
        "layers.0.mlp.down",
        "layers.1.self_attn.wqkv",
        "layers.1.self_attn.wo",
        "layers.1.mlp.router",
        "layers.1.mlp.gate_up",
        "layers.1.mlp.down",
        "lm_head",
    ]
    assert all(t.device.type == "meta" for t in model.state_dict().values())  # the norms
    with pytest.raises(QinferError, match=r"^model\.embed_tokens is not loaded: fill"):
        model(torch.tensor([[1, 2]]))


def test_load_fills_every_slot_and_computes_as_load_model(folder):
    config = config_from_file(folder)
    model = load(qinfer.Transformer(config), weights_of(folder))
    assert slots(model) == []
    assert model.lm_head is model.embed_tokens  # the tied slot, replaced in both places
    expected = qinfer.load_model(folder, dtype="float32", device="cpu")
    tokens = random_tokens(2, 9)
    assert torch.equal(model(tokens), expected(tokens))


def test_one_layer_loads_on_its_own(folder):
    config = config_from_file(folder)
    attention = load(Attention("model.layers.1", config, Features(), layer=1), weights_of(folder))
    model = qinfer.load_model(folder, dtype="float32", device="cpu")
    x = torch.randn(2, 7, config.hidden_size, generator=torch.Generator().manual_seed(0))
    alone = attention(x, 0, model.make_cache(2)[1], "causal")
    assert torch.equal(alone, model.layers[1].self_attn(x, 0, model.make_cache(2)[1], "causal"))


def test_a_world_size_that_does_not_split_the_model_is_refused_before_any_read(folder):
    class Unread(SafetensorsWeights):
        def _read(self, name, *part):
            raise AssertionError(f"read {name}")

    model = qinfer.Transformer(config_from_file(folder))
    with pytest.raises(QinferError, match="^4 query heads do not divide into 3 ranks"):
        load(model, Unread(folder, torch.float32, "cpu"), Parallel(0, 3))


@pytest.fixture
def hooks_then_fast_calls():
    """A hook test sets `qinfer.core.module._hooked` for good (every call then takes
    nn.Module's path); once its hooked model is gone, the rest of the suite goes back to
    the calls users run, with no hook set."""
    yield
    qinfer.core.module._hooked = False


@pytest.mark.usefixtures("hooks_then_fast_calls")
def test_forward_hooks_fire_on_the_layers_and_the_projections():
    model = random_model("qwen3", **QWEN3)
    seen = []
    for name, module in model.named_modules():
        if name.endswith(("self_attn", "mlp.down")):
            module.register_forward_hook(lambda m, args, out, name=name: seen.append((name, out)))
    model(random_tokens(1, 5))
    names = ["layers.0.self_attn", "layers.0.mlp.down", "layers.1.self_attn", "layers.1.mlp.down"]
    assert [name for name, _ in seen] == names
    assert all(out.shape == (5, 64) for _, out in seen)  # (T, hidden): the flat tokens


@pytest.mark.usefixtures("hooks_then_fast_calls")
def test_a_hook_set_after_the_model_ran_fires_and_the_output_is_unchanged():
    """Calls skip nn.Module's hook checks until a hook is set on any qinfer module: one set
    after the model ran (on the fast path) still fires, and nothing else changes."""
    model = random_model("qwen3", **QWEN3)
    tokens = random_tokens(1, 5)
    assert not qinfer.core.module._hooked  # so the first call takes the fast path
    first = model(tokens)
    seen = []
    mlp = dict(model.named_modules())["layers.1.mlp"]
    handle = mlp.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    again = model(tokens)
    handle.remove()
    assert seen == [(5, 64)]
    assert torch.equal(first, again) and torch.equal(model(tokens), first)


def test_a_global_forward_hook_sees_every_module_call():
    """`Module.__call__` skips nn.Module's hook machinery only while no hook is set: a
    global hook (as profilers and debuggers add) still sees each layer's call."""
    model = random_model("qwen3", **QWEN3)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: seen.append(type(m).__name__)
    )
    try:
        model(random_tokens(1, 5))
    finally:
        handle.remove()
    assert seen.count("Block") == 2 and seen.count("Attention") == 2
    seen.clear()
    model(random_tokens(1, 5))
    assert seen == []


def test_a_random_model_is_reproducible_by_seed_in_any_dtype():
    config = tiny_config("qwen3", **QWEN3)
    model = qinfer.Transformer.random(config, seed=3)
    tokens = random_tokens(2, 9)
    assert torch.equal(model(tokens), qinfer.Transformer.random(config, seed=3)(tokens))
    assert not torch.equal(model(tokens), qinfer.Transformer.random(config, seed=4)(tokens))
    # The same draws, cast: a bf16 model holds the fp32 model's weights rounded.
    half = init_random(qinfer.Transformer(config), seed=3, dtype=torch.bfloat16)
    state, half_state = model.state_dict(), half.state_dict()
    assert list(state) == list(half_state)
    assert all(torch.equal(state[k].bfloat16(), half_state[k]) for k in state)
    assert isinstance(model.layers[0].mlp.gate_up, DenseLinear)
    # (Hq + 2 Hkv) * D rows of hidden inputs
    assert state["layers.0.self_attn.wqkv.weight"].shape == ((4 + 2 * 2) * 32, 64)


def test_mirrored_submodules_and_buffers_follow_every_change():
    """`qinfer.core.module.Module` reads submodules and buffers as plain attributes: they must
    stay the ones nn.Module holds through `.to()`, `set_submodule`, buffers and deletion."""
    model = random_model("qwen3", **QWEN3)
    attention = model.layers[0].self_attn
    model.to(torch.bfloat16)  # every buffer replaced
    assert attention.wqkv.weight is attention.wqkv._buffers["weight"]
    assert attention.wqkv.weight.dtype == torch.bfloat16
    new = DenseLinear(torch.zeros(64, 128))
    model.set_submodule("layers.0.self_attn.wo", new)
    assert attention.wo is new is attention._modules["wo"]
    attention.wo.register_buffer("bias", torch.ones(64))
    assert torch.equal(new.bias, torch.ones(64))
    del attention.q_norm
    assert not hasattr(attention, "q_norm")


#: A fresh process: loads SmolLM2, runs one engine workload (16 prompts of 64 tokens) to
#: warm up, then the same shape again and prints the page faults of that second run.
FAULTS_OF_A_WARM_RUN = textwrap.dedent(
    """
    import random, resource, sys
    from qinfer import LLM, SamplingParams, load_model
    llm = LLM(load_model(sys.argv[1], device="cpu"))
    rng = random.Random(0)
    def run(n):
        prompts = [[rng.randrange(1000, 40000) for _ in range(64)] for _ in range(16)]
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
    run(4)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    run(12)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc thresholds")
def test_engine_steps_after_loading_do_not_fault_their_temporaries_in_again():
    """`load_model` leaves glibc's trim threshold above what a step frees: a warm workload
    reuses the heap instead of handing each step's temporaries back to the OS. Measured in a
    fresh process (the test process's heap depends on the tests before it): 26-868 faults
    with the threshold set, 79,000-108,000 without (the 128 KiB default)."""
    out = subprocess.run(
        [sys.executable, "-c", FAULTS_OF_A_WARM_RUN, str(smollm2_path())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    faults = int(out.stdout.split()[-1])
    assert faults < 10_000, f"{faults} page faults in a warm engine run"
