"""The CPU platform (``platform.py``): C++ kernels for the model's ops, packed GEMMs, a C++ attention
backend and a decode fast path, each used only where it builds and applies here.

    op / step                 CPU version                              file
    Linear                    packed GEMM: vector panels (AVX-512,     gemm.py, gemm_kernels.py
                                AVX2, NEON) / AMX tiles / oneDNN
    RMSNorm, ApplyRotaryEmb,  one C++ pass each                        ops.py
      SiluAndMul, Argmax
    attention ("auto")        paged decode + prefill kernels           attention_backend.py
    a decode-only step        every layer in one C call                decode_fast_path.py
    building and loading      csrc/*.cpp, signatures from csrc/ops.h   kernels.py

Every version computes what the op's ``forward_native`` computes (tests compare them),
and a kernel that does not build here (no compiler, an older CPU) leaves its op on
``forward_native``. With ``enforce_eager=True`` nothing here is loaded.
"""
