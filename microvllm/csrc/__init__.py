"""C++ headers shared by microvllm's CPU kernels (``dtypes.h``: element types; ``vec512.h``:
AVX-512 helpers); ``cpp_extension`` puts this folder on their include path. No Python here."""
