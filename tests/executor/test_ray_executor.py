"""``distributed_executor_backend="ray"``: the tensor-parallel ranks as Ray actors in a
two-node Ray cluster, started here on loopback, give the same greedy tokens as one
process; a killed actor is a ``WorkerError`` naming its rank within seconds; nothing is
left running after ``shutdown()``.

The two "machines" are two ``ray start`` processes on this one, at 127.0.0.2 and
127.0.0.3 (both loopback, and two addresses, as two machines would have): Ray rewrites
``--node-ip-address=127.0.0.1`` to the machine's outward address
(``ray._private.services.resolve_ip_for_localhost``), which a sandbox may not route. The
head has 2 CPUs and the other node 1, so three ranks of one CPU each must use both nodes.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from microvllm import LLM, SamplingParams
from microvllm.executor import ray_executor
from microvllm.executor.multiproc_executor import WorkerError
from microvllm.executor.ray_executor import connect_to_cluster
from microvllm.models.tiny import make_tiny_model

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'microvllm[ray]' "
                                        "(.ci/run installs it for the full tier)")
pytestmark = pytest.mark.multiprocess

HEAD_IP, OTHER_IP = "127.0.0.2", "127.0.0.3"
RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 60.0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_until(condition, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {within_s:.0f} s")
        time.sleep(0.2)


def _stop(groups: list[subprocess.Popen]) -> None:
    """Stop each ``ray start --block`` and everything it started (its own session, one
    process group): SIGTERM, then SIGKILL, each waited on for a bounded time."""
    for sig, grace_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
        for group in groups:
            try:
                os.killpg(group.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for group in groups:
            try:
                group.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture(scope="module")
def ray_cluster():
    """Two Ray nodes on loopback (a head, and a second node that joins it once its GCS
    answers), this process connected to the head as the driver (through RAY_ADDRESS, as the
    executor connects); torn down whatever happens."""
    temp_dir = tempfile.mkdtemp(prefix="mvray", dir="/tmp")   # short: Ray's socket paths must fit 107 bytes
    port = _free_port(HEAD_IP)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    common = ["--block", "--disable-usage-stats", "--object-store-memory=100000000"]
    log = open(Path(temp_dir) / "ray_start.log", "w")
    nodes = []
    try:
        for options in (["--head", f"--node-ip-address={HEAD_IP}", f"--port={port}", "--num-cpus=2",
                         "--include-dashboard=false", f"--temp-dir={temp_dir}"],
                        [f"--address={HEAD_IP}:{port}", f"--node-ip-address={OTHER_IP}", "--num-cpus=1"]):
            nodes.append(subprocess.Popen([RAY, "start", *options, *common], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        try:
            _wait_until(lambda: _answers(HEAD_IP, port), START_TIMEOUT_S, "the head's GCS")
            os.environ["RAY_ADDRESS"] = f"{HEAD_IP}:{port}"
            connect_to_cluster()
            _wait_until(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2, START_TIMEOUT_S,
                        "the second Ray node")
        except TimeoutError as error:
            log.flush()
            raise TimeoutError(f"{error}; `ray start` said:\n{Path(log.name).read_text()[-3000:]}") from None
        yield
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        ray.shutdown()
        _stop(nodes)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _answers(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def test_no_cluster_is_a_clear_error_not_a_hang(monkeypatch):
    if ray.is_initialized():
        pytest.skip("this process is already connected to a Ray cluster")
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_free_port('127.0.0.1')}")   # nothing listens there
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=r"no Ray cluster answers at RAY_ADDRESS=.*`ray start --head`"):
        connect_to_cluster()
    assert time.monotonic() - started < 10


def test_a_backend_that_cannot_run_is_refused_before_anything_starts(monkeypatch):
    with pytest.raises(ValueError, match=r"distributed_executor_backend='rayy': choose one of \('mp', 'ray', 'uni'\)"):
        LLM("unused", distributed_executor_backend="rayy")
    with pytest.raises(ValueError, match=r"'uni' runs one rank, in this process, but tensor_parallel_size=3"):
        LLM("unused", distributed_executor_backend="uni", tensor_parallel_size=3)
    import importlib.util
    find_spec = importlib.util.find_spec   # as if Ray were not installed
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "ray" else find_spec(name, *rest))
    with pytest.raises(ValueError, match=r"needs Ray, which is not installed: pip install 'microvllm\[ray\]'"):
        LLM("unused", distributed_executor_backend="ray")


def _assert_nothing_left() -> None:
    """Every placement group removed (which kills its actors) and the 3 CPUs free again."""
    assert {pg["state"] for pg in ray.util.placement_group_table().values()} <= {"REMOVED"}
    _wait_until(lambda: ray.available_resources().get("CPU", 0) == 3, 15, "the 3 CPUs to be free again")


def test_default_model_tp3_on_two_nodes_matches_one_process_and_a_killed_actor_is_a_clear_error(
        ray_cluster, default_model_folder):
    """SmolLM2-135M: 9 query heads and 3 KV heads, one KV head per rank; the three ranks
    on both nodes (the PACK placement fills the head's 2 CPUs, then the other node's).
    Then rank 1's actor is killed during a step. One engine for both: each costs seconds
    to start (every actor imports torch and loads its shard)."""
    prompts = [{"prompt_token_ids": [1, 504, 3458, 314, 4370 + i, 30]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in
                LLM(str(default_model_folder), max_model_len=128).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(default_model_folder), tensor_parallel_size=3, max_model_len=128,
              distributed_executor_backend="ray")
    executor = llm.engine.executor
    try:
        assert type(executor).__name__ == "RayDistributedExecutor"
        assert {ip for _, ip, _ in executor.locations} == {HEAD_IP, OTHER_IP}, executor.locations
        assert len({node for node, _, _ in executor.locations}) == 2
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected

        victim, (_, ip, pid) = executor.actors[1], executor.locations[1]
        execute_model, steps = executor.execute_model, []

        def kill_during_the_third_step(plan):
            steps.append(plan)
            if len(steps) == 3:
                threading.Timer(0.01, ray.kill, (victim,)).start()
            return execute_model(plan)
        executor.execute_model = kill_during_the_third_step
        started = time.monotonic()
        with pytest.raises(WorkerError, match=rf"worker rank 1 \(Ray actor, pid {pid} on {ip}\) died during "
                                              r"execute_model\(\): .*ray.kill"):
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True),
                         use_tqdm=False)
        assert time.monotonic() - started < 15
        with pytest.raises(WorkerError, match="create a new LLM"):
            llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    # The executor stopped ranks 0 and 2 too, and gave the placement group back.
    pids = [pid for _, _, pid in executor.locations]
    _wait_until(lambda: not any(_alive(p) for p in pids), 15, f"actor processes {pids} to exit")
    _assert_nothing_left()
    llm.shutdown()   # idempotent


def test_an_error_in_an_actor_arrives_with_its_traceback(ray_cluster, tmp_path):
    """One rank is an actor too (any tensor_parallel_size): here its weights do not load."""
    folder = make_tiny_model(tmp_path, "llama", tokenizer=False)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WorkerError, match=r"(?s)worker rank 0 \(Ray actor, pid \d+ on 127\.0\.0\.\d\) raised "
                                          r"in startup\(\):\n.*not a readable safetensors file"):
        LLM(str(folder), distributed_executor_backend="ray")
    _assert_nothing_left()


def test_ranks_that_do_not_fit_the_cluster_are_a_clear_error(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 2.0)
    folder = make_tiny_model(tmp_path, "llama", tokenizer=False)   # 4 heads: tensor_parallel_size=4
    with pytest.raises(WorkerError, match=r"no room for 4 ranks of one CPU each after 2 s: it has 3 CPU "
                                          r"free of 3 \(`ray status`\)"):
        LLM(str(folder), tensor_parallel_size=4, distributed_executor_backend="ray")
    _assert_nothing_left()
