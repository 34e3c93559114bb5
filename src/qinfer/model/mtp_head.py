"""A Qwen3.5 / Qwen3.6 checkpoint's multi-token-prediction (MTP) head: the next-but-one token.

The checkpoint's `mtp.*` tensors (llama.cpp's converter writes them as the extra block
`blk.<num_hidden_layers>`, its `nextn.*` tensors and that block's own attention and FFN:
`qinfer.weights.gguf`) hold one more decoder layer that, at position i, reads the model's
final-normed hidden state h_i and the embedding of the token at i + 1, and predicts the
token at i + 2:

    x   = fc(cat(pre_fc_norm_embedding(embed(t[i+1])), pre_fc_norm_hidden(h_i)))  (T, 2H) -> (T, H)
    x   = the layer: gated full attention over the head's own K/V of positions 0 .. i
          (RoPE at position i), then the MLP, each with its residual
    g_i = norm(x)                  its own final norm
    logits = lm_head(g_i)          the model's head, shared (as is the embedding)

Chained for a second guess, g_i takes the place of h at position i + 1, with the first
guess as the token. All norms are zero-centred (1 + w) like the model's.

The head is a `Transformer` of one full-attention layer (`mtp_config`), so that an engine
runner (`qinfer.runtime.runner.ModelRunner`) keeps its K/V in a paged pool and plans its
steps; its embedding and head are the target's, passed to each call rather than held (a
second copy of the vocabulary's tables would double the largest tensors).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from qinfer.core.errors import QinferError
from qinfer.core.features import Features
from qinfer.core.forward_batch import ForwardBatch
from qinfer.core.model_config import FULL_ATTENTION, ModelConfig
from qinfer.core.parallel import Parallel
from qinfer.layers.norm import rms_norm
from qinfer.model.transformer import Block, Transformer
from qinfer.weights.base import Quantize, Weights
from qinfer.weights.load import load
from qinfer.weights.slots import LinearSlot, LinearSource

#: The tensor every MTP head holds: its absence says the checkpoint has no head.
FC = "mtp.fc"


def mtp_config(config: ModelConfig) -> ModelConfig:
    """The target's config cut to the head's one full-attention layer (no DeltaNet; a
    mixture of experts' MLP where the target's layers have one, Qwen3.5-MoE's)."""
    return dataclasses.replace(
        config, num_hidden_layers=1, layer_types=(FULL_ATTENTION,), deltanet=None
    )


class MtpHead(Transformer):
    """The MTP layer and its norms, built empty from the target's config (`load_mtp_head`
    fills it; `MtpHead.random(config)` with random weights)."""

    def __init__(self, config: ModelConfig, features: Features | None = None):
        head_config = mtp_config(config)
        super().__init__(head_config, features)
        H = config.hidden_size
        # the target's own: passed to each call (see the module docstring)
        self.embed_tokens = self.lm_head = None
        self.layers = nn.ModuleList([Block(0, head_config, self.features, prefix="mtp.layers.0")])
        self.norm = rms_norm("mtp.norm.weight", H, head_config)
        self.pre_fc_norm_embedding = rms_norm("mtp.pre_fc_norm_embedding.weight", H, head_config)
        self.pre_fc_norm_hidden = rms_norm("mtp.pre_fc_norm_hidden.weight", H, head_config)
        self.fc = LinearSlot(LinearSource((FC,), ((H, 2 * H),)))

    def place(self, parallel: Parallel, dtype: torch.dtype, device: torch.device) -> None:
        super().place(parallel, dtype, device)
        for norm in (self.pre_fc_norm_embedding, self.pre_fc_norm_hidden):
            norm.out_dtype = dtype  # into fc, in the compute dtype

    @torch.inference_mode()
    def hidden(self, batch: ForwardBatch, h: torch.Tensor, target: Transformer) -> torch.Tensor:
        """The head's final-normed output g (T, hidden) fp32 for the batch's tokens (the
        token at i + 1 at position i) and h (T, hidden) fp32, the target's final-normed
        hidden state at each position (or a previous g); writes the layer's K/V."""
        e = self.pre_fc_norm_embedding(target.embed(batch.token_ids))  # (T, H)
        x = torch.cat([e, self.pre_fc_norm_hidden(h)], dim=-1)  # (T, 2H)
        x = self.fc(x).float()  # (T, H): the layer's residual stream, fp32
        return self.norm(self.layers[0](x, batch))

    def logits(self, g: torch.Tensor, target: Transformer) -> torch.Tensor:
        """g (R, hidden) from `hidden` -> fp32 logits (R, vocab) through the target's head."""
        return target.lm_head.logits(g, self.dtype)


def load_mtp_head(
    config: ModelConfig,
    weights: Weights,
    features: Features | None,
    quantize: Quantize | None,
    path: str | Path,
) -> MtpHead:
    """The MTP head of the checkpoint `weights` at `path` (of the model of `config`), or one
    error naming the tensor it lacks."""
    head = MtpHead(config, features)
    if f"{FC}.weight" not in weights.names():
        raise QinferError(
            f"speculative method 'mtp': {path} holds no MTP head "
            f"(no tensor '{FC}.weight'; a GGUF file needs its nextn tensors: convert without "
            "--no-mtp)"
        )
    return load(head, weights, None, quantize, features)
