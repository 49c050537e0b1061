# Tiny models step in milliseconds on one torch thread (see tests/reliability/conftest.py).
from tests.reliability.conftest import one_torch_thread  # noqa: F401
