"""Every bad input raises a `qinfer` error with one readable line that names what is wrong."""

import json
import shutil

import pytest
import torch
from checkpoints import build_checkpoint
from safetensors.torch import load_file, save_file

import qinfer
from qinfer.core.errors import CacheError, ConfigError, QinferError, WeightsError


def error_line(excinfo) -> str:
    """The message of a raised qinfer error, checked to be a single line."""
    assert isinstance(excinfo.value, QinferError)
    message = str(excinfo.value)
    assert message and "\n" not in message
    return message


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    build_checkpoint(folder, "qwen3")
    return folder


@pytest.fixture(scope="module")
def model(good_folder):
    return qinfer.load_model(good_folder, dtype="float32", device="cpu")


@pytest.fixture
def copy(good_folder, tmp_path):
    """A scratch copy of the good checkpoint that a test may break."""
    folder = tmp_path / "broken"
    shutil.copytree(good_folder, folder)
    return folder


def rewrite_tensors(folder, change) -> None:
    """Apply `change(tensors: dict)` to the checkpoint's model.safetensors."""
    file = folder / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_folder_without_config_json(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        qinfer.load_model(tmp_path, device="cpu")
    message = error_line(excinfo)
    assert "config.json" in message and str(tmp_path) in message


def test_missing_model_path(tmp_path):
    with pytest.raises(QinferError) as excinfo:
        qinfer.load_model(tmp_path / "nowhere", device="cpu")
    assert "nowhere" in error_line(excinfo)


def test_unsupported_model_type_lists_the_supported_ones(copy):
    config = json.loads((copy / "config.json").read_text())
    config["model_type"] = "gpt2"
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as excinfo:
        qinfer.load_model(copy, device="cpu")
    message = error_line(excinfo)
    assert "'gpt2'" in message
    for supported in ("qwen3", "qwen2", "llama", "mistral"):
        assert supported in message


def test_missing_config_field_is_named(copy):
    config = json.loads((copy / "config.json").read_text())
    del config["hidden_size"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as excinfo:
        qinfer.load_model(copy, device="cpu")
    assert "'hidden_size'" in error_line(excinfo)


def test_missing_tensor_names_it_and_its_file(copy):
    name = "model.layers.1.self_attn.k_proj.weight"
    rewrite_tensors(copy, lambda tensors: tensors.pop(name))
    with pytest.raises(WeightsError) as excinfo:
        qinfer.load_model(copy, device="cpu")
    message = error_line(excinfo)
    assert name in message and "model.safetensors" in message


def test_untied_checkpoint_without_lm_head(copy):
    # The good checkpoint is untied (tie_word_embeddings false): its lm_head is required.
    assert json.loads((copy / "config.json").read_text())["tie_word_embeddings"] is False
    rewrite_tensors(copy, lambda tensors: tensors.pop("lm_head.weight"))
    with pytest.raises(WeightsError) as excinfo:
        qinfer.load_model(copy, device="cpu")
    assert "'lm_head.weight'" in error_line(excinfo)


def test_tensor_of_wrong_shape_names_it_expected_and_got(copy):
    name = "model.layers.0.mlp.up_proj.weight"  # (intermediate 128, hidden 64)

    def shrink(tensors):
        tensors[name] = tensors[name][:100].clone()

    rewrite_tensors(copy, shrink)
    with pytest.raises(WeightsError) as excinfo:
        qinfer.load_model(copy, device="cpu")
    message = error_line(excinfo)
    assert name in message and "(128, 64)" in message and "(100, 64)" in message


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
        pytest.param(lambda data: b"\x07garbage" * 64, id="garbage"),
        pytest.param(lambda data: b"", id="empty"),
    ],
)
def test_corrupt_safetensors_file(copy, damage):
    file = copy / "model.safetensors"
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(WeightsError) as excinfo:
        qinfer.load_model(copy, device="cpu")
    message = error_line(excinfo)
    assert "corrupt" in message and str(file) in message


def test_folder_without_safetensors_files(copy):
    (copy / "model.safetensors").unlink()
    with pytest.raises(WeightsError) as excinfo:
        qinfer.load_model(copy, device="cpu")
    message = error_line(excinfo)
    assert ".safetensors" in message and str(copy) in message


def test_shard_listed_in_index_but_absent(copy):
    file = copy / "model.safetensors"
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    file.unlink()
    with pytest.raises(WeightsError) as excinfo:
        qinfer.load_model(copy, device="cpu")
    assert "model-00002-of-00002.safetensors" in error_line(excinfo)


def test_unknown_dtype(good_folder):
    with pytest.raises(QinferError) as excinfo:
        qinfer.load_model(good_folder, dtype="float8", device="cpu")
    assert "'float8'" in error_line(excinfo)


def test_cache_asked_for_more_positions_than_it_holds(model):
    cache = model.make_cache(1, max_length=10)
    model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
    with pytest.raises(CacheError) as excinfo:
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    message = error_line(excinfo)
    assert "10" in message and "11" in message


def test_positions_past_the_context(model):
    # max_position_embeddings is 512: RoPE has no angles past it.
    with pytest.raises(QinferError) as excinfo:
        model(torch.zeros(1, 600, dtype=torch.long))
    assert "512" in error_line(excinfo)


def test_positions_past_the_context_with_a_full_cache(model):
    cache = model.make_cache(1)
    model(torch.zeros(1, 510, dtype=torch.long), cache=cache)
    with pytest.raises(QinferError) as excinfo:
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    assert "512" in error_line(excinfo)


@pytest.mark.parametrize("bad_id", [256, 10_000, -1])
def test_token_id_outside_the_vocabulary(model, bad_id):
    with pytest.raises(QinferError) as excinfo:
        model(torch.tensor([[1, bad_id, 2]]))
    message = error_line(excinfo)
    assert str(bad_id) in message and "255" in message


def test_float_token_ids(model):
    with pytest.raises(QinferError) as excinfo:
        model(torch.tensor([[1.0, 2.0]]))
    assert "float" in error_line(excinfo)


def test_tokens_of_the_wrong_rank(model):
    with pytest.raises(QinferError) as excinfo:
        model(torch.tensor([1, 2, 3]))
    assert "(batch, length)" in error_line(excinfo)


def test_left_padding_of_the_wrong_length(model):
    with pytest.raises(CacheError) as excinfo:
        model.make_cache(2, left_padding=[1, 2, 3])
    assert "left_padding" in error_line(excinfo)


def test_select_of_a_row_the_cache_does_not_have(model):
    cache = model.make_cache(2)
    with pytest.raises(CacheError) as excinfo:
        cache[0].select([0, 2])
    message = error_line(excinfo)
    assert "0..1" in message and "[0, 2]" in message


def test_tokens_with_more_rows_than_the_cache(model):
    cache = model.make_cache(2)
    with pytest.raises(CacheError) as excinfo:
        model(torch.zeros(3, 4, dtype=torch.long), cache=cache)
    message = error_line(excinfo)
    assert "2 batch rows" in message and "3" in message
