"""The KV cache's size on a GPU (worker/gpu_memory.py), from made-up memory readings,
and the profiling pass (worker/profile_run.py) run on a CPU."""

from __future__ import annotations

import pytest
import torch

from microvllm.worker.gpu_memory import MemoryProfile, num_gpu_blocks
from microvllm.worker.profile_run import dummy_prefill_batch, profile_run

GiB, MiB = 2**30, 2**20


def test_fraction_of_free_memory_minus_the_peak_in_blocks():
    profile = MemoryProfile(total_bytes=80 * GiB, free_bytes_at_start=60 * GiB, peak_bytes=10 * GiB)
    # 60 GiB x 0.5 = 30 GiB; less the 10 GiB peak = 20 GiB; 2 MiB blocks -> 10240
    assert num_gpu_blocks(profile, 0.5, 2 * MiB) == 10240
    # A part-block left over is not a block.
    assert num_gpu_blocks(profile, 0.5, 3 * MiB) == 20 * GiB // (3 * MiB)
    # Memory others hold (80 - 60 GiB) is never counted as ours.
    alone = MemoryProfile(total_bytes=80 * GiB, free_bytes_at_start=80 * GiB, peak_bytes=10 * GiB)
    assert num_gpu_blocks(alone, 0.5, 2 * MiB) == 15360


def test_no_room_says_what_to_change():
    profile = MemoryProfile(total_bytes=16 * GiB, free_bytes_at_start=15 * GiB, peak_bytes=14 * GiB)
    with pytest.raises(RuntimeError, match="Raise gpu_memory_utilization, lower max_num_batched_tokens"):
        num_gpu_blocks(profile, 0.9, 2 * MiB)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        num_gpu_blocks(profile, 1.5, 2 * MiB)


def test_dummy_batch_cuts_requests_at_max_model_len():
    input_ids, positions, metadata, num_blocks = dummy_prefill_batch(40, 16, 16, num_groups=2)
    m = metadata[0]
    assert len(metadata) == 2 and num_blocks == 4  # null block + 3
    assert m.seq_lens_cpu == [16, 16, 8] and m.query_start_loc_cpu == [0, 16, 32, 40]
    assert m.block_table.tolist() == [[1], [2], [3]]
    assert positions.tolist() == list(range(16)) * 2 + list(range(8))
    assert m.slot_mapping.tolist() == list(range(16, 56))  # blocks 1..3, never the null block
    assert input_ids.shape == (40,)


def test_profile_run_runs_the_largest_batch(tiny_models):
    from microvllm.attention.selector import get_attention_backend
    from microvllm.models.loader import load_model

    model, config = load_model(tiny_models["llama"], get_attention_backend("torch"))
    attn = model.layers[0].self_attn
    logits = profile_run(model, num_tokens=48, max_num_seqs=8, max_model_len=32, block_size=16,
                         num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, dtype=torch.float32)
    assert logits.shape == (8, config.vocab_size) and torch.isfinite(logits).all()


def test_engine_sizes_the_cache_from_gpu_readings_with_the_cpu_log_line(tiny_models, monkeypatch, caplog):
    """The engine's CUDA branch, with the platform said to be CUDA and the readings faked."""
    import logging
    from types import SimpleNamespace

    from microvllm import LLM

    engine = LLM(str(tiny_models["llama"]), device="cpu", max_model_len=64, max_num_seqs=4).engine
    per_block = engine.executor.kv_cache_bytes_per_block()
    allocated = []
    monkeypatch.setattr(engine, "platform", SimpleNamespace(device=torch.device("cuda")))
    monkeypatch.setattr(engine.executor, "initialize_kv_cache", allocated.append)
    engine.config.num_kv_blocks, engine.config.gpu_memory_utilization = None, 0.5
    readings = MemoryProfile(total_bytes=0, free_bytes_at_start=2 * 10 * per_block, peak_bytes=3 * per_block)
    monkeypatch.setattr(engine.executor, "profile_memory", lambda: readings)
    with caplog.at_level(logging.INFO, logger="microvllm"):
        assert engine._initialize_kv_caches() == 7 == allocated[0]   # 10 blocks' worth - 3
    assert any(m.startswith("KV cache: 7 blocks x 16 tokens") for m in caplog.messages)
    # Never more than max_num_seqs full-length requests could use: 4 x 4 blocks + the null block.
    readings = MemoryProfile(total_bytes=0, free_bytes_at_start=10**6 * per_block, peak_bytes=0)
    assert engine._initialize_kv_caches() == 17
