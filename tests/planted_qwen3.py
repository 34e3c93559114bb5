"""A random Qwen3 or Qwen3.5 checkpoint that answers a chat as a thinking model would, for
server tests.

The checkpoint is random except for one planted path, so that a chat can be checked for
its reasoning without a trained model: after "\\n" (where every chat prompt ends) the
model always writes `<think>The answer</think>\\n\\nHello<|im_end|>` (a Qwen3 thinking
reply), and after the "\\n\\n" that closes Qwen3's empty think block
(`enable_thinking=False`) it writes `Hello<|im_end|>`. Anywhere else it writes random
text and, in practice, never stops before max_tokens.

`build_planted_qwen3(folder, tool_loop=True)` plants an agent's two-tool loop on top
(`plant_tool_loop`): offered `WEATHER_TOOL` (its description is the cue), the model thinks
as above and then calls get_weather; once get_weather's result is in the conversation it
calls get_time; once get_time's is too, it answers `LOOP_ANSWER`. Without the tool it
answers "Hello" as before.

`family="qwen3_5"` plants the same on a Qwen3.5 (Gated DeltaNet layers and gated full
attention, `PLANTED["qwen3_5"]`) with Qwen3.5's chat template: its generation prompt opens
`<think>\\n` itself, so the path starts inside the block (`The answer</think>...`), and its
calls are XML (`<function=get_weather>` ...) instead of Qwen3's JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
from checkpoints import HYBRID, build_checkpoint
from text_assets import (
    CHATML_SPECIAL,
    QWEN3_ADDED,
    save_qwen3_5_tokenizer,
    save_qwen3_tokenizer,
    train_tokenizer,
)

#: What the planted model thinks, then answers, greedily after a chat prompt.
PLANTED_REASONING, PLANTED_ANSWER = "The answer", "Hello"

#: The tools of the planted loop: (name, description); the weather tool's description
#: (one token) is what tells the model that tools are offered.
WEATHER_TOOL = ("get_weather", "Look up the weather in a city.")
TIME_TOOL = ("get_time", "Look up the local time in a city.")
#: The calls the loop makes, in order, as (name, arguments); the results its tools must
#: return (each one token, the cue for the next step); its final answer.
LOOP_CALLS = (("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris"}))
LOOP_RESULTS = ("Sunny, 22 degrees.", "It is 10:30.")
LOOP_ANSWER = "Paris is sunny at 10:30."


def hermes_call(name: str, arguments: dict) -> str:
    """Qwen3's call between `<tool_call>` and `</tool_call>`: JSON on a line of its own."""
    return f"\n{json.dumps({'name': name, 'arguments': arguments})}\n"


def xml_call(name: str, arguments: dict) -> str:
    """Qwen3.5's call between `<tool_call>` and `</tool_call>`, as its template writes one."""
    parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"\n<function={name}>\n{parameters}</function>\n"


@dataclass(frozen=True)
class Planted:
    """What sets one family's planted checkpoint apart; the planting itself is shared."""

    family: str  # build_checkpoint's
    shape: dict  # build_checkpoint's overrides
    save_tokenizer: Callable[[Path, tokenizers.Tokenizer], tokenizers.Tokenizer]
    call_text: Callable[[str, dict], str]  # a call's text inside its tags (one token)
    prompt_opens_think: bool  # the generation prompt ends in `<think>\n`
    norm_offset: float  # the RMSNorms scale by norm_offset + weight
    # plant_path's: random embeddings of std ~0.57 after it (a hybrid checkpoint's are
    # spread_weights', of std 1/(2 sqrt(hidden)): 2.2 times a Qwen3's)
    embed_scale: float


PLANTED = {
    "qwen3": Planted("qwen3", {}, save_qwen3_tokenizer, hermes_call, False, 0.0, 20.0),
    "qwen3_5": Planted(
        "qwen3_5", HYBRID["qwen3_5"], save_qwen3_5_tokenizer, xml_call, True, 1.0, 9.0
    ),
}


def plant_path(model, path: list[int], embed_scale: float = 20.0) -> None:
    """Make `model` (a transformers Qwen3 or Qwen3.5 with untied head) follow `path` token
    by token.

    Hidden dimension k carries "the current token is path[k]": only that token's
    embedding has it, and only the head row of path[k + 1] reads it. The embeddings are
    scaled up (by `embed_scale`) so the random layers barely move the residual stream. One more dimension,
    present in every embedding, pushes the path's tokens (EOS last among them) down
    everywhere else, so random text does not stumble into the path or stop.
    """
    steps, bias_dim = len(path) - 1, len(path) - 1
    with torch.no_grad():
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.mul_(embed_scale)
        embed[:, : steps + 1] = 0
        embed[:, bias_dim] = 5.0
        for token in path:
            head[token] = 0
            head[token, bias_dim] = -1.0
        for k, (current, following) in enumerate(zip(path, path[1:], strict=False)):
            embed[current, k] = 10.0
            head[following, k] = 4.0


def plant_tool_loop(
    model,
    branch_dim: int,
    bias_dim: int,
    first_dim: int,
    tokens: dict[str, int | tuple[int, ...]],
    norm_offset: float = 0.0,
) -> None:
    """Plant the tool loop (module docstring) on a model `plant_path` planted, in the
    hidden dimensions from `first_dim` on; its path's token at dimension `branch_dim` (the
    "\\n\\n" that ends the think block) is where the reply branches; the model's RMSNorms
    scale by `norm_offset` + weight.

    tokens: "open", "close" (the call tags), "calls" (each call's text, one token each),
    "answer", "eos", "cues" (the weather tool's description, then each result).

    One attention head of the first full-attention layer finds the cues in view. Its query
    is the same at every position (it reads the bias dimension), its key is nonzero only on
    a cue (the layers below write nothing into the cues' dimensions), so it attends evenly
    to the cues in view and to nothing else (nothing: no output). Its value writes two
    dimensions, as averages over the cues: "call" (+1, +1, -5: 1 with one or two cues, -1
    with all three) and "which" (+1, -3, 0: 1 with one cue, -1 with two). After the branch
    token, the call tag reads +call and the answer -call, each a little below the path's
    own "Hello" otherwise; after the call tag, the first call reads +which and the second
    -which. Query and key sit in a dimension RoPE turns by a fraction of a radian across
    the context at most: the slowest pair's, or one it leaves alone (partial rotary).
    """
    open_, close, answer, eos = (tokens[k] for k in ("open", "close", "answer", "eos"))
    calls, cues = tokens["calls"], tokens["cues"]
    stepping = [open_, *calls, close, answer]  # the tokens that get a "current token" dim
    dim = {token: first_dim + i for i, token in enumerate(stepping)}
    cue_dims = [first_dim + len(stepping) + i for i in range(len(cues))]
    call_dim, which_dim = cue_dims[-1] + 1, cue_dims[-1] + 2
    layers = model.model.layers
    below = next(i for i, layer in enumerate(layers) if hasattr(layer, "self_attn"))
    attn = layers[below].self_attn
    head_dim = attn.head_dim
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    rotated = 2 * model.model.rotary_emb.inv_freq.numel()  # the head dims RoPE turns
    slow = head_dim - 1 if rotated < head_dim else head_dim // 2 - 1
    # Qwen3.5's gated attention: each head's q_proj rows are its query, then its output
    # gate; a zero gate halves the head's output (sigmoid(0)).
    gated = attn.q_proj.out_features == 2 * attn.o_proj.in_features
    gate = 0.5 if gated else 1.0
    # How much "call" and "which" tip their branches, and how far below the path's own
    # successor the branch to the call tag or the answer lies (the margins stay ~10 logits).
    tip_call, tip_which, lower = 6.0, 2.0, 3.0
    with torch.no_grad():
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed[:, first_dim : which_dim + 1] = 0
        for token, d in dim.items():
            embed[token, d] = 10.0
        for token, d in zip(cues, cue_dims, strict=True):
            embed[token, d] = 10.0
        for token in stepping:  # pushed down everywhere off the loop, as the path's are
            head[token] = 0
            head[token, bias_dim] = -1.0
        for token, following in [*((c, close) for c in calls), (close, eos), (answer, eos)]:
            head[following, dim[token]] = 4.0
        for token, sign in ((open_, 1.0), (answer, -1.0)):
            head[token, branch_dim], head[token, call_dim] = 4.0, sign * tip_call
            head[token, bias_dim] = -1.0 - lower
        for token, sign in zip(calls, (1.0, -1.0), strict=True):
            head[token, dim[open_]], head[token, which_dim] = 4.0, sign * tip_which
        # Head 0 (and kv head 0, shared by the first `group` heads) finds the cues.
        attn.q_proj.weight[: head_dim * (2 if gated else 1)] = 0
        for proj in (attn.k_proj, attn.v_proj):
            proj.weight[:head_dim] = 0
        attn.q_proj.weight[slow, bias_dim] = 1.0
        attn.k_proj.weight[slow, cue_dims] = 1.0
        # The value reads each cue at unit scale, whatever the layer's input norm scales it by.
        unit = 1 / (norm_offset + layers[below].input_layernorm.weight[cue_dims])
        attn.v_proj.weight[0, cue_dims] = torch.tensor([1.0, 1.0, -5.0]) * unit
        attn.v_proj.weight[1, cue_dims] = torch.tensor([1.0, -3.0, 0.0]) * unit
        attn.q_norm.weight[slow] = attn.k_norm.weight[slow] = 2.0 - norm_offset
        for i, layer in enumerate(layers):  # only that head writes the two dimensions
            written = [call_dim, which_dim, *(cue_dims if i < below else ())]
            mixer = getattr(layer, "self_attn", None)
            mixer_out = layer.linear_attn.out_proj if mixer is None else mixer.o_proj
            mixer_out.weight[written] = 0
            layer.mlp.down_proj.weight[written] = 0
        attn.o_proj.weight[:, : group * head_dim] = 0
        attn.o_proj.weight[call_dim, 0] = attn.o_proj.weight[which_dim, 1] = 0.75 / gate


def build_planted_qwen3(
    folder: Path,
    tool_loop: bool = False,
    family: str = "qwen3",
    call_in_think: bool = False,
    **overrides,
) -> Path:
    """Save the planted `family` (module docstring; "qwen3" or "qwen3_5") with its
    tokenizer and chat template to `folder`; tool_loop: plant the tool loop too;
    call_in_think: the planted reasoning makes the loop's first call before it closes
    (`The answer<tool_call>CALL</tool_call></think>`, as Qwen3.5 sometimes does);
    `overrides` shape its config (max_position_embeddings for long prompts)."""
    planted = PLANTED[family]
    backend = train_tokenizer(CHATML_SPECIAL, QWEN3_ADDED)
    # "\n\n" as one token tells the end of an empty think block from a lone "\n".
    backend.add_tokens([tokenizers.AddedToken("\n\n", special=False, normalized=False)])
    calls = [planted.call_text(name, args) for name, args in LOOP_CALLS]
    loop_texts = [WEATHER_TOOL[1], *LOOP_RESULTS, *calls, LOOP_ANSWER]
    if tool_loop or call_in_think:  # each one token: the cues the head finds, whole calls
        backend.add_tokens(
            [tokenizers.AddedToken(text, special=False, normalized=False) for text in loop_texts]
        )
    im_end = backend.token_to_id("<|im_end|>")
    planted.save_tokenizer(folder, backend)
    model = build_checkpoint(
        folder,
        planted.family,
        **planted.shape,
        vocab_size=backend.get_vocab_size(),
        tie_word_embeddings=False,
        eos_token_id=im_end,
        **overrides,
    )

    def ids(text: str) -> list[int]:
        return backend.encode(text, add_special_tokens=False).ids

    in_think = f"<tool_call>{calls[0]}</tool_call>" if call_in_think else ""
    opened = "" if planted.prompt_opens_think else "<think>"
    think = ids(f"{opened}{PLANTED_REASONING}{in_think}</think>")
    path = [*ids("\n"), *think, *ids(f"\n\n{PLANTED_ANSWER}"), im_end]
    plant_path(model, path, planted.embed_scale)
    if tool_loop:
        (branch,) = ids("\n\n")
        tokens = {
            "open": backend.token_to_id("<tool_call>"),
            "close": backend.token_to_id("</tool_call>"),
            "calls": tuple(backend.token_to_id(call) for call in calls),
            "answer": backend.token_to_id(LOOP_ANSWER),
            "eos": im_end,
            "cues": tuple(backend.token_to_id(cue) for cue in [WEATHER_TOOL[1], *LOOP_RESULTS]),
        }
        bias_dim = len(path) - 1
        first_dim = bias_dim + 1
        plant_tool_loop(model, path.index(branch), bias_dim, first_dim, tokens, planted.norm_offset)
    model.save_pretrained(folder)
    return folder
