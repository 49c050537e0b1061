// The element types microvllm's C++ kernels read and write, and how each is turned into
// float32 (the kernels' arithmetic) and back. Shared by every kernel source; the build
// (microvllm/platforms/cpu/kernels.py) puts this folder on the include path.
//
//   Dtype::storage   the C++ type of one element in a torch tensor of that dtype (Half: below)
//   Dtype::load(x)   -> float32, exactly
//   Dtype::store(f)  float32 -> storage, rounded to nearest even (as torch rounds)
//   Dtype::round(f)  store then load: the float32 value a tensor of this dtype would hold
//                    (Float32 and BFloat16, the types norm_rope.cpp rounds in)
//
// bfloat16 is stored as plain uint16_t (not a struct) so that compilers vectorize loops
// over it.
#pragma once

#include <cstdint>
#include <cstring>

struct Float32 {
    using storage = float;
    static float load(float x) { return x; }
    static float store(float x) { return x; }
    static float round(float x) { return x; }
};

struct BFloat16 {  // the top 16 bits of a float32
    using storage = uint16_t;
    static float load(uint16_t x) {
        uint32_t bits = uint32_t(x) << 16;
        float f;
        std::memcpy(&f, &bits, sizeof f);
        return f;
    }
    static uint16_t store(float x) {
        uint32_t bits;
        std::memcpy(&bits, &x, sizeof bits);
        if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);  // NaN
        bits += 0x7fffu + ((bits >> 16) & 1u);
        return uint16_t(bits >> 16);
    }
    static float round(float x) { return load(store(x)); }
};

// float16's bits <-> float32, exactly, in plain integer code (no float16 type needed):
// every half is a float (subnormals included; a NaN keeps its sign and payload, quieted
// as the CPU's own conversions do), and a float goes to the nearest half, ties to even (as
// torch rounds): from 65,520 on to inf, a NaN to a quiet NaN.
//
//   half    s eeeee mmmmmmmmmm                      bias 15, subnormal when e = 0
//   float   s eeeeeeee mmmmmmmmmmmmmmmmmmmmmmm      bias 127: e + 112, m << 13
inline float half_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0);   // inf, NaN (quiet)
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);   // normal
    } else if (mantissa == 0) {
        bits = sign;                                                  // +-0
    } else {                        // subnormal: mantissa * 2^-24, normalized for float
        int shift = 0;
        uint32_t m = mantissa;
        while (!(m & 0x400u)) m <<= 1, ++shift;
        bits = sign | uint32_t(113 - shift) << 23 | ((m & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline uint16_t float_to_half(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
    const uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return sign | 0x7e00u;               // NaN
    if (magnitude >= 0x477ff000u) return sign | 0x7c00u;              // >= 65,520: inf
    if (magnitude >= 0x38800000u) {                                   // >= 2^-14: normal
        const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
        return sign | uint16_t((rounded >> 13) - (112u << 10));   // a carry bumps the exponent
    }
    const uint32_t exponent = magnitude >> 23;                        // subnormal or 0:
    if (exponent < 102) return sign;                                  // below 2^-25: 0
    const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;    // units of 2^-24:
    const uint32_t shift = 126 - exponent;                            // mantissa >> 14..24
    uint32_t q = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (q & 1u))) ++q;               // to nearest, ties to even
    return sign | uint16_t(q);
}

// Half, the C++ type of one float16 element: 2 bytes whatever the compiler (Python hands
// the kernels torch.float16 tensors as raw pointers), and MICROVLLM_FLOAT16 says which:
//
//   "_Float16"   clang wherever it has the type (arm64; x86 from clang 15, or with
//                AVX512-FP16), GCC 12 and newer on x86
//   "__fp16"     GCC on arm64 (GCC 12 has no _Float16 in C++ there): a storage type,
//                converted to and from float by the CPU (fcvt, to nearest even)
//   "bits"       anything else (clang 14 on x86 without AVX512-FP16): the bits, converted
//                by the functions above. An enum, not plain uint16_t, so that overloads can
//                tell it from bfloat16's uint16_t (vec512.h's load16)
#if defined(__FLT16_MANT_DIG__) && \
    (defined(__clang__) || (__GNUC__ >= 12 && (defined(__x86_64__) || defined(__i386__))))
#define MICROVLLM_FLOAT16 "_Float16"
using Half = _Float16;
inline float load_half(Half x) { return float(x); }
inline Half store_half(float x) { return Half(x); }
#elif defined(__ARM_FP16_FORMAT_IEEE)
#define MICROVLLM_FLOAT16 "__fp16"
using Half = __fp16;
inline float load_half(Half x) { return float(x); }
inline Half store_half(float x) { return Half(x); }
#else
#define MICROVLLM_FLOAT16 "bits"
enum class Half : uint16_t {};
inline float load_half(Half x) { return half_to_float(uint16_t(x)); }
inline Half store_half(float x) { return Half(float_to_half(x)); }
#endif
static_assert(sizeof(Half) == 2, "a float16 element must take 2 bytes, as in a torch tensor");

struct Float16 {
    using storage = Half;
    static float load(Half x) { return load_half(x); }
    static Half store(float x) { return store_half(x); }
};
