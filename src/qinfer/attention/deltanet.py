"""The gated delta rule in plain torch: what a Gated DeltaNet layer computes over its state.

Per value head, with a state S (d_k, d_v) in fp32, a token's L2-normalised key k and query q
(q also scaled by d_k^-0.5), its value v, decay g <= 0 (log space) and write strength beta:

    S_t = exp(g_t) S_{t-1} + k_t (x) beta_t (v_t - S_{t-1}^T k_t exp(g_t))
    o_t = S_t^T q_t

Two forms compute it: `recurrent_gated_delta_rule`, token by token (decode), and
`chunked_gated_delta_rule`, which turns each chunk of C tokens into a few (C x C) and
(C x d) matmuls and carries S from chunk to chunk (prompts). They agree to fp32 rounding,
and each agrees with transformers' `torch_recurrent_gated_delta_rule` /
`torch_chunk_gated_delta_rule` (tests/test_deltanet.py). Their compiled CPU twins,
`kernels.gated_delta_recurrent` and `kernels.gated_delta_chunked`, are what the layer runs
where the kernels are in use (`layers.gated_deltanet.gated_delta_rule`); these stay the
reference and the path with `QINFER_CPU_KERNELS=off`.

`causal_conv1d` is the short causal depthwise convolution before the rule, with the rolling
window of the last K - 1 inputs a sequence keeps between steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Tokens per chunk of the chunked form: 32, measured fastest at Qwen3.5-0.8B's shapes on
#: our CPUs (docs/BENCHMARKS.md, bench/deltanet_times.py; transformers and the FLA kernels
#: take 64). Any size gives the same values to fp32 rounding; longer chunks also reach
#: exp(G) in fp32's denormals sooner (G sums a chunk's decays), which multiply slowly.
CHUNK_SIZE = 32


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x (..., D) / sqrt(sum(x^2) + eps), in fp32 (the FLA library's and transformers' eps)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(causal depthwise conv) of x over the sequence, continuing from `window`.

    x (B, L, C): L new inputs of C channels; weight (C, K); window (B, K - 1, C): the last
    K - 1 inputs before these (zeros for a new sequence). Returns (out (B, L, C) in x's
    dtype, the new window (B, K - 1, C): the last K - 1 of window and x together).

    Token-major, as the projections write it and the rule reads it: the K taps are K
    multiply-adds over whole (B, L, C) slices, tap 0 first, each vectorised along the
    channels. (torch's depthwise `conv1d`, groups = C, wants channel-major rows and takes
    one channel at a time on CPU: its transposes and the conv cost several times more.)
    """
    C, K = weight.shape
    L = x.shape[1]
    joined = torch.cat((window.to(x.dtype), x), dim=1)  # (B, K - 1 + L, C)
    taps = weight.to(x.dtype).t()  # (K, C): tap j of every channel
    out = joined[:, :L] * taps[0]
    for j in range(1, K):
        out.addcmul_(joined[:, j : j + L], taps[j])
    return F.silu(out), joined[:, joined.shape[1] - (K - 1) :]


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token.

    q, k (B, L, H, Dk), L2-normalised; v (B, L, H, Dv); g, beta (B, L, H); state
    (B, H, Dk, Dv) fp32 contiguous, the state before these tokens, overwritten with the
    state after them (the caller's own copy: a layer gathers its sequences' slots anyway).
    Returns (o (B, L, H, Dv) fp32, state).

    A token reads the state once and writes it once, in place (decode is bound by the
    state's bytes: 1 MiB a layer for Qwen3.5-0.8B): with a = exp(g_t) and S the state
    before the token, k^T S and q^T S come from one batched matmul, then
        delta = beta (v - a k^T S),   o = a q^T S + (q . k) delta,   S <- a S + k delta^T
    (o = q^T S_t, expanded).
    """
    B, L, H, Dk = k.shape
    Dv = v.shape[-1]
    q = q.float() * Dk**-0.5
    k, v, beta = k.float(), v.float(), beta.float()
    decay = g.float().exp()  # (B, L, H)
    S = state.view(B * H, Dk, Dv)
    out = torch.empty(B, L, H, Dv, dtype=torch.float32, device=q.device)
    for t in range(L):
        kq = torch.stack((k[:, t], q[:, t]), dim=2).view(B * H, 2, Dk)
        kS, qS = torch.bmm(kq, S).unbind(1)  # (B H, Dv) each
        a = decay[:, t].reshape(B * H, 1)
        delta = (v[:, t].reshape(B * H, Dv) - a * kS) * beta[:, t].reshape(B * H, 1)
        qk = (q[:, t] * k[:, t]).sum(-1).reshape(B * H, 1)
        out[:, t] = (a * qS + qk * delta).view(B, H, Dv)
        S.mul_(a[:, :, None]).baddbmm_(k[:, t].reshape(B * H, Dk, 1), delta[:, None])
    return out, state


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule a chunk of C tokens at a time; the arguments and results of
    `recurrent_gated_delta_rule` (`state` overwritten alike).

    Within a chunk, with G the cumulative decay (G_i = g_1 + ... + g_i) and
    D_ij = exp(G_i - G_j) for j <= i (0 above the diagonal), the delta rule's corrections
    U solve the unit lower-triangular system (I + tril(diag(beta) K K^T * D, -1)) U =
    diag(beta) (V - exp(G) K S_0 ...), which splits into two solves independent of S_0:
        U = T^-1 diag(beta) V,   W = T^-1 diag(beta exp(G)) K
    then, per chunk in order:
        V' = U - W S_0                               corrections given the chunk's start state
        O  = (exp(G) Q) S_0 + (Q K^T * D) V'         start state's reading + the chunk's own
        S  = exp(G_C) S_0 + (exp(G_C - G) K)^T V'    state at the chunk's end
    Padded tail tokens (g = 0, beta = 0) neither decay nor write the state.

    Layout: chunk-major, (N, B H, C, D), so that a chunk's operands are contiguous; the
    two solves are one (their right-hand sides side by side), and the per-chunk steps
    write into their outputs (`baddbmm`), allocating nothing.
    """
    B, L, H, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk_size
    pad = -L % C
    N = (L + pad) // C

    def chunked(x: torch.Tensor) -> torch.Tensor:
        """(B, L, H, ...) -> (N, B H, C, ...) fp32, the tail padded with zeros."""
        x = F.pad(x.float(), (0, 0) * (x.dim() - 3) + (0, 0, 0, pad))  # (B, N C, H, ...)
        x = x.reshape(B, N, C, H, *x.shape[3:]).movedim(3, 1)  # (B, H, N, C, ...)
        return x.reshape(B * H, N, C, *x.shape[4:]).transpose(0, 1).contiguous()

    q, k, v = chunked(q * Dk**-0.5), chunked(k), chunked(v)  # (N, B H, C, D)
    beta = chunked(beta)[..., None]  # (N, B H, C, 1)
    G = chunked(g).cumsum(dim=-1)  # (N, B H, C): cumulative decay within the chunk
    above = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    D = (G[..., :, None] - G[..., None, :]).masked_fill(above, float("-inf")).exp()  # (.., C, C)

    # T = I + the strictly lower part of diag(beta) K K^T * D; solved once for every chunk,
    # for U and W together.
    system = ((beta * k) @ k.transpose(-1, -2) * D).tril(-1) + torch.eye(C, device=q.device)
    rhs = torch.cat((beta * v, beta * G.exp()[..., None] * k), dim=-1)
    U, W = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split(
        [Dv, Dk], dim=-1
    )  # U (N, B H, C, Dv), W (N, B H, C, Dk)
    inner = q @ k.transpose(-1, -2) * D  # (N, B H, C, C), lower triangle with the diagonal
    q_decayed = q * G.exp()[..., None]  # (N, B H, C, Dk)
    last = G[..., -1:]  # (N, B H, 1): the chunk's whole decay
    k_to_end = (k * (last - G).exp()[..., None]).transpose(-1, -2)  # (N, B H, Dk, C)
    chunk_decay = last.exp()[..., None]  # (N, B H, 1, 1)

    S = state.view(B * H, Dk, Dv)
    out = torch.empty(N, B * H, C, Dv, dtype=torch.float32, device=q.device)
    for n in range(N):
        corrections = torch.baddbmm(U[n], W[n], S, alpha=-1)  # (B H, C, Dv)
        torch.bmm(q_decayed[n], S, out=out[n])
        out[n].baddbmm_(inner[n], corrections)
        S.mul_(chunk_decay[n]).baddbmm_(k_to_end[n], corrections)
    # (N, B H, C, Dv) -> (B, L, H, Dv), the padding dropped
    out = out.reshape(N, B, H, C, Dv).permute(1, 0, 3, 2, 4).reshape(B, N * C, H, Dv)
    return out[:, :L], state
