// The instruction-set paths of the elementwise kernels (layer_ops_cpu.cpp, lora_cpu.cpp): one
// function per path, each compiled with its own target attributes (CB_AVX2, CB_AVX512), chosen at
// run time by the `isa` argument (cpu_isa.py's names; "avx512_bf16" runs the avx512 path).
#pragma once

#include <c10/util/Exception.h>

#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#define CB_X86 1
#define CB_AVX2 __attribute__((target("avx2,fma")))
#define CB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#else
#define CB_X86 0
#define CB_AVX2
#define CB_AVX512
#endif

namespace cbserve_vector_paths {

enum class Path { kGeneric, kAvx2, kAvx512 };

// The path that runs `isa`; refused (naming `op`) when this CPU lacks it.
inline Path path_of(const std::string& isa, const char* op) {
  if (isa == "generic") return Path::kGeneric;
  TORCH_CHECK(isa == "avx2" || isa == "avx512" || isa == "avx512_bf16", op,
              ": isa must be generic, avx2, avx512 or avx512_bf16");
#if CB_X86
  __builtin_cpu_init();
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), op, ": this CPU lacks AVX2 + FMA");
  if (isa == "avx2") return Path::kAvx2;
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"),
              op, ": this CPU lacks AVX-512 F/BW/VL/DQ");
  return Path::kAvx512;
#else
  TORCH_CHECK(false, op, ": the vector paths need an x86-64 build");
  return Path::kGeneric;
#endif
}

}  // namespace cbserve_vector_paths
