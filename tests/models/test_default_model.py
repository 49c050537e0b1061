"""The embedded model's first use (``models/default_model.py``): processes that start
together on an empty cache convert it once, and none ever sees its folder half-written,
deleted or replaced while it reads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from microvllm.models import default_model

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = 3

# One process of the race. Imports first, then a barrier (every process waits for the
# "go" file), so that all of them find the cache empty; then it resolves the folder and
# reads it (config, tokenizer, a tensor), and goes on reading it until every process has
# resolved it too: a process that deleted or replaced the folder meanwhile breaks a read,
# or changes the folder's inode, which this process reports.
CHILD = r"""
import json, logging, os, sys, time
from pathlib import Path

from safetensors import safe_open

from microvllm.models.default_model import default_model_path
from microvllm.tokenizer import Tokenizer

rundir, me, processes = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
logging.basicConfig(level=logging.WARNING)   # "converting ..." on stderr: the test counts them


def read(folder):
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert Tokenizer.from_pretrained(folder).encode("Hello, world")
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        assert weights.get_tensor(sorted(weights.keys())[0]).numel() > 0


(rundir / f"ready-{me}").touch()
while not (rundir / "go").exists():
    time.sleep(0.005)
status = "failed"
try:
    folder = default_model_path()
    inode = os.stat(folder).st_ino
    read(folder)
    status = "resolved"
finally:
    (rundir / f"{status}-{me}").touch()
deadline = time.monotonic() + 600
while (len([*rundir.glob("resolved-*"), *rundir.glob("failed-*")]) < processes
       and time.monotonic() < deadline):
    read(folder)
read(folder)
print(json.dumps({"folder": str(folder), "inode": inode, "inode_after": os.stat(folder).st_ino}))
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_three_processes_on_an_empty_cache_convert_once_and_all_read_the_folder(tmp_path):
    default_model.find_gguf()   # not installed: fails here with the install line
    cache, rundir = tmp_path / "cache", tmp_path / "run"
    rundir.mkdir()
    env = {**os.environ, "MICROVLLM_CACHE": str(cache), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TQDM_DISABLE": "1"}   # no progress bars: a failure's traceback is what stderr's end shows
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(rundir), str(i), str(PROCESSES)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(PROCESSES)]
    try:
        deadline = time.monotonic() + 120
        while len(list(rundir.glob("ready-*"))) < PROCESSES:
            assert time.monotonic() < deadline, "the processes did not start"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
            time.sleep(0.05)
        (rundir / "go").touch()   # all at once, on the empty cache
        results = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [f"process {i} (exit {p.returncode}):\n{err[-3000:]}"
              for i, (p, (_, err)) in enumerate(zip(procs, results)) if p.returncode != 0]
    assert not failed, "\n".join(failed)
    target = cache / default_model.MODEL_NAME
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    assert {r["folder"] for r in reports} == {str(target)}
    # One folder, renamed into place once: no process saw it replaced while it read it.
    assert {r["inode"] for r in reports} == {r["inode_after"] for r in reports} == {os.stat(target).st_ino}
    assert default_model.is_complete(target)
    conversions = sum(err.count("first use only") for _, err in results)
    assert conversions == 1, f"{conversions} processes converted the model; one should, the others wait"
    assert sorted(p.name for p in cache.iterdir()) == [default_model.MODEL_NAME, f"{default_model.MODEL_NAME}.lock"]


def fake_folder(path: Path, complete: bool) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    if complete:
        (path / default_model.COMPLETE_MARKER).write_text("")
    return path


def test_a_complete_folder_is_returned_without_converting(tmp_path, monkeypatch):
    monkeypatch.setenv("MICROVLLM_CACHE", str(tmp_path))
    fake_folder(tmp_path / default_model.MODEL_NAME, complete=True)
    monkeypatch.setattr(default_model, "find_gguf", lambda: pytest.fail("looked for the GGUF"))
    assert default_model.default_model_path() == tmp_path / default_model.MODEL_NAME


def test_the_check_is_repeated_under_the_lock(tmp_path, monkeypatch):
    """A process that waited for the lock finds the folder another one converted meanwhile."""
    monkeypatch.setenv("MICROVLLM_CACHE", str(tmp_path))
    target = tmp_path / default_model.MODEL_NAME
    monkeypatch.setattr(default_model, "find_gguf", lambda: tmp_path / default_model.GGUF_NAME)
    monkeypatch.setattr(default_model, "convert_gguf", lambda gguf, folder: pytest.fail("converted twice"))

    class ConvertedWhileWaiting:   # the lock: acquired only once the other process is done
        def __init__(self, path):
            pass

        def acquire(self, timeout=-1):
            if timeout == 0:
                raise default_model.Timeout("held")
            fake_folder(target, complete=True)

        def release(self):
            pass

    monkeypatch.setattr(default_model, "FileLock", ConvertedWhileWaiting)
    assert default_model.default_model_path() == target


def test_an_incomplete_folder_is_replaced_and_a_complete_one_kept(tmp_path):
    target = fake_folder(tmp_path / "model", complete=False)   # an interrupted or older conversion
    new = fake_folder(tmp_path / ".convert-1", complete=True)
    default_model._move_into_place(new, target)
    assert default_model.is_complete(target) and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]   # the stale folder is gone

    inode = os.stat(target).st_ino
    late = fake_folder(tmp_path / ".convert-2", complete=True)   # a racing process's (no lock)
    default_model._move_into_place(late, target)
    assert os.stat(target).st_ino == inode, "a complete folder was replaced"
