// The one registration site of the library's ops (torch.ops.qinfer.*): each op's schema and
// its CPU kernel (ops.h; one source each). The ops that take tensors run under the CPU
// dispatch key, not as composite functions of every key: torch.compile and torch.export then
// trace them through the fake kernels that qinfer/kernels/registry.py registers beside
// one-line refusals of other devices' tensors.

#include <torch/library.h>

#include <string>

#include "isa.h"
#include "ops.h"

namespace {

using namespace qinfer_kernels;

// The ISAs this CPU runs, by isa.h's names, e.g. "scalar,avx2,avx512,vnni,amx": what
// qinfer/kernels/cpu.py makes each op's paths of.
std::string cpu_isas() {
  std::string s = isa_name(Isa::Scalar);
  for (Isa isa : {Isa::Avx2, Isa::Avx512, Isa::Vnni, Isa::Amx})
    if (supports(isa)) s += std::string(",") + isa_name(isa);
  return s;
}

// The path "auto" takes on `ladder` ("dot": the dot products', "vector": the other ops'), by
// isa.h's name: the fastest the CPU runs within ATEN_CPU_CAPABILITY's cap (`best`), which
// qinfer/kernels/cpu.py reports as the ops' automatic path.
std::string auto_path(const std::string& ladder) {
  TORCH_CHECK(ladder == "dot" || ladder == "vector",
              "auto_path: ladder must be \"dot\" or \"vector\", got \"", ladder, "\"");
  return isa_name(best(ladder == "dot" ? kDotPaths : kVectorPaths));
}

}  // namespace

TORCH_LIBRARY(qinfer, lib) {
  lib.def("cpu_isas() -> str", &cpu_isas);
  lib.def("auto_path(str ladder) -> str", &auto_path);
  lib.def("pack_int4(Tensor q, Tensor scales, Tensor zeros) -> (Tensor, Tensor, Tensor)",
          &pack_int4);
  lib.def("quantize_q8_1(Tensor x, str path='auto') -> (Tensor, Tensor, Tensor)");
  lib.def("int4_mm(Tensor x, Tensor qs, Tensor d, Tensor? m, int n, str path='auto') -> Tensor");
  lib.def("int8_mm(Tensor x, Tensor q, Tensor scales, str path='auto', Tensor? d_super=None) "
          "-> Tensor");
  lib.def("int8_blocks_mm(Tensor x, Tensor q, Tensor d, str path='auto', "
          "Tensor? d_super=None, Tensor? ids=None) -> Tensor");
  lib.def("top_k_ids(Tensor logits, int k) -> Tensor");
  lib.def("int4_groups_mm(Tensor x, Tensor qs, Tensor d, Tensor? m, int n, str path='auto') "
          "-> Tensor");
  lib.def("add_rms_norm(Tensor(a!) h, Tensor? x, Tensor w, float eps, ScalarType dtype, "
          "str path='auto') -> Tensor");
  lib.def("heads_rms_norm(Tensor h, Tensor w_first, Tensor w_rest, int first, float eps, "
          "ScalarType dtype, str path='auto') -> Tensor");
  lib.def("paged_decode_attention(Tensor q, Tensor? k, Tensor? v, Tensor(a!) keys, "
          "Tensor(b!) values, Tensor? slots, Tensor positions, Tensor tables, Tensor totals, "
          "Tensor? key_starts, int block_size, int window, float scale, "
          "Tensor(c!)? key_scales=None, Tensor(d!)? value_scales=None) -> Tensor");
  lib.def("lora_add(Tensor(a!) y, Tensor x, Tensor rows, Tensor slots, Tensor a, "
          "Tensor column_slots, Tensor?[] b_t, int[] parts, str path='auto') -> ()");
  lib.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  lib.def("silu_mul(Tensor x) -> Tensor");
  lib.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  lib.def("gated_delta_recurrent(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
          "Tensor(a!) state, Tensor? slots=None) -> Tensor");
  lib.def("causal_conv1d(Tensor x, Tensor taps, Tensor(a!) windows, Tensor slots) -> Tensor");
  lib.def("gated_delta_decode(Tensor qkv, Tensor b, Tensor a, Tensor taps, "
          "Tensor(a!) windows, Tensor A_log, Tensor dt_bias, Tensor(b!) state, Tensor slots, "
          "int key_heads) -> Tensor");
  lib.def("gated_delta_chunked(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
          "Tensor(a!) state, int chunk_size, Tensor? slots=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(qinfer, CPU, lib) {
  lib.impl("quantize_q8_1", &quantize_q8_1);
  lib.impl("int4_mm", &int4_mm);
  lib.impl("int8_mm", &int8_mm);
  lib.impl("int8_blocks_mm", &int8_blocks_mm);
  lib.impl("top_k_ids", &top_k_ids);
  lib.impl("int4_groups_mm", &int4_groups_mm);
  lib.impl("add_rms_norm", &add_rms_norm);
  lib.impl("heads_rms_norm", &heads_rms_norm);
  lib.impl("paged_decode_attention", &paged_decode_attention);
  lib.impl("lora_add", &lora_add);
  lib.impl("rope", &rope);
  lib.impl("silu_mul", &silu_mul);
  lib.impl("causal_attention", &causal_attention);
  lib.impl("gated_delta_recurrent", &gated_delta_recurrent);
  lib.impl("causal_conv1d", &causal_conv1d);
  lib.impl("gated_delta_decode", &gated_delta_decode);
  lib.impl("gated_delta_chunked", &gated_delta_chunked);
}
