"""What the tests share when they serve: one home, so that no test module imports
another (the process plumbing itself is ``microvllm/testing/``, which the benches use too).

    Server          ``microvllm serve`` on a tiny model with the tests' small limits
    ThreadServer    an ASGI app served by uvicorn from a thread of this process
    assert_400, healthy_and_serving     what a hostile-client test checks after each attack
    core_pids, alive    a server's engine-core processes, and whether a pid still runs
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from microvllm.testing import ServeProcess, free_port, free_ports, vllm_router_binary, wait_for

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ["--max-model-len", "1024", "--max-num-seqs", "16", "--max-num-batched-tokens", "128",
            "--shutdown-timeout", "1"]
LLM_SETTINGS = dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=128)
STARTUP_TIMEOUT = 180.0
ROUTER = vllm_router_binary() or "vllm-router (not installed)"

__all__ = ["LLM_SETTINGS", "ROOT", "ROUTER", "SETTINGS", "STARTUP_TIMEOUT", "Server", "ThreadServer", "alive",
           "assert_400", "core_pids", "free_port", "free_ports", "healthy_and_serving", "wait_for"]


class Server(ServeProcess):
    """``microvllm serve FOLDER`` with the tests' limits (``SETTINGS``) unless ``flags`` are
    given, importing this checkout's package (``PYTHONPATH``), development endpoints on."""

    def __init__(self, folder: Path | str, log: Path, flags: list[str] = SETTINGS, port: int | None = None,
                 env: dict[str, str] | None = None):
        super().__init__(folder, log, flags, port, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "VLLM_SERVER_DEV_MODE": "1", **(env or {})})
        self.folder = str(folder)


class ThreadServer:
    """uvicorn serving ``app`` on a free port from a background thread."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


def healthy_and_serving(http) -> None:
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"][0]["text"]) >= 0


def assert_400(response, field: str | None, *words: str) -> None:
    assert response.status_code == 400, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    if field is not None:
        assert field in error["message"], error
    for word in words:
        assert word in error["message"], error


def core_pids(server_pid: int) -> list[int]:
    """The engine-core processes: the server's children started by multiprocessing's spawn
    (not its resource tracker)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == server_pid and \
                b"spawn_main" in open(f"/proc/{entry}/cmdline", "rb").read():
            pids.append(int(entry))
    return pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
