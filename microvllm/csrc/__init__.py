"""C++ headers shared by microvllm's CPU kernels (``dtypes.h``); ``cpp_extension`` puts this
folder on their include path. No Python here."""
