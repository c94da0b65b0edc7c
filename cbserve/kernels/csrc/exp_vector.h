// exp(x) for x <= 0 on AVX2 and AVX-512 lanes, shared by the attention kernels
// (paged_attention_cpu.cpp, prefill_attention_cpu.cpp): Cephes' expf, x = n ln2 + r with
// |r| <= ln2 / 2, a polynomial in r, times 2^n; below -87.3 (e.g. -inf) the result is 0.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

namespace cbserve_exp {

#define CB_EXP_POLY(V, set1, fmadd, mul, add)                  \
  V r = fmadd(n, set1(-0.693359375f), xc);                     \
  r = fmadd(n, set1(2.12194440e-4f), r);                       \
  V p = set1(1.9875691500e-4f);                                \
  p = fmadd(p, r, set1(1.3981999507e-3f));                     \
  p = fmadd(p, r, set1(8.3334519073e-3f));                     \
  p = fmadd(p, r, set1(4.1665795894e-2f));                     \
  p = fmadd(p, r, set1(1.6666665459e-1f));                     \
  p = fmadd(p, r, set1(5.0000001201e-1f));                     \
  p = fmadd(p, mul(r, r), add(r, set1(1.0f)));

constexpr float EXP_LOW = -87.33654f, LOG2E = 1.44269504088896341f;

__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  const __m256 lo = _mm256_set1_ps(EXP_LOW);
  const __m256 xc = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  CB_EXP_POLY(__m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_add_ps)
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_and_ps(y, _mm256_cmp_ps(x, lo, _CMP_GE_OQ));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) inline __m512 exp_avx512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(EXP_LOW);
  const __m512 xc = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  CB_EXP_POLY(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_mul_ps, _mm512_add_ps)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), _mm512_scalef_ps(p, n));
}
#undef CB_EXP_POLY

}  // namespace cbserve_exp
#endif
