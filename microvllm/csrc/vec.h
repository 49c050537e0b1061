// One vector of float32 lanes, as wide as this build's target has (vLLM's CPU backend
// does the same in csrc/cpu/cpu_types_x86.hpp and cpu_types_arm.hpp): kernels written
// against VecF compile to AVX-512, AVX2 or NEON instructions from one source.
//
//   target (MICROVLLM_CPU_ISA)        VecF           lanes   registers
//   avx512 (x86-64-v4)                __m512            16   32
//   avx2   (x86-64-v3: + FMA, F16C)   __m256             8   16
//   native on arm64 (NEON)            float32x4_t        4   32
//   portable, or an older x86         (none: MICROVLLM_VEC is 0; kernels keep plain loops)
//
// VecF::load(p) / store(p)     `lanes` floats from / to memory (any alignment)
// VecF::set1(x), zero()        every lane x, or 0
// fma(a, b, c)                 a * b + c in each lane, one rounding
// a + b, a * b                 lane by lane
// v.sum()                      the lanes added up (a horizontal sum: use once per row, not per step)
// VecF::load_i8(p)             `lanes` int8 -> float32 (exact)
// VecF::load_nibbles<HIGH>(p)  `lanes` bytes -> the low (HIGH false) or high 4 bits of each, as float32
//
// The build (platforms/cpu/kernels.py) defines MICROVLLM_PORTABLE for the portable
// target, which turns VecF off on every machine (on arm64 NEON is always there, so
// without it "portable" would still mean NEON).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && !defined(MICROVLLM_PORTABLE)
#include <immintrin.h>
#define MICROVLLM_VEC 512
struct VecF {
    static constexpr int lanes = 16;
    static constexpr int registers = 32;
    __m512 v;
    static VecF zero() { return {_mm512_setzero_ps()}; }
    static VecF set1(float x) { return {_mm512_set1_ps(x)}; }
    static VecF load(const float* p) { return {_mm512_loadu_ps(p)}; }
    void store(float* p) const { _mm512_storeu_ps(p, v); }
    float sum() const { return _mm512_reduce_add_ps(v); }
    static VecF load_i8(const int8_t* p) {
        return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
    }
    template <bool HIGH>
    static VecF load_nibbles(const uint8_t* p) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        const __m512i q = HIGH ? _mm512_srli_epi32(bytes, 4) : _mm512_and_si512(bytes, _mm512_set1_epi32(0x0f));
        return {_mm512_cvtepi32_ps(q)};
    }
};
inline VecF fma(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline VecF operator+(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VecF operator*(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }

#elif defined(__AVX2__) && defined(__FMA__) && !defined(MICROVLLM_PORTABLE)
#include <immintrin.h>
#define MICROVLLM_VEC 256
struct VecF {
    static constexpr int lanes = 8;
    static constexpr int registers = 16;
    __m256 v;
    static VecF zero() { return {_mm256_setzero_ps()}; }
    static VecF set1(float x) { return {_mm256_set1_ps(x)}; }
    static VecF load(const float* p) { return {_mm256_loadu_ps(p)}; }
    void store(float* p) const { _mm256_storeu_ps(p, v); }
    float sum() const {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    }
    static VecF load_i8(const int8_t* p) {
        return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
    }
    template <bool HIGH>
    static VecF load_nibbles(const uint8_t* p) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        const __m256i q = HIGH ? _mm256_srli_epi32(bytes, 4) : _mm256_and_si256(bytes, _mm256_set1_epi32(0x0f));
        return {_mm256_cvtepi32_ps(q)};
    }
};
inline VecF fma(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline VecF operator+(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
inline VecF operator*(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }

#elif defined(__ARM_NEON) && !defined(MICROVLLM_PORTABLE)
#include <arm_neon.h>
#define MICROVLLM_VEC 128
struct VecF {
    static constexpr int lanes = 4;
    static constexpr int registers = 32;
    float32x4_t v;
    static VecF zero() { return {vdupq_n_f32(0.f)}; }
    static VecF set1(float x) { return {vdupq_n_f32(x)}; }
    static VecF load(const float* p) { return {vld1q_f32(p)}; }
    void store(float* p) const { vst1q_f32(p, v); }
    float sum() const { return vaddvq_f32(v); }
    static VecF load_i8(const int8_t* p) {
        int32_t four;   // 4 bytes, widened 8 -> 16 -> 32 bits
        std::memcpy(&four, p, 4);
        const int16x8_t wide = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four)));
        return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide)))};
    }
    template <bool HIGH>
    static VecF load_nibbles(const uint8_t* p) {
        uint32_t four;
        std::memcpy(&four, p, 4);
        const uint8x8_t bytes = vreinterpret_u8_u32(vdup_n_u32(four));
        const uint8x8_t q = HIGH ? vshr_n_u8(bytes, 4) : vand_u8(bytes, vdup_n_u8(0x0f));
        return {vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(q))))};
    }
};
inline VecF fma(VecF a, VecF b, VecF c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
inline VecF operator+(VecF a, VecF b) { return {vaddq_f32(a.v, b.v)}; }
inline VecF operator*(VecF a, VecF b) { return {vmulq_f32(a.v, b.v)}; }

#else
#define MICROVLLM_VEC 0
#endif
