"""Choosing the platform: device="auto" | "cpu" | "cuda", what dtype="auto" becomes, and
the CUDA platform's answers. Everything here runs on a CPU; the CUDA engine itself is
checked by ``python -m microvllm bench gpu`` on a GPU."""

from __future__ import annotations

import pytest
import torch

from microvllm import LLM
from microvllm.config import DEFAULT_KV_CACHE_BYTES
from microvllm.engine.arg_utils import EngineArgs
from microvllm.platforms import get_platform, resolve_device

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize("device, cuda_available, expected", [
    ("auto", True, "cuda"), ("auto", False, "cpu"), ("cpu", True, "cpu"), ("cpu", False, "cpu"),
    ("cuda", True, "cuda")])
def test_resolve_device(device, cuda_available, expected):
    assert resolve_device(device, cuda_available) == expected


def test_cuda_without_a_gpu_says_what_to_change():
    with pytest.raises(ValueError, match="device='cpu' or 'auto'"):
        resolve_device("cuda", cuda_available=False)
    with pytest.raises(ValueError, match="choose one of"):
        resolve_device("tpu", cuda_available=True)


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal on a machine without CUDA")
def test_llm_on_cuda_without_a_gpu_is_refused(tiny_models):
    with pytest.raises(ValueError, match="torch.cuda.is_available"):
        LLM(str(tiny_models["llama"]), device="cuda", max_model_len=64)


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal on a machine without CUDA")
def test_cli_refuses_cuda_without_a_gpu_in_one_line(tiny_models, capsys):
    from microvllm.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", "--model", str(tiny_models["llama"]), "--device", "cuda"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "device='cuda'" in err and "Traceback" not in err


def test_unknown_device_is_refused_at_the_door():
    with pytest.raises(ValueError, match="device='gpu'"):
        EngineArgs(device="gpu").create_engine_config()


@pytest.mark.skipif(not NO_CUDA, reason="auto picks CUDA on this machine")
def test_auto_on_a_cpu_is_the_cpu_platform_in_float32(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_model_len=64)  # device and dtype "auto"
    config = llm.engine.config
    assert (config.device_config.device, config.model_config.dtype, llm.engine.platform.name) == \
        ("cpu", "float32", "cpu")
    assert llm.engine.executor.worker.kv_caches[0].device.type == "cpu"


def test_the_cuda_platform_answers_without_touching_a_gpu():
    from microvllm.platforms.cuda import CudaPlatform

    platform = CudaPlatform()
    assert platform.device == torch.device("cuda")
    assert platform.resolve_dtype("auto") == "bfloat16" and platform.resolve_dtype("float32") == "float32"
    assert platform.resolve_attention_backend("auto") == "triton"
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        platform.resolve_attention_backend("cpu")
    assert get_platform("cpu").resolve_dtype("auto") == "float32"


def _model_on(backend_name: str):
    """A stand-in with what ``decode_step_runner`` looks at: the first layer's backend."""
    from types import SimpleNamespace

    from microvllm.attention.selector import get_attention_backend_class

    backend = object.__new__(get_attention_backend_class(backend_name))  # no triton import needed
    attn = SimpleNamespace(attn=SimpleNamespace(backend=backend))
    return SimpleNamespace(layers=[SimpleNamespace(self_attn=attn)],
                           config=SimpleNamespace(max_position_embeddings=256))


def test_cuda_graphs_only_with_the_triton_backend_and_not_eager():
    from microvllm.platforms.cuda import CudaPlatform
    from microvllm.platforms.cuda_graph import CUDAGraphWrapper

    runner = CudaPlatform().decode_step_runner(_model_on("triton"), max_num_seqs=20, max_model_len=128)
    assert isinstance(runner, CUDAGraphWrapper)
    assert runner.capture_sizes == [1, 2, 4, 8, 16] and runner.max_model_len == 128
    assert CudaPlatform(enforce_eager=True).decode_step_runner(_model_on("triton"), max_num_seqs=20) is None
    assert CudaPlatform().decode_step_runner(_model_on("torch"), max_num_seqs=20) is None
    # A mixture of experts sizes each step's work from its routing: no graph can replay that.
    moe = _model_on("triton")
    moe.is_mixture_of_experts = True
    assert CudaPlatform().decode_step_runner(moe, max_num_seqs=20) is None


def test_engine_args_settle_auto_with_the_platform_and_pass_the_gpu_fraction(tiny_models):
    from microvllm.platforms.cpu.platform import CpuPlatform
    from microvllm.platforms.cuda import CudaPlatform

    model = str(tiny_models["llama"])
    on_cpu = EngineArgs(model=model, dtype="auto").create_engine_config(CpuPlatform())
    assert on_cpu.model_config.dtype == "float32" and on_cpu.device_config.device == "cpu"
    assert EngineArgs(model=model, dtype="half").create_engine_config(CpuPlatform()).model_config.dtype == "float16"
    # On a GPU (the platform's answers need none): a fraction of the GPU's memory, no byte budget.
    cache = EngineArgs(model=model, gpu_memory_utilization=0.5).create_engine_config(CudaPlatform()).cache_config
    assert (cache.gpu_memory_utilization, cache.kv_cache_memory_bytes) == (0.5, None)
    config = EngineArgs(model=model).create_engine_config(CudaPlatform())
    assert config.cache_config.gpu_memory_utilization == 0.9  # vLLM's default
    assert (config.model_config.dtype, config.device_config.device) == ("bfloat16", "cuda")
    # On a CPU: that fraction of the byte budget.
    cache = EngineArgs(model=model, gpu_memory_utilization=0.5).create_engine_config(CpuPlatform()).cache_config
    assert (cache.gpu_memory_utilization, cache.kv_cache_memory_bytes) == (None, DEFAULT_KV_CACHE_BYTES // 2)
