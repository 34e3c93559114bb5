"""The mixture-of-experts feed-forward (Qwen3-MoE, Qwen2-MoE): a router picks k of E gated
experts for each token and adds their outputs, weighted by its probabilities.

    probs = softmax(x W_router^T)            (T, E), in fp32
    top, chosen = topk(probs, k)             (T, k); top renormalised to sum 1 if norm_topk_prob
    y[t] = sum_j top[t, j] * expert_{chosen[t, j]}(x[t])
         (+ sigmoid(x[t] w_shared_gate) * shared(x[t]): Qwen2-MoE's shared expert)
    expert_e(x) = down_e(act(gate_e(x)) * up_e(x))   act: hidden_act (SiLU: SwiGLU), as the MLP

Each expert runs only on the tokens routed to it: the T * k (token, expert) pairs are sorted
by expert, the tokens' rows gathered in that order, and each expert's projections applied to
its run of rows by a grouped Linear (`qinfer.linear.grouped`). No shape depends on the
routing and the run lengths stay on the device, so dense experts run without a host sync
(quantized ones wait once per projection for the run lengths: `LoopedLinear`).

Tensor parallelism (`qinfer.core.parallel`): a rank holds moe_intermediate / N channels of every
expert (gate/up rows, down columns), as the dense MLP splits its FFN; the router is
replicated, so every rank routes alike, and the ranks' partial sums are all-reduced once,
after the experts' outputs are combined. A shared expert is split the same way and joins
the same all-reduce. Expert parallelism (ranks holding whole experts) is not implemented.
"""

from __future__ import annotations

import torch

from qinfer.core.forward_batch import AdapterRows
from qinfer.core.model_config import ModelConfig
from qinfer.core.module import Module
from qinfer.core.parallel import SINGLE, Parallel
from qinfer.layers.mlp import GATE_ACTIVATIONS, gate_times_up, gated_ffn_sources
from qinfer.linear import linear
from qinfer.weights.slots import GroupedSlot, LinearSlot, LinearSource, Placed


class SparseMoE(Module, Placed):
    """(*P, hidden) -> (*P, hidden) through the k experts the router picks per token.

    Slots: `router`, the experts' `gate_up` and `down` (grouped), and Qwen2-MoE's
    `shared_gate_up`, `shared_down` and `shared_gate`."""

    def __init__(self, layer_prefix: str, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        hidden, inter, experts = config.hidden_size, moe.moe_intermediate_size, moe.num_experts
        self.num_experts, self.top_k = experts, moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.activation = GATE_ACTIVATIONS[config.wiring.hidden_act]
        self.parallel = SINGLE
        prefix = f"{layer_prefix}.mlp"
        # The router stays dense under quantization (its choices are discrete: a rounded
        # weight could send a token elsewhere) and whole on every rank.
        self.router = LinearSlot(
            LinearSource((f"{prefix}.gate",), ((experts, hidden),), dense=True)
        )
        # Each expert's down leaves its partial sums to `forward`, which adds every
        # expert's and all-reduces once.
        experts_ffn = [
            gated_ffn_sources(
                f"{prefix}.experts.{e}", inter, "expert FFN channels", hidden, reduced=False
            )
            for e in range(experts)
        ]
        self.gate_up = GroupedSlot([gate_up for gate_up, _ in experts_ffn])
        self.down = GroupedSlot([down for _, down in experts_ffn])
        # Qwen2-MoE's shared expert, and its (1, hidden) gate kept dense and whole like the router.
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        shared = moe.shared_expert_intermediate_size
        if shared:
            self.shared_gate_up, self.shared_down = (
                LinearSlot(source)
                for source in gated_ffn_sources(
                    f"{prefix}.shared_expert",
                    shared,
                    "shared expert FFN channels",
                    hidden,
                    reduced=False,
                )
            )
            self.shared_gate = LinearSlot(
                LinearSource((f"{prefix}.shared_expert_gate",), ((1, hidden),), dense=True)
            )

    def place(self, parallel: Parallel, dtype: torch.dtype, device: torch.device) -> None:
        """The group whose ranks' partial sums `forward` adds up."""
        self.parallel = parallel

    @property
    def active_nbytes(self) -> int:
        """Bytes of weights one token reads: the router, its k experts' projections and the
        shared expert."""
        experts = self.gate_up.nbytes + self.down.nbytes
        shared = [self.shared_gate_up, self.shared_down, self.shared_gate]
        shared_bytes = sum(w.nbytes for w in shared if w is not None)
        return self.router.nbytes + experts * self.top_k // self.num_experts + shared_bytes

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (weights (T, k) in x's dtype, experts (T, k) long): each token's
        k most probable experts, most probable first, and the weights of their outputs."""
        probs = linear(x, self.router).softmax(dim=-1, dtype=torch.float32)  # (T, E)
        top, chosen = probs.topk(self.top_k, dim=-1)  # (T, k)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), chosen

    def forward(self, x: torch.Tensor, adapters: AdapterRows | None = None) -> torch.Tensor:
        """x (*P, hidden) -> (*P, hidden), each token through its top k experts. adapters:
        unused (LoRA on experts is refused at load, `qinfer.lora.adapters`)."""
        H = x.shape[-1]
        flat = x.reshape(-1, H)  # (T, hidden)
        top, chosen = self.route(flat)
        # Pair p is token p // k's slot p % k; sorted by expert (stable: by token within one).
        order = chosen.flatten().argsort(stable=True)  # (T * k,)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, chosen.flatten(), torch.ones_like(order))  # (E,) pairs each
        routed = flat.index_select(0, order // self.top_k)  # (T * k, hidden), by expert
        gated = gate_times_up(self.gate_up(routed, counts), self.activation)  # (T * k, inter / N)
        out = self.down(gated, counts)  # (T * k, hidden) by expert
        # Back in pair order, then each token's k outputs weighted and added in slot order
        # (not with index_add_, whose atomic adds on GPUs sum in no fixed order).
        out = torch.empty_like(out).index_copy_(0, order, out).view(-1, self.top_k, H)
        mixed = (out * top[..., None]).sum(dim=1)  # (T, hidden): this rank's partial sum
        if self.shared_gate is not None:
            gated = gate_times_up(
                linear(flat, self.shared_gate_up), self.activation
            )  # (T, shared / N)
            shared = linear(gated, self.shared_down)  # (T, hidden), partial sum
            mixed = mixed + torch.sigmoid(linear(flat, self.shared_gate)) * shared
        return self.parallel.all_reduce_sum(mixed).view(x.shape)
