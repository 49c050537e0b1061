"""A grammar compile that keeps growing is stopped while it runs (issue 66, item 3).

5,000 tools once grew a compile worker to 20 GB before its compile ended, and the kernel's
OOM killer then took the server: a bound checked only after the compile is too late. Here
a stand-in compiler (a real worker process, a compiler that allocates) grows by 600 MB and
then sleeps: the pool must stop it during the sleep, answer with a ValueError naming the
memory bound, and go on compiling with a fresh worker.
"""

from __future__ import annotations

import time

import pytest

from microvllm.structured_output.compile_workers import CompileJob, GrammarCompileWorkers

GROWTH = 600 << 20
SLEEP = 20.0


class HungryCompiler:
    """A ``SpecCompiler`` stand-in: spec "hungry" holds GROWTH bytes for SLEEP seconds;
    anything else compiles at once to its own text."""

    def compile(self, kind, spec, any_whitespace):
        if spec == "hungry":
            block = bytearray(GROWTH)
            block[::4096] = b"x" * len(block[::4096])   # touch every page: resident, not just reserved
            time.sleep(SLEEP)
        return spec

    def dump(self, compiled):
        return compiled


@pytest.mark.slow
def test_a_compile_growing_past_the_bound_is_stopped_while_it_runs():
    workers = GrammarCompileWorkers(HungryCompiler(), num_workers=1, timeout=120, max_worker_rss_bytes=400 << 20)
    try:
        assert workers.compile_blocking(CompileJob("json", "small", True)) == "small"   # the worker is up
        started = time.monotonic()
        with pytest.raises(ValueError, match="took more than 400 MB of memory to compile"):
            workers.compile_blocking(CompileJob("json", "hungry", True))
        assert time.monotonic() - started < SLEEP   # stopped while it ran, not when it ended
        assert workers.compile_blocking(CompileJob("json", "after", True)) == "after"   # a fresh worker
    finally:
        workers.shutdown()
