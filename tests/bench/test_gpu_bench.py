"""``python -m microvllm bench gpu``: it refuses cleanly without CUDA, and every part it
runs that can run on a CPU is run here, with tiny shapes (the kernels in Triton's
interpreter). The GPU run itself is the device check, not a test."""

from __future__ import annotations

import pytest
import torch

from microvllm.bench.gpu_checks import engine_parity, kernel_parity
from microvllm.bench.gpu_speed import build_random_model, engine_speed, hf_static_batch
from microvllm.bench.throughput import random_workload
from microvllm.cli.main import main as cli_main

TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=256)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_without_cuda_saying_where_to_run(capsys):
    assert cli_main(["bench", "gpu"]) == 1
    err = capsys.readouterr().err
    assert "torch.cuda.is_available() is False" in err and "NVIDIA GPU" in err


def test_bench_gpu_has_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "gpu", "--help"])
    assert exit_.value.code == 0 and "CUDA graphs >= 2x eager" in capsys.readouterr().out


def test_kernel_checks_pass_on_a_cpu_and_can_fail():
    checks = kernel_parity("cpu", torch.float32)
    assert checks and all(c.passed for c in checks), [c.line() for c in checks if not c.passed]
    names = [c.name for c in checks]
    assert any("decode kernel" in n for n in names) and any("write_kv" in n for n in names)
    # A reference that disagrees is caught (the check compares, it does not just run).
    from microvllm.attention.torch_ref import TorchReferenceBackend
    original = TorchReferenceBackend.forward
    try:
        TorchReferenceBackend.forward = lambda self, q, *a, **k: original(self, q, *a, **k) + 1e-3
        assert not any(c.passed for c in kernel_parity("cpu", torch.float32, cases=[([1, 1], [5, 9], None)])
                       if "kernel" in c.name)
    finally:
        TorchReferenceBackend.forward = original


def test_engine_parity_on_a_cpu(tmp_path):
    checks = engine_parity("cpu", archs=("llama",), num_prompts=3, max_tokens=4, folder=tmp_path)
    assert len(checks) == 2 and all(c.passed for c in checks), [c.line() for c in checks]


def test_end_to_end_parts_on_a_tiny_shape(tmp_path):
    hf = build_random_model(tmp_path, "cpu", torch.float32, **TINY_SHAPE)
    assert hf.config.hidden_size == 64 and (tmp_path / "model.safetensors").exists()
    workload = random_workload(3, (5, 12), (6, 6), TINY_SHAPE["vocab_size"], seed=0)
    static = hf_static_batch(hf, workload)
    assert [len(o) for o in static.outputs] == [6, 6, 6] and static.useful_rate > 0
    fast, fast_step = engine_speed(tmp_path, "cpu", "float32", workload, enforce_eager=False,
                                   max_model_len=64)
    eager, eager_step = engine_speed(tmp_path, "cpu", "float32", workload, enforce_eager=True,
                                     max_model_len=64)
    assert fast.outputs == eager.outputs and [len(o) for o in eager.outputs] == [6, 6, 6]
    assert fast_step > 0 and eager_step > 0
    assert eager.name == "microvllm (enforce_eager)"
