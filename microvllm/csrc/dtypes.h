// The element types microvllm's C++ kernels read and write, and how each is turned into
// float32 (the kernels' arithmetic) and back. Shared by every kernel source; the build
// (microvllm/platforms/cpu/kernels.py) puts this folder on the include path.
//
//   Dtype::storage   the C++ type of one element in a torch tensor of that dtype
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

struct Float16 {
    using storage = _Float16;
    static float load(_Float16 x) { return float(x); }
    static _Float16 store(float x) { return _Float16(x); }
};
