"""An engine core in a process of its own, when something goes wrong between the two
processes or at the end of the script.

A message that cannot be decoded, on either socket, never ends the thread that reads it
(which would leave every request waiting forever): it is logged, what it names fails, and
the next request runs. A utility call to a core that never answers raises within its
deadline (``VLLM_RPC_TIMEOUT``). A script that never calls ``shutdown()`` exits within
seconds, however it ends, and leaves no core process behind.

Every wait here has a bound, so that a regression fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq

from microvllm import LLM, SamplingParams
from microvllm.engine.core_proc import ADD, OUTPUTS, UTILITY, UTILITY_OUTPUT
from microvllm.models.tiny import make_tiny_model
from tests.support import ROOT, alive, wait_for

pytestmark = pytest.mark.multiprocess   # each test starts an engine core process (a few seconds)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"))


@contextlib.contextmanager
def core_in_a_process(tiny: str, monkeypatch):
    """An ``LLM`` with its core in a process of its own, shut down at the end. (Started in
    the test itself, not a fixture: the core process then writes to the fd ``capfd`` reads.)"""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = LLM(tiny, max_model_len=128, num_kv_blocks=64)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    try:
        yield llm
    finally:
        os.kill(llm.llm_engine.engine_core.process.pid, signal.SIGCONT)   # a test that stopped it
        llm.shutdown()


def within(seconds: float, work, what: str):
    """``work()``'s result, run on a thread: a hang is a failure after ``seconds``, not a hung run."""
    result: dict = {}

    def run():
        try:
            result["value"] = work()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{what} did not return within {seconds} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def generates(llm: LLM) -> list[int]:
    return within(60, lambda: list(llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids),
                  "a normal request")


def send_to_core(client, *frames: bytes) -> None:
    """Raw frames to core 0 through the client's own ROUTER (the core's DEALER connects to
    it and binds nothing, so this socket is the only way in)."""
    with client._send_lock:
        client._input.send_multipart([client.cores[0].identity, *frames])


@pytest.mark.slow
def test_an_undecodable_message_to_the_core_is_dropped_and_the_core_serves_on(tiny, monkeypatch, capfd):
    with core_in_a_process(tiny, monkeypatch) as mp_llm:
        client = mp_llm.llm_engine.engine_core
        expected = generates(mp_llm)
        answer: queue.Queue = queue.Queue()
        client._calls[10_000] = answer   # a utility call the client waits for
        send_to_core(client, ADD, b"\xc1")                                    # not MessagePack
        send_to_core(client, ADD, b"\x91" * 100_000 + b"\xc0")                # nested past Python's limit
        send_to_core(client, b"\x07", b"", b"")                               # three frames, an unknown kind
        send_to_core(client, ADD, msgspec.msgpack.encode({"request_id": "bad-1", "prompt_token_ids": "x"}))
        send_to_core(client, UTILITY, msgspec.msgpack.encode([10_000, 7, "not a list"]))
        # The two that name what they were for get an error back, instead of nothing ever.
        result, error = within(30, lambda: answer.get(timeout=25), "the refused utility call's answer")
        assert result is None and error[0] == "RuntimeError" and "could not decode this utility call" in error[1]
        failed = within(30, lambda: _output_for(client, "bad-1"), "the refused request's output")
        assert failed.finish_reason == "error" and "could not decode this request" in failed.error
        # The core's input thread lives: the next request runs, with the same tokens as before.
        assert generates(mp_llm) == expected
        log = capfd.readouterr().err
        assert log.count("engine core 0 dropped a message it could not decode") == 5, log[-3000:]
        assert "kind ADD, 2 frames, 100002 bytes" in log


def _output_for(client, request_id: str):
    while True:
        outputs = client.get_output(timeout=25)
        assert outputs is not None, f"no output for {request_id}"
        for output in outputs.outputs:
            if output.request_id == request_id:
                return output


@pytest.mark.slow
def test_an_undecodable_message_from_the_core_fails_what_it_names_and_the_reader_goes_on(tiny, monkeypatch, caplog):
    with core_in_a_process(tiny, monkeypatch) as mp_llm:
        client, engine = mp_llm.llm_engine.engine_core, mp_llm.llm_engine
        expected = generates(mp_llm)
        core_pid = client.process.pid
        os.kill(core_pid, signal.SIGSTOP)   # nothing of the core's own arrives meanwhile
        engine.add_request("victim", "hello", SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
        [victim] = engine.output_processor.child_ids("victim")
        answer: queue.Queue = queue.Queue()
        client._calls[10_000] = answer
        push = zmq.Context.instance().socket(zmq.PUSH)   # a same-user process can connect to the 0700 folder
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(client.output_address)
        push.send_multipart([OUTPUTS, b"\xc1"])                                       # not MessagePack
        push.send_multipart([b"\x07", b"", b""])                                      # three frames, an unknown kind
        push.send_multipart([UTILITY_OUTPUT, b"\x91" * 100_000 + b"\xc0"])            # nested past Python's limit
        push.send_multipart([UTILITY_OUTPUT, msgspec.msgpack.encode([10_000, None])])  # a field short
        push.send_multipart([OUTPUTS, msgspec.msgpack.encode(
            {"outputs": [{"request_id": victim, "new_token_ids": "x"}], "engine_index": 0})])
        push.close()
        try:
            result, error = within(30, lambda: answer.get(timeout=25), "the utility call's answer")
            assert result is None and error[0] == "RuntimeError" and "could not be decoded" in error[1]

            def victim_output():
                while True:
                    for out in engine.step(timeout=25):
                        if out.request_id == "victim":
                            return out
            failed = within(30, victim_output, "the victim's output")
            assert failed.finished and failed.outputs[0].finish_reason == "error"
            assert "could not be decoded" in failed.error
        finally:
            os.kill(core_pid, signal.SIGCONT)
        # The reader lives, and the core was told to drop the victim: the next request runs alone.
        assert generates(mp_llm) == expected
        assert client.dead_error is None and not engine.has_unfinished_requests()
        assert within(30, lambda: _running_after_abort(client), "the core's stats") == 0
        log = caplog.text
        assert log.count("dropped a message from the engine core that could not be decoded") == 5, log[-3000:]
        assert "kind UTILITY_OUTPUT, 2 frames, 100002 bytes" in log


def _running_after_abort(client) -> int:
    deadline = time.monotonic() + 25
    while client.latest_stats is None or client.latest_stats.num_running_reqs:
        assert time.monotonic() < deadline, "the core still runs a request nobody waits for"
        time.sleep(0.05)
    return client.latest_stats.num_running_reqs


@pytest.mark.slow
def test_a_utility_call_to_a_core_that_never_answers_raises_within_its_deadline(tiny, monkeypatch):
    with core_in_a_process(tiny, monkeypatch) as mp_llm:
        client = mp_llm.llm_engine.engine_core
        monkeypatch.setenv("VLLM_RPC_TIMEOUT", "2000")   # vLLM's name, in milliseconds
        os.kill(client.process.pid, signal.SIGSTOP)      # alive, and silent
        try:
            with pytest.raises(TimeoutError, match=r"did not answer the utility call reset_prefix_cache\(\) within 2 s"
                                                   r".*VLLM_RPC_TIMEOUT"):
                within(60, lambda: client.call_utility("reset_prefix_cache", False), "the utility call")
        finally:
            os.kill(client.process.pid, signal.SIGCONT)
        assert within(60, mp_llm.reset_prefix_cache, "the next utility call") is True
        assert client._calls == {}, "the call that timed out is forgotten (its late answer dropped)"


def test_an_llm_nobody_holds_any_more_stops_its_core(tiny, monkeypatch):
    """vLLM's ``weakref.finalize`` on the client: the reader thread holds the client only
    while it reads, so a dropped ``LLM`` is collected and its core told to stop."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = LLM(tiny, max_model_len=128, num_kv_blocks=64)
    process = llm.llm_engine.engine_core.process
    generates(llm)
    del llm
    deadline = time.monotonic() + 30
    while process.is_alive() and time.monotonic() < deadline:
        gc.collect()   # (the engine's objects may hold one another: collected by the collector, not at once)
        process.join(0.5)
    alive_after = process.is_alive()
    if alive_after:
        process.kill()
    assert not alive_after, "the core of a dropped LLM runs on"


SCRIPT = """
import tempfile

# A weakref.finalize made before multiprocessing is imported: its exit hook then runs after
# multiprocessing's, which joins the core (the client's own atexit registration must not
# rely on weakref.finalize's).
scratch = tempfile.TemporaryDirectory()

import asyncio
import sys

from microvllm import LLM, SamplingParams
from microvllm.engine.async_llm import AsyncLLM


def main():
    folder, front_end, ending = sys.argv[1:4]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    if front_end == "LLM":   # VLLM_ENABLE_V1_MULTIPROCESSING=1: the core in a process of its own
        llm = LLM(folder, max_model_len=128, num_kv_blocks=64)
        token_ids = llm.generate("hello", params, use_tqdm=False)[0].outputs[0].token_ids
    else:
        llm = AsyncLLM(folder, multiprocess=True, max_model_len=128, num_kv_blocks=64)

        async def run():
            async for out in llm.generate("hello", params, "one"):
                pass
            return out.outputs[0].token_ids
        token_ids = asyncio.run(run())
    print("OUTPUT", len(token_ids), *[core.process.pid for core in llm.engine.engine_core.cores], flush=True)
    if ending == "raise":
        raise RuntimeError("the script fails")
    if ending == "exit":
        sys.exit(3)
    return llm


if __name__ == "__main__":
    llm = main()   # a script's global: alive to the end, never shut down
"""


@pytest.mark.slow
@pytest.mark.parametrize("front_end, ending, exit_code", [
    ("LLM", "end", 0), ("LLM", "raise", 1), ("LLM", "exit", 3), ("AsyncLLM", "end", 0)])
def test_a_script_that_never_calls_shutdown_exits_within_seconds(tiny, tmp_path, front_end, ending, exit_code):
    """Before: multiprocessing's exit handler joined the core, which nobody had told to
    stop, and the script printed its output and then hung (for good). 60 s is generous:
    the exit takes about a second."""
    script, log = tmp_path / "script.py", tmp_path / "stderr.log"
    script.write_text(SCRIPT)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, str(script), tiny, front_end, ending], cwd=ROOT, env=env,
                                   stdout=subprocess.PIPE, stderr=stderr, text=True)
    core_pids: list[int] = []
    try:
        line = within(300, process.stdout.readline, "the script's output")
        assert line.startswith("OUTPUT 6 "), (line, log.read_text()[-3000:])
        core_pids = [int(pid) for pid in line.split()[2:]]
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the script printed its output and did not exit within 60 s "
                                 f"({front_end}, ending: {ending})") from None
        assert process.returncode == exit_code, log.read_text()[-3000:]
        wait_for(lambda: not any(alive(pid) for pid in core_pids), 10, "the core process to be gone")
    finally:
        process.kill()
        process.wait()
        for pid in core_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
