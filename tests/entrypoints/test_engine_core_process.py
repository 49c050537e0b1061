"""``microvllm serve`` runs its engine core in a process of its own (``EngineCoreProc``
behind ``AsyncLLM``'s ``SyncMPClient``), as vLLM's does: the API process tokenizes,
detokenizes and speaks HTTP; the core process schedules and runs the model.

What must hold when that core dies under load (``kill -9``): every open stream ends with
an error within seconds, ``/health`` says 503 or the server is gone, the server exits
with status 1 (a supervisor restarts it) and no process is left behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from microvllm.models.tiny import make_tiny_model
from tests.support import STARTUP_TIMEOUT, Server, alive, core_pids, wait_for


def test_serve_runs_its_core_in_a_process_of_its_own_and_survives_nothing_of_its_death(tmp_path):
    folder = make_tiny_model(tmp_path / "llama", "llama", seed=11)
    server = Server(folder, tmp_path / "server.log")
    try:
        wait_for(server.healthy, STARTUP_TIMEOUT, "the server's /health")
        cores = wait_for(lambda: core_pids(server.process.pid), 30, "the engine-core process")
        assert len(cores) == 1, f"one engine core process, got {cores}"
        # Four streams that would run for long, each past its first tokens.
        started, ended = threading.Barrier(5, timeout=60), {}

        def stream(index: int) -> None:
            chunks, error_event = 0, None
            try:
                with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                        "model": server.folder, "prompt": f"story {index}", "max_tokens": 900,
                        "temperature": 0, "ignore_eos": True, "stream": True}) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            chunks += 1
                            error_event = line if '"error"' in line else error_event
                            if chunks == 2:
                                started.wait()
            except httpx.HTTPError as error:   # the connection dropped: an error too
                error_event = repr(error)
            ended[index] = (time.monotonic(), error_event)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        started.wait()
        os.kill(cores[0], signal.SIGKILL)
        killed = time.monotonic()
        for thread in threads:
            thread.join(30)
        assert len(ended) == 4, "every stream ended"
        for when, error_event in ended.values():
            assert when - killed < 5, f"a stream ended {when - killed:.1f} s after the core died"
            assert error_event is not None and "engine" in error_event.lower(), error_event
        wait_for(lambda: server.process.poll() is not None, 60, "the server to exit after its core died")
        assert server.process.returncode == 1, "a dead engine core: exit status 1, so a supervisor restarts it"
        assert not alive(cores[0])
        assert core_pids(server.process.pid) == []
    finally:
        server.stop()
