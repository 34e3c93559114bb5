"""The gated delta rule in plain torch: what a Gated DeltaNet layer computes over its state.

Per value head, with a state S (d_k, d_v) in fp32, a token's L2-normalised key k and query q
(q also scaled by d_k^-0.5), its value v, decay g <= 0 (log space) and write strength beta:

    S_t = exp(g_t) S_{t-1} + k_t (x) beta_t (v_t - S_{t-1}^T k_t exp(g_t))
    o_t = S_t^T q_t

Two forms compute it: `recurrent_gated_delta_rule`, token by token (decode), and
`chunked_gated_delta_rule`, which turns each chunk of C tokens into a few (C x C) and
(C x d) matmuls and carries S from chunk to chunk (prompts). They agree to fp32 rounding,
and each agrees with transformers' `torch_recurrent_gated_delta_rule` /
`torch_chunk_gated_delta_rule` (tests/test_deltanet.py).

`causal_conv1d` is the short causal depthwise convolution before the rule, with the rolling
window of the last K - 1 inputs a sequence keeps between steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Tokens per chunk of the chunked form. Provisional: transformers' (and the FLA kernels')
#: 64, kept until the chunk size is measured on our CPUs (issue 50); any size gives the
#: same values to fp32 rounding.
CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x (..., D) / sqrt(sum(x^2) + eps), in fp32 (the FLA library's and transformers' eps)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(causal depthwise conv) of x over the sequence, continuing from `window`.

    x (B, C, L): L new inputs per channel; weight (C, K); window (B, C, K - 1): the last
    K - 1 inputs before these (zeros for a new sequence). Returns (out (B, C, L) in x's
    dtype, the new window (B, C, K - 1): the last K - 1 of window and x together).
    """
    C, K = weight.shape
    joined = torch.cat((window.to(x.dtype), x), dim=-1)  # (B, C, K - 1 + L)
    out = F.conv1d(joined, weight.to(x.dtype).unsqueeze(1), groups=C)  # (B, C, L)
    return F.silu(out), joined[:, :, joined.shape[-1] - (K - 1) :]


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
    (B, H, Dk, Dv) fp32, the state before these tokens (not written). Returns (o (B, L, H,
    Dv) fp32, the state after them (B, H, Dk, Dv) fp32).
    """
    q = q.float() * q.shape[-1] ** -0.5
    k, v, g, beta = k.float(), v.float(), g.float(), beta.float()
    S = state.float()
    out = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]  # decay: (B, H, Dk, Dv)
        predicted = torch.einsum("bhkv,bhk->bhv", S, k[:, t])  # S^T k: (B, H, Dv)
        delta = (v[:, t] - predicted) * beta[:, t, :, None]  # (B, H, Dv)
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]  # + k (x) delta
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))  # S^T q: (B, H, Dv)
    return torch.stack(out, dim=1), S


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
    `recurrent_gated_delta_rule`.

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
    """
    B, L, H, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk_size
    pad = -L % C
    # (B, L, H, D) -> (B, H, L + pad, D) fp32, then (B, H, N, C, D): N chunks of C tokens
    q = q.float() * Dk**-0.5
    q, k, v = (F.pad(x.float().transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.float().transpose(1, 2), (0, pad)) for x in (g, beta))  # (B, H, L + pad)
    N = (L + pad) // C
    q, k, v = (x.reshape(B, H, N, C, x.shape[-1]) for x in (q, k, v))
    G = g.reshape(B, H, N, C).cumsum(dim=-1)  # (B, H, N, C) cumulative decay in the chunk
    beta = beta.reshape(B, H, N, C, 1)
    above = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    D = (G[..., :, None] - G[..., None, :]).masked_fill(above, float("-inf")).exp()  # (.., C, C)

    # T = I + the strictly lower part of diag(beta) K K^T * D; solved once for every chunk.
    system = ((beta * k) @ k.transpose(-1, -2) * D).tril(-1) + torch.eye(C, device=q.device)
    U = torch.linalg.solve_triangular(system, beta * v, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(
        system, beta * G.exp()[..., None] * k, upper=False, unitriangular=True
    )  # U (B, H, N, C, Dv), W (B, H, N, C, Dk)
    inner = q @ k.transpose(-1, -2) * D  # (B, H, N, C, C), lower triangle with the diagonal
    q_decayed = q * G.exp()[..., None]  # (B, H, N, C, Dk)
    last = G[..., -1:]  # (B, H, N, 1): the chunk's whole decay
    k_to_end = k * (last - G).exp()[..., None]  # (B, H, N, C, Dk)

    S = state.float()  # (B, H, Dk, Dv)
    out = torch.empty(B, H, N, C, Dv, dtype=torch.float32, device=q.device)
    for n in range(N):
        corrections = U[:, :, n] - W[:, :, n] @ S  # (B, H, C, Dv)
        out[:, :, n] = q_decayed[:, :, n] @ S + inner[:, :, n] @ corrections
        S = S * last[:, :, n, :, None].exp() + k_to_end[:, :, n].transpose(-1, -2) @ corrections
    # (B, H, N, C, Dv) -> (B, L, H, Dv), the padding dropped
    return out.reshape(B, H, N * C, Dv)[:, :, :L].transpose(1, 2), S
