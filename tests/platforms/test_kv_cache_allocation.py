"""The CPU platform's KV cache: zeroed pages from the OS, resident only once written."""

from pathlib import Path

import pytest
import torch

from microvllm.platforms.cpu.platform import CpuPlatform
from microvllm.platforms.interface import Platform


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmRSS")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_cache_is_zeroed_writable_and_outlives_its_mapping(dtype):
    shape = (2, 9, 16, 3, 64)
    cache = CpuPlatform().allocate_kv_cache(shape, dtype)
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert torch.equal(cache, torch.zeros(shape, dtype=dtype))
    values = torch.randn(shape).to(dtype)
    cache.copy_(values)   # the mapping object is referenced by the tensor alone now
    assert torch.equal(cache, values)
    assert torch.equal(Platform().allocate_kv_cache(shape, dtype), torch.zeros(shape, dtype=dtype))


def test_an_empty_cache_is_allowed():
    assert CpuPlatform().allocate_kv_cache((2, 0, 16, 3, 64), torch.float32).numel() == 0


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's VmRSS")
def test_the_cpu_cache_becomes_resident_as_it_is_written():
    size = 256 * 2**20
    before = _rss()
    cache = CpuPlatform().allocate_kv_cache((2, size // 8), torch.float32)
    allocated = _rss() - before
    cache[0, : size // 16].fill_(1.0)   # a quarter of the cache (64 MiB) written
    written = _rss() - before
    assert allocated < size // 16, f"{allocated / 2**20:.0f} MiB resident before any write"
    assert size // 4 - size // 16 < written < size // 2, f"{written / 2**20:.0f} MiB after writing 64 MiB"
    assert float(cache.sum()) == size // 16
