// AVX-512 helpers shared by the kernels (only in builds for CPUs that have AVX-512;
// each kernel keeps a portable path for the others). The build puts this folder on
// the include path and in every kernel's build key.
//
//   load16(p)    16 stored elements (float32, bfloat16 or float16) -> 16 float32 lanes
//   exp512(x)    e^x in each of 16 lanes, inline
#pragma once

#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {   // bfloat16: its bits are a float's top half
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const _Float16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

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
