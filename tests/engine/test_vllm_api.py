"""vLLM's offline API surface: the public names, EngineArgs as flags, LLMEngine, the
harmless vLLM arguments of LLM(), its methods, chat() options, hub ids offline."""

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import microvllm
import microvllm.config
from microvllm import (
    LLM,
    CompletionOutput,
    EngineArgs,
    FlexibleArgumentParser,
    LLMEngine,
    RequestOutput,
    SamplingParams,
    TextPrompt,
    TokensPrompt,
    cleanup_dist_env_and_memory,
)
from microvllm.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"]), max_model_len=128, debug_invariants=True)


def test_public_names():
    for name in ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineArgs",
                 "LLMEngine", "TokensPrompt", "TextPrompt", "FlexibleArgumentParser",
                 "cleanup_dist_env_and_memory"]:
        assert name in microvllm.__all__ and hasattr(microvllm, name)
    assert cleanup_dist_env_and_memory() is None  # one process: nothing to tear down


def test_engine_args_as_flags_round_trip(tiny_models):
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(tiny_models["llama"]), "--max_num_seqs", "8",
                              "--no-enable-prefix-caching", "--gpu-memory-utilization=0.25"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.max_num_seqs, engine_args.enable_prefix_caching) == (8, False)
    assert engine_args.gpu_memory_utilization == 0.25
    defaults = EngineArgs.from_cli_args(parser.parse_args([]))
    flagless = {"profiler_config", "components", "trace", "debug_invariants"}
    assert {k: v for k, v in dataclasses.asdict(defaults).items() if k not in flagless} == \
        {k: v for k, v in dataclasses.asdict(EngineArgs()).items() if k not in flagless}
    # Every resolved setting is an EngineArgs field (one list of options), and each lives
    # in exactly one of the config's parts. (profiler_config, speculative_config,
    # kv_events_config and kv_transfer_config are one option each, holding a dict, as in vLLM.)
    whole = ("profiler_config", "speculative_config", "kv_events_config", "kv_transfer_config")
    assert set(whole) <= {f.name for f in dataclasses.fields(EngineArgs)}
    parts = [f.type.removesuffix(" | None") for f in dataclasses.fields(EngineConfig) if f.name.endswith("_config")
             and f.name not in whole]
    names = [f.name for part in parts for f in dataclasses.fields(getattr(microvllm.config, part))]
    assert len(names) == len(set(names)), names
    assert set(names) - {"model_path", "hf_config"} <= {f.name for f in dataclasses.fields(EngineArgs)}


def test_llm_engine_step_loop_with_tokens_prompt_and_list_abort(tiny_models):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_models["llama"]), max_model_len=128))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", TokensPrompt(prompt_token_ids=[5, 6, 7]), params)
    engine.add_request("b", TextPrompt(prompt="hello"), params)
    engine.add_request("c", "hello", params)
    engine.step()
    assert engine.abort_request(["a", "b", "never-added"]) is True
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["c"]
    assert isinstance(finished[0], RequestOutput) and isinstance(finished[0].outputs[0], CompletionOutput)


def test_harmless_vllm_arguments_log_what_they_do(tiny_models, caplog):
    with caplog.at_level(logging.INFO, logger="microvllm"):
        llm = LLM(str(tiny_models["llama"]), max_model_len=64, tensor_parallel_size=1, dtype="auto",
                  gpu_memory_utilization=0.5, kv_cache_memory_bytes=2 * 8192 * 4,
                  trust_remote_code=False, tokenizer=None, disable_log_stats=True, enforce_eager=False)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("microvllm.")]
    assert any("dtype='auto'" in m and "float32" in m for m in messages)
    assert any("gpu_memory_utilization=0.5" in m for m in messages)
    assert any("disable_log_stats" in m for m in messages)
    assert llm.engine.config.model_config.dtype == "float32"
    assert llm.engine.config.cache_config.kv_cache_memory_bytes == 8192 * 4  # half of the budget
    assert llm.engine.num_kv_blocks == 4


def test_enforce_eager_reaches_the_engine_config(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_model_len=64, enforce_eager=True)
    assert llm.engine.config.device_config.enforce_eager is True and llm.engine.platform.enforce_eager


def test_the_resolved_config_is_frozen_and_the_engine_writes_none_of_it(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_model_len=64, num_kv_blocks=None, trace=True)
    config = llm.engine.config
    before = repr(config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache_config.num_kv_blocks = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.scheduler_config = None
    llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert repr(config) == before and config.cache_config.num_kv_blocks is None  # the user's None
    assert llm.engine.num_kv_blocks > 2          # decided by the executor, kept by the engine
    assert "auto" not in (config.model_config.dtype, config.device_config.device,
                          config.device_config.attention_backend)
    assert llm.trace is not None and not hasattr(config, "trace")   # the hooks sit beside it


def test_methods(llm, tiny_models):
    assert llm.llm_engine is llm.engine
    hf_tokenizer = llm.get_tokenizer()
    text = hf_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                            add_generation_prompt=True)
    assert isinstance(text, str) and "hi" in text
    assert llm.get_default_sampling_params() == SamplingParams()  # no sampling keys in the tiny config


def test_default_sampling_params_from_generation_config(tiny_models, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=40, do_sample=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    params = LLM(str(folder), max_model_len=64).get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 20, 40)
    plain = LLM(str(folder), max_model_len=64, generation_config="vllm").get_default_sampling_params()
    assert plain == SamplingParams()


def test_reset_prefix_cache(llm):
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 32
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0
    # While a request runs, only reset_running_requests=True resets (it is recomputed).
    engine = llm.llm_engine
    engine.add_request("running", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    assert llm.reset_prefix_cache() is False
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert len(outputs[0].outputs[0].token_ids) == 8


def test_profile_writes_a_chrome_trace(tiny_models, tmp_path):
    llm = LLM(str(tiny_models["llama"]), max_model_len=64,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path / "traces")})
    llm.start_profile()
    llm.generate("profile me", SamplingParams(max_tokens=3), use_tqdm=False)
    path = llm.stop_profile()
    assert path.parent == tmp_path / "traces"
    assert "traceEvents" in json.loads(path.read_text())
    with pytest.raises(RuntimeError, match="start_profile"):
        llm.stop_profile()


def test_chat_options(llm):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    out = llm.chat(parts, params, use_tqdm=False)[0]
    plain = llm.chat([{"role": "user", "content": "hello\nthere"}], params, use_tqdm=False)[0]
    assert out.prompt == plain.prompt and "hello\nthere" in out.prompt
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt, add_special_tokens=False)

    template = "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ greeting }}]{% endfor %}"
    out = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False, chat_template=template,
                   chat_template_kwargs={"greeting": "yo"}, add_generation_prompt=False)[0]
    assert out.prompt == "[user|hi|yo]"

    partial = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    out = llm.chat(partial, params, use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert out.prompt.endswith("Once upon")
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(partial, params, use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match="only text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)


def run_with_hf_home(hf_home: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(hf_home), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow   # about 12 s: a subprocess
def test_hub_id_resolves_from_the_local_cache(tiny_models, tmp_path):
    # The layout huggingface_hub writes: hub/models--org--name/{refs/main, snapshots/<commit>/}
    repo = tmp_path / "hf" / "hub" / "models--tiny-org--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_models["llama"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    code = ("from microvllm import LLM, SamplingParams\n"
            "llm = LLM('tiny-org/tiny-llama', max_model_len=64)\n"
            "print(llm.engine.model_path)\n"
            "print(len(llm.generate('hi', SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)"
            "[0].outputs[0].token_ids))")
    result = run_with_hf_home(tmp_path / "hf", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(repo / "snapshots" / commit), "3"]


def test_missing_hub_id_says_how_to_get_it(tmp_path):
    result = run_with_hf_home(tmp_path / "empty", "from microvllm import LLM\nLLM('someone/absent-model')")
    assert result.returncode != 0
    message = result.stderr[result.stderr.index("FileNotFoundError"):]
    for words in ["someone/absent-model", "not in the local Hugging Face cache", "never downloads",
                  "hf download someone/absent-model", "HF_HOME"]:
        assert words in message
