"""Processes for tests and benchmarks: ``microvllm serve`` (``ServeProcess``), any other
command (``start_process``, ``stop_process``: vllm-router, a proxy), and waiting.

Every process starts in a session (process group) of its own, so that ``stop`` reaches
what it started too (tensor-parallel workers, grammar compilers, data-parallel cores);
every wait has a deadline; a server that fails to come up says why, with its log's tail.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from microvllm.testing.ports import free_port

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll ``predicate`` until it returns something true (returned); ``AssertionError``
    naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def start_process(command: Sequence[str], log: Path, env: dict[str, str] | None = None,
                  cwd: str | Path | None = None) -> subprocess.Popen:
    """``command`` in a new session, stdout and stderr to ``log``, ``OMP_NUM_THREADS=1``
    unless ``env`` says otherwise (processes side by side on few cores)."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log, "w") as out:
        return subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT, env=environment,
                                start_new_session=True, cwd=cwd)


def stop_process(process: subprocess.Popen, term_timeout: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL it if still there after ``term_timeout`` s; reaped,
    bounded (``term_timeout=0``: SIGKILL at once)."""
    if process.poll() is not None:
        return
    for sig, wait in (((signal.SIGTERM, term_timeout),) if term_timeout > 0 else ()) + ((signal.SIGKILL, 30),):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
    process.wait(30)


def wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float, path: str = "/health") -> None:
    """Poll ``url + path`` until 200; ``RuntimeError`` with the log's tail if the process
    exits first or ``timeout`` passes."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with status {process.returncode}; its log ({log}):\n"
                               f"{_tail(log)}")
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} was not healthy within {timeout:.0f} s; its log ({log}):\n{_tail(log)}")


def _tail(log: Path, chars: int = 3000) -> str:
    try:
        return Path(log).read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def rss_mb(pid: int) -> float:
    """A process's resident memory in MB (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class ServeProcess:
    """``microvllm serve MODEL --port PORT FLAGS`` (the embedded model when ``model`` is
    None) on 127.0.0.1, logging to ``log``. ``wait_healthy()`` before use; ``stop()`` (or
    ``with``) kills its whole process group."""

    def __init__(self, model: str | Path | None, log: Path, flags: Sequence[str] = (), port: int | None = None,
                 env: dict[str, str] | None = None, cwd: str | Path | None = None) -> None:
        self.model = None if model is None else str(model)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log)
        command = [sys.executable, "-m", "microvllm", "serve", *([self.model] if self.model else []),
                   "--port", str(self.port), "--uvicorn-log-level", "warning", *flags]
        self.process = start_process(command, self.log_path, env, cwd)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_healthy(self, timeout: float = 300) -> None:
        wait_healthy(self.url, self.process, self.log_path, timeout)

    def healthy(self) -> bool:
        """/health answers 200 now; ``AssertionError`` with the log's tail if the process is gone."""
        import httpx

        assert self.process.poll() is None, f"the server exited:\n{_tail(self.log_path)}"
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> dict[str, float]:
        """``vllm:*`` gauges and counters by name (``name:reason`` for a finished reason)."""
        import httpx

        values = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            match = re.match(r"vllm:(\w+)\{([^}]*)\} (\S+)$", line)
            if match and "le=" not in match.group(2):
                reason = re.search(r'finished_reason="(\w+)"', match.group(2))
                values[f"{match.group(1)}:{reason.group(1)}" if reason else match.group(1)] = float(match.group(3))
        return values

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``POST /reset_prefix_cache``: a test that shares this server starts cold."""
        import httpx

        return httpx.post(self.url + "/reset_prefix_cache", timeout=30).status_code == 200

    def rss_mb(self) -> float:
        return rss_mb(self.process.pid)

    def stop(self, term_timeout: float = 0.0) -> None:
        """Kill the process group (SIGKILL at once unless ``term_timeout`` gives SIGTERM a
        chance first) and reap the server."""
        stop_process(self.process, term_timeout)


def vllm_router_binary() -> str | None:
    """The ``vllm-router`` executable (pip's ``vllm-router``) beside this Python, or None."""
    found = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    return found if Path(found).is_file() else None


def start_vllm_router(arguments: Sequence[str], port: int, log: Path) -> subprocess.Popen:
    """vLLM's router on 127.0.0.1:``port`` with ``arguments`` (its policy and workers, or
    ``--vllm-pd-disaggregation ...``); its Prometheus port is a free one."""
    router = vllm_router_binary()
    if router is None:
        raise RuntimeError("vllm-router is not installed: pip install vllm-router")
    return start_process([router, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port",
                          str(free_port()), *arguments], log)
