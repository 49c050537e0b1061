"""The plumbing that tests and benchmarks share when they start processes (vLLM:
``tests/utils.py``'s ``RemoteOpenAIServer``): written once, so that a fix lands once.

    ports.py     free_port, free_ports (several at once: never the same port twice)
    server.py    ServeProcess: ``microvllm serve`` in a process group of its own; a bounded
                 wait for /health that shows the log's tail when it fails; /metrics,
                 /reset_prefix_cache, RSS; stop() that leaves nothing behind
                 start_process / stop_process: any command, the same way (vllm-router too)
                 wait_for: poll a predicate against a deadline

Nothing here is used by the engine itself.
"""

from microvllm.testing.ports import free_port, free_ports
from microvllm.testing.server import (
    ServeProcess,
    start_process,
    start_vllm_router,
    stop_process,
    vllm_router_binary,
    wait_for,
    wait_healthy,
)

__all__ = ["ServeProcess", "free_port", "free_ports", "start_process", "start_vllm_router", "stop_process",
           "vllm_router_binary", "wait_for", "wait_healthy"]
