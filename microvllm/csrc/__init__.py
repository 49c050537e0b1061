"""All of microvllm's C++: the CPU platform's kernels (``*.cpp``), the headers they share
(``dtypes.h`` element types, ``vec512.h`` AVX-512 helpers) and ``ops.h``, where every C
entry point is declared once. ``platforms/cpu/kernels.py`` builds and loads them. No Python here."""
