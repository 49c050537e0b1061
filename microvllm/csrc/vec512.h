// AVX-512 helpers shared by the kernels (only in builds for CPUs that have AVX-512;
// each kernel keeps a portable path for the others). The build puts this folder on
// the include path and in every kernel's build key.
//
//   load16(p)          16 stored elements (float32, bfloat16 as uint16_t, float16 as Half)
//                      -> 16 float32 lanes
//   exp512(x)          e^x in each of 16 lanes, inline
//
// and, for loops over a row in 16-lane steps (the last step masked by tail(n)):
//
//   load16(p, mask)    the masked lanes of 16 stored elements (float32 or bfloat16)
//   store16(p, v, mask)  16 float32 lanes stored as float32 or bfloat16 (to nearest even)
//   round16<T>(v)      store then load: the float32 value a tensor of type T would hold
#pragma once

#include <cstdint>
#include <initializer_list>   // exp512's coefficient list

#include "dtypes.h"   // Half: float16's storage type

#ifdef __AVX512F__
#include <immintrin.h>

// 16 bfloat16s (their bits) -> 16 float32 lanes: a bfloat16 is a float32's top half.
inline __m512 widen_bfloat16(__m256i bits) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    return widen_bfloat16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const Half* p) {   // float16
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

#ifdef __AVX512BW__
inline __mmask16 tail(int n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const uint16_t* p, __mmask16 mask) { return widen_bfloat16(_mm256_maskz_loadu_epi16(mask, p)); }

// float32 -> bfloat16 bits, to nearest even as torch rounds: the CPU's own instruction
// where it has one, else the rounding written out (NaN aside: the build assumes
// finite math).
inline __m256i bfloat16_bits(__m512 v) {
#ifdef __AVX512BF16__
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else   // bits + 0x7fff + (the lowest bit kept), then the top half
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

inline void store16(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
inline void store16(uint16_t* p, __m512 v, __mmask16 mask) {
    _mm256_mask_storeu_epi16(p, mask, bfloat16_bits(v));
}

template <typename T> inline __m512 round16(__m512 v);
template <> inline __m512 round16<float>(__m512 v) { return v; }
template <> inline __m512 round16<uint16_t>(__m512 v) { return widen_bfloat16(bfloat16_bits(v)); }

#endif  // __AVX512BW__

// exp of 16 lanes, inline (in the prefill kernel a call of the vector math library per
// tile cost more than the tile's arithmetic): x = n·ln2 + r with |r| <= ln2/2, e^r by Cephes' degree-6
// polynomial (about 1 ulp), times 2^n by vscalefps, which flushes to 0 below float's
// range. Inputs are clamped first: exp(-104) is already 0 in float32.
inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);   // x - n·ln2, in two
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);      // parts for accuracy
    __m512 poly = _mm512_set1_ps(1.9875691500e-4f);
    for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                          1.6666665459e-1f, 5.0000001201e-1f})
        poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(c));
    poly = _mm512_fmadd_ps(_mm512_mul_ps(poly, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(poly, n);
}
#endif
