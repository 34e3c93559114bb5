// The one place the kernels ask what the CPU runs and name the instruction sets they use.
//
// Every source is compiled without -march flags (the library must load on any x86-64); a
// function that uses wider instructions says so with one of the QINFER_* target attributes
// below, and is only called once `supports(isa)` said yes. Each op takes a ladder of these
// ISAs, slowest first, as its "paths" (dot products: scalar, avx2, vnni, amx; the norms and
// the attention: scalar, avx2, avx512); "auto" is the fastest of the ladder this CPU runs, the
// same for every call whatever the batch, so that the rounding (which may differ between
// paths) never depends on it. The Python side (qinfer/kernels/cpu.py) asks `cpu_isas` and
// `auto_path` once.
#pragma once

#include <c10/util/Exception.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <initializer_list>
#include <string>

namespace qinfer_kernels {

// Amx: VNNI's instructions and, for int4_mm's and int8_mm's products of enough rows, AMX-INT8's
// tiles, which compute the same bits (amx.h); the other dot products take VNNI's.
enum class Isa { Scalar, Avx2, Avx512, Vnni, Amx };

#define QINFER_AVX2 __attribute__((target("avx2,fma,f16c")))
// AVX2 with AVX-VNNI's 256-bit vpdpbusd (CPUs with AVX2 and no AVX-512: Intel's client cores
// since Alder Lake; AMD's Zen 5): a variant inside a dot product's "avx2" path, the same bits.
#define QINFER_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define QINFER_AVX512 __attribute__((target("avx512f,fma")))
#define QINFER_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define QINFER_AMX                                                                        \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,amx-tile," \
                        "amx-int8")))

// What runs the AMX tiles: none; the CPU's tile unit, where it has AMX-TILE and AMX-INT8
// (CPUID leaf 7: EDX bits 24 and 25) and Linux lets this process use the tiles' 8 KiB of state
// (asked once, arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, as oneDNN does: without it the
// first tile instruction faults; a refusal is said once, as a warning, and the products take
// VNNI's path, the same bits); or amx.h's software model, on a VNNI CPU, where QINFER_AMX is
// "emulate" (for the tests). QINFER_AMX=off: none. Read once a process.
enum class AmxUnit { None, Hardware, Model };
inline AmxUnit amx_unit() {
  static const AmxUnit unit = [] {
    const char* env = std::getenv("QINFER_AMX");
    const std::string mode = env ? env : "";
    if (mode == "off") return AmxUnit::None;
    if (mode == "emulate") return AmxUnit::Model;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
      return AmxUnit::None;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) != 0) {
      TORCH_WARN("qinfer kernels: the CPU has AMX-INT8 but Linux refused this process its tile "
                 "state (arch_prctl ARCH_REQ_XCOMP_PERM); the int8 products run on VNNI");
      return AmxUnit::None;
    }
    return AmxUnit::Hardware;
  }();
  return unit;
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
      return supports(Isa::Vnni) && amx_unit() != AmxUnit::None;
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

// What a dot-product path's vector code runs: VNNI's for "amx" (whose tiles only int4_mm's
// and int8_mm's products of enough rows take).
inline Isa vector_isa(Isa path) { return path == Isa::Amx ? Isa::Vnni : path; }

// The widest path "auto" may take: torch's ATEN_CPU_CAPABILITY caps its own kernels to
// emulate a smaller CPU ("default", "avx2", "avx512": VNNI, no AMX tiles), and the ops'
// automatic choices are capped alike (the one mapping: qinfer/kernels/cpu.py asks the library's
// `auto_path`), so that an emulated AVX2 machine runs and rounds as a real one. Read once.
inline Isa capability_cap() {
  static const Isa cap = [] {
    const char* env = std::getenv("ATEN_CPU_CAPABILITY");
    const std::string name = env ? env : "";
    if (name == "default") return Isa::Scalar;
    if (name == "avx2") return Isa::Avx2;
    if (name == "avx512") return Isa::Vnni;
    return Isa::Amx;
  }();
  return cap;
}

// Whether an "avx2" dot product may use AVX-VNNI: the CPU has it, and no ATEN_CPU_CAPABILITY
// of "avx2" emulates a CPU without it.
inline bool avx_vnni_usable() {
  static const bool usable = supports(Isa::Avx2) && __builtin_cpu_supports("avxvnni") &&
                             capability_cap() != Isa::Avx2;
  return usable;
}

// The fastest path of `ladder` this CPU runs, within `capability_cap`.
inline Isa best(std::initializer_list<Isa> ladder) {
  Isa found = Isa::Scalar;
  for (Isa isa : ladder)
    if (supports(isa) && static_cast<int>(isa) <= static_cast<int>(capability_cap())) found = isa;
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
