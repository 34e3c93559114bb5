// The gated delta rule a chunk of tokens at a time over an fp32 state: the op
// gated_delta_chunked (docs/KERNELS.md; the torch form is qinfer/attention/deltanet.py's
// `chunked_gated_delta_rule`, whose docstring derives the steps).
//
//   gated_delta_chunked(q, k, v, g, beta, state, chunk_size) -> out
//     the arguments and result of gated_delta_recurrent (gated_delta.h checks them), the
//     tokens taken chunk_size at a time (the last chunk the rest)
//
// Per (sequence, head), per chunk of n tokens in order, with q' = q * Dk^-0.5,
// G_i = g_0 + ... + g_i (in order), D_ij = exp(G_i - G_j), S the state at the chunk's start,
// and every dot product `dot` (16 lanes, lane l summing elements l, l + 16, ..., then a fixed
// tree) and every other sum in index order:
//   A_ij = beta_i (k_i . k_j) D_ij (j < i);  P_ij = (q'_i . k_j) D_ij (j <= i)
//   X_i = [beta_i v_i | beta_i exp(G_i) k_i] - sum_{j<i} A_ij X_j    (forward substitution)
//   U_i, W_i = X_i's first Dv and last Dk columns
//   V'_i = U_i - sum_m W_i[m] S[m]                                   corrections
//   out_i = sum_m (q'_i[m] exp(G_i)) S[m] + sum_{j<=i} P_ij V'_j
//   S[m] <- exp(G_{n-1}) S[m] + sum_i (k_i[m] exp(G_{n-1} - G_i)) V'_i
// Rows of Dv (or Dv + Dk) columns are lanes of their own, so the loops compiled for AVX-512
// and AVX2 round exactly as the scalar ones (-ffp-contract=off). Each (sequence, head) is one
// task of at::parallel_for, alone with its state and its chunks (cut by its own tokens): a
// sequence's output and state are the same bits alone as in any batch, on any thread count.
//
// Why: the torch form pads, moves every operand chunk-major and runs some 30 ops over
// (N, B H, C, ...) tensors; here each chunk is a few passes over its head's state and its
// n x Dk and n x Dv rows, in L1 and L2.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "gated_delta.h"
#include "isa.h"
#include "ops.h"

namespace qinfer_kernels {
namespace {

constexpr int64_t kLanes = 16;

// a . b over n elements: lane l sums elements l, l + 16, ... in order, then a fixed tree.
QINFER_INLINE float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  for (int64_t l = 0; i + l < n; ++l) acc[l] += a[i + l] * b[i + l];
  for (int64_t w = kLanes / 2; w > 0; w /= 2)
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// y[j] += a x[j], j < n
QINFER_INLINE void axpy(float* __restrict__ y, float a, const float* __restrict__ x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] += a * x[j];
}

// 16 fp32 lanes as GCC's vector extension: each operation is the scalar one lane by lane,
// whatever registers a path keeps them in (one AVX-512, two AVX2, four SSE).
typedef float F16 __attribute__((vector_size(64)));

QINFER_INLINE F16 load16(const float* p) {
  F16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Rows x (16 Vecs) of C += A B, held in registers over the whole sum (m = 0, 1, ... in
// order): C at (ldc), A (Rows, K) at (lda), B (K, 16 Vecs) at (ldb).
template <int Rows, int Vecs>
QINFER_INLINE void tile(float* C, int64_t ldc, const float* A, int64_t lda, const float* B,
                        int64_t ldb, int64_t K) {
  F16 acc[Rows][Vecs];
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Vecs; ++c) acc[r][c] = load16(C + r * ldc + 16 * c);
  for (int64_t m = 0; m < K; ++m) {
    F16 b[Vecs];
    for (int c = 0; c < Vecs; ++c) b[c] = load16(B + m * ldb + 16 * c);
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < Vecs; ++c) acc[r][c] += A[r * lda + m] * b[c];
  }
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Vecs; ++c) std::memcpy(C + r * ldc + 16 * c, &acc[r][c], sizeof(F16));
}

// The columns of Rows rows of C += A B: tiles of 64 columns, then of 16, then one at a time;
// each element's sum in the same order (m = 0, 1, ...) whichever piece computes it.
template <int Rows>
QINFER_INLINE void rows(float* C, int64_t ldc, const float* A, int64_t lda, const float* B,
                        int64_t ldb, int64_t K, int64_t N) {
  int64_t j = 0;
  for (; j + 64 <= N; j += 64) tile<Rows, 4>(C + j, ldc, A, lda, B + j, ldb, K);
  for (; j + 16 <= N; j += 16) tile<Rows, 1>(C + j, ldc, A, lda, B + j, ldb, K);
  for (; j < N; ++j)
    for (int r = 0; r < Rows; ++r)
      for (int64_t m = 0; m < K; ++m) C[r * ldc + j] += A[r * lda + m] * B[m * ldb + j];
}

// C (R, N) += A (R, K) B (K, N), row-major at the given leading dimensions; every element
// C[r, j] + A[r, 0] B[0, j] + A[r, 1] B[1, j] + ..., in that order.
QINFER_INLINE void multiply_add(float* C, int64_t ldc, const float* A, int64_t lda,
                                const float* B, int64_t ldb, int64_t R, int64_t K, int64_t N) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) rows<4>(C + r * ldc, ldc, A + r * lda, lda, B, ldb, K, N);
  for (; r < R; ++r) rows<1>(C + r * ldc, ldc, A + r * lda, lda, B, ldb, K, N);
}

// A task's working rows for chunks of up to C tokens.
struct Scratch {
  // G, E (C); A, P (C, C); X (C, Dv + Dk); V (C, Dv); Q, M (C, Dk); T (Dk, C)
  std::vector<float> G, E, A, P, X, V, Q, M, T;
  Scratch(int64_t C, int64_t Dk, int64_t Dv)
      : G(C), E(C), A(C * C), P(C * C), X(C * (Dv + Dk)), V(C * Dv), Q(C * Dk), M(C * Dk),
        T(Dk * C) {}
};

// One chunk of n tokens of one (sequence, head), from token t0; S (Dk, Dv) updated in place.
QINFER_INLINE void delta_chunk(const DeltaHead& x, int64_t t0, int64_t n, float* __restrict__ S,
                               int64_t Dk, int64_t Dv, float scale, Scratch& w) {
  const int64_t C = static_cast<int64_t>(w.G.size()), width = Dv + Dk;
  float *G = w.G.data(), *E = w.E.data(), *A = w.A.data(), *P = w.P.data();
  float *X = w.X.data(), *V = w.V.data(), *Q = w.Q.data(), *M = w.M.data(), *T = w.T.data();
  auto k = [&](int64_t i) { return x.k + (t0 + i) * x.k_step; };
  float cumulative = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    cumulative += x.g[(t0 + i) * x.g_step];
    G[i] = cumulative;
    E[i] = std::exp(cumulative);
    const float* q = x.q + (t0 + i) * x.q_step;
    for (int64_t m = 0; m < Dk; ++m) Q[i * Dk + m] = q[m] * scale;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float beta = x.beta[(t0 + i) * x.beta_step];
    for (int64_t j = 0; j <= i; ++j) {
      const float d = std::exp(G[i] - G[j]);  // D_ij
      if (j < i) A[i * C + j] = beta * dot(k(i), k(j), Dk) * d;
      P[i * C + j] = dot(Q + i * Dk, k(j), Dk) * d;
    }
    // X_i: the right-hand side, then the rows above it subtracted in order
    float* xi = X + i * width;
    const float* v = x.v + (t0 + i) * x.v_step;
    const float decayed = beta * E[i];
    for (int64_t j = 0; j < Dv; ++j) xi[j] = beta * v[j];
    for (int64_t m = 0; m < Dk; ++m) xi[Dv + m] = decayed * k(i)[m];
    for (int64_t j = 0; j < i; ++j) axpy(xi, -A[i * C + j], X + j * width, width);
  }
  // V' = U - W S (M = -W), then out = (Q' diag(exp(G))) S + P V' (M = Q' scaled, P's upper
  // triangle zero)
  float* out = x.out + t0 * x.out_step;
  for (int64_t i = 0; i < n; ++i) {
    std::copy(X + i * width, X + i * width + Dv, V + i * Dv);
    for (int64_t m = 0; m < Dk; ++m) M[i * Dk + m] = -X[i * width + Dv + m];
  }
  multiply_add(V, Dv, M, Dk, S, Dv, n, Dk, Dv);
  for (int64_t i = 0; i < n; ++i) {
    std::fill(out + i * x.out_step, out + i * x.out_step + Dv, 0.0f);
    for (int64_t m = 0; m < Dk; ++m) M[i * Dk + m] = Q[i * Dk + m] * E[i];
    std::fill(P + i * C + i + 1, P + i * C + n, 0.0f);
  }
  multiply_add(out, x.out_step, M, Dk, S, Dv, n, Dk, Dv);
  multiply_add(out, x.out_step, P, C, V, Dv, n, n, Dv);
  // S <- exp(G_last) S + T V', T[m, i] = k_i[m] exp(G_last - G_i)
  const float last = G[n - 1], whole = E[n - 1];
  for (int64_t i = 0; i < n; ++i) {
    const float to_end = std::exp(last - G[i]);
    for (int64_t m = 0; m < Dk; ++m) T[m * C + i] = k(i)[m] * to_end;
  }
  for (int64_t e = 0; e < Dk * Dv; ++e) S[e] = whole * S[e];
  multiply_add(S, Dv, T, C, V, Dv, Dk, n, Dv);
}

// The chunk loop, compiled once for each path of isa.h's vector ladder from the one source
// above (the same bits on each); picked once per call.
#define QINFER_CHUNK_LOOPS(NAME, TARGET)                                                     \
  struct NAME {                                                                              \
    TARGET static void head(const DeltaHead& x, int64_t L, int64_t C, float* S, int64_t Dk, \
                            int64_t Dv, float scale, Scratch& w) {                           \
      for (int64_t t0 = 0; t0 < L; t0 += C)                                                  \
        delta_chunk(x, t0, std::min(C, L - t0), S, Dk, Dv, scale, w);                        \
    }                                                                                        \
  };
QINFER_CHUNK_LOOPS(LoopsScalar, )
QINFER_CHUNK_LOOPS(LoopsAvx2, QINFER_AVX2)
QINFER_CHUNK_LOOPS(LoopsAvx512, QINFER_AVX512)

template <typename Loops>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
         const at::Tensor& beta, const at::Tensor& state, const std::vector<int64_t>& rows,
         int64_t C, const at::Tensor& out) {
  const int64_t L = k.size(1), H = k.size(2), Dk = k.size(3), Dv = v.size(3);
  const float scale = query_scale(Dk);
  float* sp = state.data_ptr<float>();
  at::parallel_for(0, k.size(0) * H, 1, [&](int64_t begin, int64_t end) {
    Scratch w(C, Dk, Dv);
    for (int64_t task = begin; task < end; ++task)
      Loops::head(delta_head(q, k, v, g, beta, out, task / H, task % H), L, C,
                  head_state(sp, rows, task, H, Dk, Dv), Dk, Dv, scale, w);
  });
}

}  // namespace

at::Tensor gated_delta_chunked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& g, const at::Tensor& beta,
                               const at::Tensor& state, int64_t chunk_size,
                               const c10::optional<at::Tensor>& slots) {
  const auto rows = check_delta_rule("gated_delta_chunked", q, k, v, g, beta, state, slots);
  TORCH_CHECK(chunk_size > 0, "gated_delta_chunked: chunk_size must be positive, got ",
              chunk_size);
  const int64_t C = std::min(chunk_size, std::max<int64_t>(k.size(1), 1));
  at::Tensor out = at::empty({k.size(0), k.size(1), k.size(2), v.size(3)}, v.options());
  switch (best(kVectorPaths)) {
    case Isa::Avx512: run<LoopsAvx512>(q, k, v, g, beta, state, rows, C, out); break;
    case Isa::Avx2: run<LoopsAvx2>(q, k, v, g, beta, state, rows, C, out); break;
    default: run<LoopsScalar>(q, k, v, g, beta, state, rows, C, out);
  }
  return out;
}

}  // namespace qinfer_kernels
