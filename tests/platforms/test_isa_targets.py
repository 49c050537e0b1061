"""The kernel tests again, with the kernels built for a laptop's target: ``avx2``
(x86-64-v3, what most x86 laptops have) and ``portable`` (no intrinsics: the plain loops
every kernel keeps), each in a fresh pytest process with ``MICROVLLM_CPU_ISA`` set, so
that one AVX-512 machine checks what the workshop room runs. A kernel that fails to
build for a target fails its tests there (``conftest.needs_kernel``), never skips.

Slow (about a minute per target): the full suite runs it, the quick tier does not."""

import os
import subprocess
import sys

import pytest

from microvllm.platforms.cpu import kernels

KERNEL_TESTS = ["test_cpu_ops.py", "test_argmax_kernel.py", "test_cpu_attention_kernels.py",
                "test_vec_linear.py", "test_quantized_gemm.py", "test_packed_gemm.py",
                "test_decode_fast_path.py"]
HERE = os.path.dirname(__file__)


def can_run(isa: str) -> bool:
    try:
        kernels.check_target(isa)
        return True
    except kernels.KernelUnavailable:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_the_kernel_tests_pass_with_the_kernels_built_for(isa):
    if not can_run(isa):
        pytest.skip(f"this CPU cannot run MICROVLLM_CPU_ISA={isa}")
    env = {**os.environ, "MICROVLLM_CPU_ISA": isa}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                           *[os.path.join(HERE, name) for name in KERNEL_TESTS]],
                          capture_output=True, text=True, env=env, timeout=1200)
    tail = done.stdout[-4000:]
    assert done.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail
