// Per-thread scratch kept between calls (quantized_linear.cpp, amx_quantized_linear.h): a
// decode step makes ~120 kernel calls, and a fresh allocation of this size each time
// (mapped, zeroed, unmapped by malloc) cost more than the arithmetic at batch 32.
#pragma once

#include <cstdint>
#include <vector>

// Buffer `which` (0-3) of this thread, at least `count` elements; valid until the next
// call with the same T and `which` on this thread.
template <typename T>
inline T* thread_buffer(int which, int64_t count) {
    thread_local std::vector<T> buffers[4];
    std::vector<T>& buffer = buffers[which];
    if (int64_t(buffer.size()) < count) buffer.resize(count);
    return buffer.data();
}
