// The one place the kernels ask what the CPU runs and name the instruction sets they use.
//
// Every source is compiled without -march flags (the library must load on any x86-64); a
// function that uses wider instructions says so with one of the QINFER_* target attributes
// below, and is only called once `supports(isa)` said yes. Each op takes a ladder of these
// ISAs, slowest first, as its "paths" (dot products: scalar, avx2, vnni, amx; the norms and
// the attention: scalar, avx2, avx512); "auto" is the fastest of the ladder this CPU runs, the
// same for every call whatever the batch, so that the rounding (which may differ between
// paths) never depends on it. The Python side (qinfer/kernels/cpu.py) asks `cpu_isas` once.
#pragma once

#include <c10/util/Exception.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <initializer_list>
#include <string>

namespace qinfer_kernels {

// Amx: VNNI's instructions and, for the int4 x int8 products of enough rows, AMX-INT8's
// tiles, which compute the same bits (int4_amx.cpp); the other dot products take VNNI's.
enum class Isa { Scalar, Avx2, Avx512, Vnni, Amx };

#define QINFER_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QINFER_AVX512 __attribute__((target("avx512f,fma")))
#define QINFER_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define QINFER_AMX                                                                        \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,amx-tile," \
                        "amx-int8")))

// Whether the CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7: EDX bits 24 and 25) and Linux
// lets this process use the tiles' 8 KiB of state: it must ask once (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA, as oneDNN does) before the first tile instruction, or
// that instruction faults. Asked once per process; a refusal is said once, as a warning, and
// the products take VNNI's path (the same bits).
inline bool amx_permitted() {
  static const bool permitted = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
      return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) != 0) {
      TORCH_WARN("qinfer kernels: the CPU has AMX-INT8 but Linux refused this process its tile "
                 "state (arch_prctl ARCH_REQ_XCOMP_PERM); the int8 products run on VNNI");
      return false;
    }
    return true;
  }();
  return permitted;
}

// Whether this CPU runs `isa`'s instructions (the target attributes' lists above).
inline bool supports(Isa isa) {
  switch (isa) {
    case Isa::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::Avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
    case Isa::Vnni:
      return supports(Isa::Avx512) && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
    case Isa::Amx:
      return supports(Isa::Vnni) && amx_permitted();
    default: return true;
  }
}

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
    case Isa::Vnni: return "vnni";
    case Isa::Amx: return "amx";
    default: return "scalar";
  }
}

// What a path's error message says it needs.
inline const char* isa_needs(Isa isa) {
  switch (isa) {
    case Isa::Avx2: return "AVX2, FMA and F16C";
    case Isa::Avx512: return "AVX512F and FMA";
    case Isa::Vnni: return "AVX512 F/BW/VL/DQ, VNNI and F16C";
    case Isa::Amx: return "VNNI's and AMX-TILE/AMX-INT8 with Linux's leave to use the tiles";
    default: return "nothing";
  }
}

// The ladders of paths the ops take, slowest first.
constexpr std::initializer_list<Isa> kDotPaths = {Isa::Scalar, Isa::Avx2, Isa::Vnni, Isa::Amx};
constexpr std::initializer_list<Isa> kVectorPaths = {Isa::Scalar, Isa::Avx2, Isa::Avx512};

// What the vector code of a dot-product path runs: VNNI's for "amx" (whose tiles only the
// int4 x int8 products of enough rows take, to the same bits).
inline Isa vector_isa(Isa path) { return path == Isa::Amx ? Isa::Vnni : path; }

// The fastest path of `ladder` this CPU runs.
inline Isa best(std::initializer_list<Isa> ladder) {
  Isa found = Isa::Scalar;
  for (Isa isa : ladder)
    if (supports(isa)) found = isa;
  return found;
}

// A path by name ("auto": `best`) for `op`, refused in one line where the CPU lacks it or
// the ladder has no such path.
inline Isa resolve_path(const char* op, const std::string& name,
                        std::initializer_list<Isa> ladder) {
  if (name == "auto") return best(ladder);
  for (Isa isa : ladder) {
    if (name == isa_name(isa)) {
      TORCH_CHECK(supports(isa), op, ": path '", name, "' needs ", isa_needs(isa),
                  ", which this CPU lacks");
      return isa;
    }
  }
  std::string names = "auto";  // the refusal's list, made only for it
  for (Isa isa : ladder) {
    names += isa == *(ladder.end() - 1) ? std::string(" or ") : std::string(", ");
    names += isa_name(isa);
  }
  TORCH_CHECK(false, op, ": path must be ", names, ", got '", name, "'");
  return Isa::Scalar;
}

}  // namespace qinfer_kernels
