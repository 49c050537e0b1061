// What every AMX kernel here needs (amx_linear.cpp, amx_quantized_linear.h): the layout of
// ldtilecfg's operand, and Linux's permission to use the tile registers. Empty unless the
// build targets AMX (MICROVLLM_AMX is then defined): the files that include it compile
// to empty bodies elsewhere, so every file builds for every target.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MICROVLLM_AMX 1

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

// The 64-byte operand of ldtilecfg: the shape of each tile register.
struct TileConfig {
    uint8_t palette_id = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
};

// Ask Linux for this process's permission to use the AMX tile registers (they are off by
// default: saving them costs 8 KiB per thread switch; Linux 5.16 or newer). 0 on success.
inline int request_amx_tiles() {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return int(syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA));
}

#endif  // MICROVLLM_AMX
