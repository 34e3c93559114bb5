"""The prefix cache's disk tier (`qinfer.engine.disk_cache`): a restarted engine reads a
prompt's K/V blocks from disk instead of computing them, and generates what the cold
engine did; bad files (a flipped byte, a truncated file, another model's) are ignored with
one warning each; the directory stays under its size, oldest blocks removed first; engines
sharing a directory read each other's blocks; `qinfer serve` counts the tokens read; a
hybrid model (Qwen3.5) reads the state after a prompt's blocks with them, or nothing.

Every engine here runs a tiny random Qwen3 (or Qwen3.5) in float32 on blocks of 8 tokens.
"""

import logging
import shutil

import httpx
import pytest
import torch
from checkpoints import QWEN3_5, random_model
from servers import metric_values, serving

import qinfer
from qinfer.core.errors import QinferError
from qinfer.engine import LLM
from qinfer.engine.sequence import Sequence
from qinfer.request.sampling import SamplingParams

pytestmark = pytest.mark.slow  # two `qinfer serve` start-ups

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6, logprobs=2)
BLOCK = 8
PROMPT = [(7 * i) % 200 + 20 for i in range(61)]  # 61 tokens: 7 full blocks before its last


@pytest.fixture(scope="module")
def model(qwen3_chat_folder):
    return qinfer.load_model(qwen3_chat_folder, dtype=torch.float32, device="cpu")


def make_llm(model, directory, **engine_args) -> LLM:
    return LLM(model, None, block_size=BLOCK, prompt_cache_dir=directory, **engine_args)


def run(llm: LLM, prompt=PROMPT, params=GREEDY):
    return llm.generate([prompt], params, use_tqdm=False)[0]


def logprobs(output) -> list:
    return [(entry.logprob, entry.top_logprobs) for entry in output.logprobs]


def block_files(llm: LLM, prompt=PROMPT):
    """The files that would hold prompt's full blocks (all but its last token's), in order."""
    disk = llm.engine.disk_cache
    names = disk.digests(Sequence("probe", prompt), (len(prompt) - 1) // BLOCK, BLOCK)
    return [disk.folder / f"{digest}.kvb" for digest, _ in names]


def cold_then_cached(model, directory, **engine_args):
    """(cold output, output of a prefix-cache hit in memory) of one engine, closed after
    (its blocks written)."""
    llm = make_llm(model, directory, **engine_args)
    cold, warm = run(llm), run(llm)
    llm.close()
    assert all(path.exists() for path in block_files(llm))
    return cold, warm


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("backends", [("paged", "paged"), ("gathered", "paged")])
def test_a_restarted_engine_reads_the_prompt_from_disk(
    qwen3_chat_folder, tmp_path, kv_cache_dtype, backends
):
    model = qinfer.load_model(
        qwen3_chat_folder, dtype=torch.float32, device="cpu", kv_cache_dtype=kv_cache_dtype
    )
    writer, reader = backends
    cold, warm = cold_then_cached(model, tmp_path, attention_backend=writer)
    llm = make_llm(model, tmp_path, attention_backend=reader)
    restarted = run(llm)
    stats = llm.engine.stats()
    assert stats.prompt_tokens_from_disk_total == 56  # 7 blocks read
    assert stats.prompt_tokens_computed_total == len(PROMPT) - 56
    assert restarted.num_cached_tokens == 56
    assert restarted.token_ids == cold.token_ids == warm.token_ids
    if writer == reader:  # the same K/V as the memory hit: the same logits, bit for bit
        assert logprobs(restarted) == logprobs(warm)
    again = run(llm)  # now in memory: nothing more read
    assert llm.engine.stats().prompt_tokens_from_disk_total == 56
    assert again.token_ids == cold.token_ids
    llm.close()


def test_a_longer_prompt_reads_the_shared_blocks_and_computes_the_rest(model, tmp_path):
    cold, _ = cold_then_cached(model, tmp_path)
    llm = make_llm(model, tmp_path)
    longer = PROMPT + [5, 6, 7] * 10
    output = run(llm, longer)
    stats = llm.engine.stats()
    assert stats.prompt_tokens_from_disk_total == 56
    assert stats.prompt_tokens_computed_total == len(longer) - 56
    fresh = LLM(model, None, block_size=BLOCK)  # no disk tier
    assert output.token_ids == run(fresh, longer).token_ids
    llm.close()


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10  # in the payload
    path.write_bytes(bytes(data))


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def run_warned_once(llm: LLM, caplog, bad, why: str):
    """run(llm), which must log one warning: that `bad` is ignored, and why."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qinfer.engine.disk_cache"):
        output = run(llm)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(bad) in warnings[0] and why in warnings[0], warnings
    return output


@pytest.mark.parametrize(
    ("damage", "why"),
    [(flip_a_byte, "checksum"), (truncate, "payload has"), (None, "another model")],
)
def test_a_bad_block_file_is_ignored_with_one_warning(model, tmp_path, caplog, damage, why):
    cold, _ = cold_then_cached(model, tmp_path)
    llm = make_llm(model, tmp_path)
    bad = block_files(llm)[3]
    if damage is None:  # another model's block under this one's name
        other = make_llm(random_model("qwen3", seed=5), tmp_path)
        run(other)
        other.close()
        shutil.copyfile(block_files(other)[3], bad)
    else:
        damage(bad)
    output = run_warned_once(llm, caplog, bad, why)
    assert llm.engine.stats().prompt_tokens_from_disk_total == 3 * BLOCK  # blocks 0..2
    assert output.token_ids == cold.token_ids
    llm.close()
    assert bad.exists()  # removed, then written again from the blocks computed


def test_another_models_directory_is_named_once_and_never_read(model, tmp_path, caplog):
    other = make_llm(random_model("qwen3", seed=5), tmp_path)
    run(other)
    other.close()
    with caplog.at_level(logging.WARNING, logger="qinfer.engine.disk_cache"):
        llm = make_llm(model, tmp_path)
    assert [r.getMessage() for r in caplog.records if "other model" in r.getMessage()]
    output = run(llm)
    assert llm.engine.stats().prompt_tokens_from_disk_total == 0
    assert output.token_ids == run(LLM(model, None, block_size=BLOCK)).token_ids
    llm.close()


def test_the_directory_stays_under_its_size_oldest_blocks_removed_first(model, tmp_path):
    measure = make_llm(model, tmp_path / "measure")
    run(measure)
    measure.close()
    file_bytes = block_files(measure)[0].stat().st_size
    prompts = [[p + k for p in PROMPT[:41]] for k in range(3)]  # 5 full blocks each
    limit = 7 * file_bytes
    llm = make_llm(model, tmp_path / "bounded", prompt_cache_size=limit)
    for prompt in prompts:
        run(llm, prompt, GREEDY.replace(max_tokens=1))
        llm.engine.disk_cache.flush()
    llm.close()
    files = list((tmp_path / "bounded").rglob("*.kvb"))
    assert sum(path.stat().st_size for path in files) <= limit
    assert all(path.exists() for path in block_files(llm, prompts[2]))
    assert not any(path.exists() for path in block_files(llm, prompts[0]))


def test_a_flush_removes_the_models_files_and_leaves_other_models(model, tmp_path):
    """`/flush_cache`'s flush empties the disk tier of this model too (its files removed,
    counted; another model's folder untouched), so the next run computes the prompt."""
    other = tmp_path / "another-model"
    other.mkdir()
    (other / "kept.kvb").write_bytes(b"not ours")
    llm = make_llm(model, tmp_path)
    cold = run(llm)
    llm.engine.disk_cache.flush()
    assert all(path.exists() for path in block_files(llm))
    flush = llm.engine.block_manager.flush_prefix_cache()
    # the prompt and its 6 generated tokens fill 8 blocks of 8 positions
    assert flush.dropped_disk_blocks == 8 and flush.dropped_blocks == 8
    assert not any(path.exists() for path in block_files(llm))
    assert (other / "kept.kvb").exists()
    again = run(llm)
    stats = llm.engine.stats()
    assert again.num_cached_tokens == 0 and stats.prompt_tokens_from_disk_total == 0
    assert again.token_ids == cold.token_ids
    llm.close()


def test_two_engines_sharing_a_directory_read_each_others_blocks(model, tmp_path):
    first, second = make_llm(model, tmp_path), make_llm(model, tmp_path)
    other = [p + 1 for p in PROMPT]
    a = run(first)
    first.engine.disk_cache.flush()
    b = run(second, other)
    second.engine.disk_cache.flush()
    assert run(second).token_ids == a.token_ids
    assert run(first, other).token_ids == b.token_ids
    for llm in (first, second):
        assert llm.engine.stats().prompt_tokens_from_disk_total == 56
        llm.close()


def test_a_directory_that_cannot_be_written_is_refused_naming_the_flag(model, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(QinferError, match=r"^--prompt-cache-dir .*a-file/cache: cannot write"):
        make_llm(model, blocker / "cache")


@pytest.fixture(scope="module")
def hybrid():
    return random_model("qwen3_5", **QWEN3_5)


def state_file(llm: LLM, blocks: int, prompt=PROMPT):
    """The file that would hold the state after prompt's first `blocks` blocks."""
    disk = llm.engine.disk_cache
    digest, _ = disk.digests(Sequence("probe", prompt), blocks, BLOCK)[-1]
    return disk.folder / f"{digest}.kvs"


def test_a_restarted_hybrid_engine_reads_the_prompt_and_its_state_from_disk(hybrid, tmp_path):
    """Qwen3.5 (Gated DeltaNet + attention): the snapshot of the state after the prompt's
    last full block is written beside that block; a restarted engine reads the 7 blocks and
    the state, and gives the memory hit's logits, bit for bit. A flush removes it too."""
    cold, warm = cold_then_cached(hybrid, tmp_path)
    assert warm.num_cached_tokens == 56
    llm = make_llm(hybrid, tmp_path)
    assert state_file(llm, 7).exists()
    assert not any(state_file(llm, n).exists() for n in range(1, 7))  # no snapshot there
    restarted = run(llm)
    stats = llm.engine.stats()
    assert stats.prompt_tokens_from_disk_total == 56
    assert stats.prompt_tokens_computed_total == len(PROMPT) - 56
    assert restarted.num_cached_tokens == 56
    assert restarted.token_ids == cold.token_ids
    assert logprobs(restarted) == logprobs(warm)
    longer = PROMPT + [5, 6, 7] * 10  # shares the 7 blocks, and the state after them
    reader = make_llm(hybrid, tmp_path)
    output = run(reader, longer)
    reader.close()
    assert output.num_cached_tokens == 56
    assert output.token_ids == run(LLM(hybrid, None, block_size=BLOCK), longer).token_ids
    llm.engine.disk_cache.flush()
    files = list(llm.engine.disk_cache.folder.iterdir())
    assert llm.engine.block_manager.flush_prefix_cache().dropped_disk_blocks == len(files)
    assert {path.suffix for path in files} == {".kvb", ".kvs"}
    assert not any(llm.engine.disk_cache.folder.iterdir())
    llm.close()


@pytest.mark.parametrize("state", [True, False], ids=["state", "block"])
def test_a_hybrid_hit_without_its_state_or_blocks_reads_nothing(hybrid, tmp_path, caplog, state):
    """A bad state file, or a bad block before it: one warning naming the file, nothing
    read (a hybrid hit needs the state at its end, after every block), the cold tokens;
    the run writes the file again."""
    cold, _ = cold_then_cached(hybrid, tmp_path)
    llm = make_llm(hybrid, tmp_path)
    bad = state_file(llm, 7) if state else block_files(llm)[3]
    flip_a_byte(bad)
    output = run_warned_once(llm, caplog, bad, "checksum")
    stats = llm.engine.stats()
    assert stats.prompt_tokens_from_disk_total == 0 and output.num_cached_tokens == 0
    assert output.token_ids == cold.token_ids
    llm.close()
    assert bad.exists()


def test_a_restarted_server_counts_the_prompt_tokens_it_read_from_disk(qwen3_chat_folder, tmp_path):
    flags = ["--model", str(qwen3_chat_folder), "--dtype", "float32", "--block-size", "8"]
    flags += ["--prompt-cache-dir", str(tmp_path), "--prompt-cache-size", "1GB"]
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    texts = []
    for _ in range(2):  # a start, then a restart on the same directory
        with serving(*flags) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            body["model"] = http.get("/v1/models").json()["data"][0]["id"]
            texts.append(http.post("/v1/completions", json=body).json()["choices"][0]["text"])
            metrics = metric_values(http)
            loads = http.get("/v1/loads").json()["loads"][0]
    assert texts[0] == texts[1]
    assert metrics["qinfer_prompt_tokens_from_disk_total"] == 56
    assert metrics["qinfer_prompt_tokens_computed_total"] == len(PROMPT) - 56
    assert loads["prompt_tokens_from_disk"] == 56
