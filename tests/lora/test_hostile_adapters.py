"""LoRA adapters on a real ``microvllm serve`` process, as a hostile or careless client
and operator would use them (issue 66, items 2, 6 and 13).

Item 2: ``/v1/unload_lora_adapter`` then ``/v1/load_lora_adapter`` under the same name
from another folder answers with the new folder's weights and reads none of the old
folder's KV (the prefix cache keys an adapter by the digest of its files).

Item 6: a load that fails (a config without ``r``, a JSON list as config, a corrupt
safetensors file) is a 400 naming the problem and leaves nothing behind: the name is not
listed, a request naming it is a 404 as for any unknown model, and a good adapter loads
under it afterwards.

Item 13: an adapter the server cannot serve in ``--lora-modules`` (DoRA; a folder that
does not exist; one trained on another base model, refused after the engine started)
makes ``microvllm serve`` exit by itself, non-zero, with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import httpx
import pytest

from microvllm.models.tiny import make_tiny_model
from microvllm.tokenizer import Tokenizer
from tests.lora.conftest import ADAPTER_CONFIGS, hf_peft_greedy, make_adapter
from tests.support import ROOT, SETTINGS, STARTUP_TIMEOUT, Server, free_port

pytestmark = pytest.mark.slow

API_KEY = "hostile-lora-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 6
PROMPT = list(range(5, 5 + 40))   # 40 token ids: two full blocks of 16 under one adapter


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """The tiny llama and its adapters: two "sql" folders (same config, other weights),
    a DoRA one, one trained on another base model, and three broken ones."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("hostile_lora")
    folder = make_tiny_model(root / "model", "llama", seed=7)
    sql = dict(ADAPTER_CONFIGS["sql"])
    other = make_tiny_model(root / "other", "llama", seed=1, hidden_size=32, tokenizer=False)
    paths = {"a": make_adapter(folder, root / "sql_a", seed=1, **sql),
             "b": make_adapter(folder, root / "sql_b", seed=2, **sql),
             "dora": make_adapter(folder, root / "dora", seed=3, use_dora=True, **sql),
             "stranger": make_adapter(other, root / "stranger", seed=4, **sql)}   # another base model's
    broken = {"no_r": lambda config: {k: v for k, v in config.items() if k != "r"},
              "json_list": lambda config: [config]}
    for name, change in broken.items():
        shutil.copytree(paths["a"], root / name)
        config = json.loads((root / name / "adapter_config.json").read_text())
        (root / name / "adapter_config.json").write_text(json.dumps(change(config)))
        paths[name] = root / name
    shutil.copytree(paths["a"], root / "corrupt")
    weights = root / "corrupt" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])   # cut short: its header promises more than is there
    paths["corrupt"] = root / "corrupt"
    return folder, {name: str(path) for name, path in paths.items()}


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory):
    folder, paths = adapters
    log = tmp_path_factory.mktemp("hostile_lora_log") / "server.log"
    flags = [*SETTINGS, "--served-model-name", "tiny", "--api-key", API_KEY, "--enable-lora", "--max-loras", "2",
             "--max-lora-rank", "8", "--lora-modules", f"sql={paths['a']}"]
    with Server(folder, log, flags, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as running:
        running.wait_healthy(STARTUP_TIMEOUT)
        yield running


def expected_text(folder, adapter_path: str) -> str:
    tokens = hf_peft_greedy(str(folder), adapter_path, tuple(PROMPT), MAX_TOKENS)
    return Tokenizer.from_pretrained(folder).decode(list(tokens))


def complete(server, model: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", headers=HEADERS, timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})


def load(server, name: str, path: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/load_lora_adapter", headers=HEADERS, timeout=120,
                      json={"lora_name": name, "lora_path": path})


def unload(server, name: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/unload_lora_adapter", headers=HEADERS, timeout=60, json={"lora_name": name})


def listed(server) -> set[str]:
    return {card["id"] for card in httpx.get(server.url + "/v1/models", headers=HEADERS).json()["data"]}


def hits(server) -> float:
    return server.metrics()["prefix_cache_hits_total"]


def test_a_name_loaded_again_from_another_folder_reads_none_of_the_old_kv(server, adapters):
    folder, paths = adapters
    first = complete(server, "sql")
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] == expected_text(folder, paths["a"])
    assert unload(server, "sql").status_code == 200
    loaded = load(server, "sql", paths["b"])
    assert loaded.status_code == 200, loaded.text
    before = hits(server)
    second = complete(server, "sql")
    assert second.status_code == 200, second.text
    assert hits(server) == before, f"the new folder read {hits(server) - before:.0f} tokens of the old one's KV"
    assert second.json()["choices"][0]["text"] == expected_text(folder, paths["b"]) != expected_text(folder, paths["a"])
    # Its own blocks are cached as usual: the same prompt again is a hit.
    again = complete(server, "sql")
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
    assert hits(server) >= before + 32


@pytest.mark.parametrize("broken, words", [("no_r", ['"r"']), ("json_list", ["JSON list"]),
                                           ("corrupt", ["safetensors"])])
def test_a_failed_load_is_a_400_and_leaves_nothing_behind(server, adapters, broken, words):
    folder, paths = adapters
    response = load(server, "bad", paths[broken])
    assert response.status_code == 400, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == "lora_path"
    assert all(word in error["message"] for word in words), error["message"]
    assert "bad" not in listed(server)
    missing = complete(server, "bad")
    assert missing.status_code == 404, (missing.status_code, missing.text)
    assert missing.json()["error"]["type"] == "NotFoundError"
    # The name is free: a good adapter loads under it and answers with its weights.
    good = load(server, "bad", paths["a"])
    assert good.status_code == 200, good.text
    answer = complete(server, "bad")
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected_text(folder, paths["a"])
    assert unload(server, "bad").status_code == 200


@pytest.mark.parametrize("adapter, words", [
    ("dora", ["--lora-modules sql=", "use_dora=True", "DoRA is not supported"]),
    ("missing", ["--lora-modules sql=", "is not a peft adapter folder"]),
    ("stranger", ["was it trained on another base model?"])])
def test_an_adapter_refused_at_startup_ends_the_server(adapters, tmp_path, adapter, words):
    """A DoRA adapter or a missing folder is refused before the model loads; one trained on
    another base model only once the engine (and its core process) is up, from the model's
    config: that refusal, like any error after the engine exists, must still end the
    process, not leave it neither serving nor gone."""
    folder, paths = adapters
    path = paths.get(adapter, str(tmp_path / "no-such-adapter"))
    command = [sys.executable, "-m", "microvllm", "serve", str(folder), "--port", str(free_port()), *SETTINGS,
               "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"sql={path}"]
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=STARTUP_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)   # the server and its engine core
        _, stderr = process.communicate()
        pytest.fail(f"`microvllm serve` with a bad --lora-modules adapter neither served nor exited in "
                    f"{STARTUP_TIMEOUT:.0f} s; its output:\n{stderr[-3000:]}")
    assert process.returncode != 0, stderr
    assert all(word in stderr for word in words), stderr
