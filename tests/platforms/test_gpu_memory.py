"""The KV cache's size on a GPU (platforms/gpu_memory.py), from made-up memory readings,
and the profiling pass (worker/profile_run.py) run on a CPU."""

from __future__ import annotations

import pytest
import torch

from microvllm.platforms.gpu_memory import MemoryProfile, num_gpu_blocks
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


def test_the_cuda_platform_sizes_the_cache_from_its_readings(monkeypatch):
    """``CudaPlatform.num_kv_blocks_that_fit`` with the GPU's readings faked: the profiling
    pass runs once, and the peak is measured from what was allocated at start."""
    from microvllm.config import CacheConfig
    from microvllm.platforms.cuda import CudaPlatform
    from microvllm.platforms.gpu_memory import MemoryAtStart

    per_block = MiB
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 5 * per_block)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (0, 100 * per_block))
    cache = CacheConfig(kv_cache_memory_bytes=None, gpu_memory_utilization=0.5)
    at_start = MemoryAtStart(free_bytes=20 * per_block, allocated_bytes=2 * per_block)
    fits = CudaPlatform().num_kv_blocks_that_fit(cache, per_block, lambda: calls.append("profile"), at_start)
    assert fits == 10 - 3 and calls == ["profile"]   # half of 20 blocks' worth, less a 3-block peak


def test_the_engine_caps_what_fits_at_what_could_be_used(tiny_models, monkeypatch, caplog):
    import logging

    from microvllm import LLM

    engine = LLM(str(tiny_models["llama"]), device="cpu", max_model_len=64, max_num_seqs=4).engine
    allocated = []
    monkeypatch.setattr(engine.executor, "initialize_kv_cache", allocated.append)
    monkeypatch.setattr(engine.executor, "determine_num_kv_blocks", lambda: 7)
    with caplog.at_level(logging.INFO, logger="microvllm"):
        assert engine.core._initialize_kv_caches() == 7 == allocated[0]
    assert any(m.startswith("KV cache: 7 blocks x 16 tokens") for m in caplog.messages)
    # Never more than max_num_seqs full-length requests could use: 4 x 4 blocks + the null block.
    monkeypatch.setattr(engine.executor, "determine_num_kv_blocks", lambda: 10**6)
    assert engine.core._initialize_kv_caches() == 17
