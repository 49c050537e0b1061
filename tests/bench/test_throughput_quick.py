"""Smoke test of ``microvllm bench throughput --quick`` on a tiny random model.

No timing is asserted (CI machines are noisy): only that every section runs and
prints its lines, and that the greedy token ids of microvllm match Hugging Face's.
"""

import re

import pytest

from microvllm.bench import throughput
from microvllm.bench.roofline import ModelCost
from microvllm.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bench") / "llama", "llama")


def test_quick_prints_every_section(tiny_llama, capsys):
    assert throughput.main(["--quick", "--threads", "1", "--model", str(tiny_llama)]) == 0
    out = capsys.readouterr().out
    for pattern in [
        r"^machine: 1024\^3 matmul .*FLOP/s .* copy .*B/s",
        r"^workload: 4 requests, prompts 16-48, outputs 8-16 \(seed 0\), float32, llama",
        r"^\s+useful tok/s\s+total tok/s\s+wall s$",
        r"^HF one at a time\s+skipped \(--quick\)$",
        r"^HF static batch\s+[\d.]+\s+[\d.]+\s+[\d.]+$",
        r"^microvllm\s+[\d.]+\s+[\d.]+\s+[\d.]+$",
        r"^microvllm / HF static batch: [\d.]+x$",
        r"^roofline: .* of work / .* measured = .*; microvllm at .*% of the matmul limit$",
        r"^time floor: .* \(sum over \d+ steps of max\(compute, memory\); .*\); "
        r"microvllm wall = [\d.]+ x the floor$",
        r"^decode step: batch 1 = [\d.]+ ms \(floor .*; [\d.]+ [kMGT]?FLOP/s, [\d.]+%? of the matmul ceiling\), "
        r"batch 4 = [\d.]+ ms",
        r"^prefix workload: 4 requests sharing a 64-token system prompt",
        r"^prefix caching off\s+[\d,]+\s+[\d.]+\s+[\d.]+$",
        r"^prefix caching on\s+[\d,]+\s+[\d.]+\s+[\d.]+$",
    ]:
        assert re.search(pattern, out, re.MULTILINE), f"no line matching {pattern!r} in:\n{out}"
    # Tiny random weights give clear greedy winners: float32 ids must agree with HF.
    assert "greedy token ids: 4/4 identical to HF static batch" in out
    assert "token ids identical to caching off: 4/4" in out
    # The shared 64-token prompt is 4 full blocks: requests after the first reuse them.
    off = int(re.search(r"^prefix caching off\s+([\d,]+)", out, re.MULTILINE)[1].replace(",", ""))
    on = int(re.search(r"^prefix caching on\s+([\d,]+)", out, re.MULTILINE)[1].replace(",", ""))
    assert on < off


def test_skip_hf_and_profile(tiny_llama, capsys):
    argv = ["--quick", "--threads", "1", "--model", str(tiny_llama), "--workload", "random",
            "--skip-hf", "--profile"]
    assert throughput.main(argv) == 0
    out = capsys.readouterr().out
    assert "HF static batch" in out and "skipped (--skip-hf)" in out
    assert "not compared with HF (--skip-hf)" in out
    assert "profile: 8 decode-only steps at batch 4" in out
    assert "per decode step (torch ops, self CPU time): projections" in out
    assert "prefix workload" not in out


def test_step_cost_counts_flops_and_bytes(tiny_llama):
    import torch

    cost = ModelCost.from_folder(tiny_llama, torch.float32)
    # tiny llama: hidden 64, 2 layers, 4 heads of 16, 2 KV heads, vocab 512, untied lm_head
    assert (cost.num_layers, cost.num_heads, cost.num_kv_heads, cost.head_dim) == (2, 4, 2, 16)
    assert cost.lm_head_params == 512 * 64
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert cost.body_params == 2 * per_layer + 64
    # A 3-token prefill from scratch + one decode at context 5 (4 cached tokens).
    step = cost.step_cost([(3, 0), (1, 4)], num_logit_rows=2)
    assert step.tokens == 4
    assert step.linear_flops == 2 * cost.body_params * 4 + 2 * 512 * 64 * 2
    assert step.attention_flops == 4 * 4 * 16 * 2 * ((1 + 2 + 3) + 5)
    kv_per_token = 2 * 2 * 2 * 16 * 4
    assert step.bytes_read == (cost.body_params + 512 * 64) * 4 + (3 + 5) * kv_per_token


def test_sliding_window_pairs():
    import dataclasses

    base = ModelCost(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, hidden_size=1,
                     vocab_size=1, body_params=0, embedding_params=0, lm_head_params=0,
                     element_size=4)
    windowed = dataclasses.replace(base, sliding_window=4)
    for q, c in [(1, 1), (3, 3), (5, 10), (1, 10), (10, 10), (2, 4), (3, 6)]:
        rows = range(c - q + 1, c + 1)           # keys seen by each query row, no window
        assert base.visible_pairs(q, c) == sum(rows)
        assert windowed.visible_pairs(q, c) == sum(min(k, 4) for k in rows)


def test_where_the_time_goes_sorts_ops_by_kind():
    from types import SimpleNamespace

    from microvllm.bench.throughput import where_the_time_goes

    events = [SimpleNamespace(key=k, self_cpu_time_total=us) for k, us in [
        ("mkldnn::_linear_pointwise", 6000.0), ("aten::mm", 2000.0),             # projections
        ("aten::index_select", 3000.0), ("aten::_scaled_dot_product_flash_attention_for_cpu", 3000.0),
        ("microvllm::paged_attention_decode", 2000.0),                          # attention
        ("aten::mul", 4000.0)]]                                                  # other
    line = where_the_time_goes(events, num_steps=2)
    assert "projections 4.0 ms (40%)" in line
    assert "attention 4.0 ms (40%)" in line
    assert "other 2.0 ms (20%)" in line


def test_where_the_time_goes_splits_the_decode_fast_path_by_its_own_clock():
    from types import SimpleNamespace

    from microvllm.bench.throughput import FAST_PATH_RANGE, where_the_time_goes

    events = [SimpleNamespace(key=FAST_PATH_RANGE, self_cpu_time_total=10000.0),   # 10 ms in all
              SimpleNamespace(key="aten::mul", self_cpu_time_total=2000.0)]
    inside = {"gemm": 0.005, "attention": 0.002, "write_kv": 0.001, "rms_norm": 0.001}   # 9 ms
    line = where_the_time_goes(events, num_steps=2, fast_path_seconds=inside)
    assert "projections 2.5 ms (42%)" in line
    assert "attention 1.5 ms (25%)" in line
    assert "other 2.0 ms (33%)" in line   # rms_norm 0.5 + the call's own 0.5 + aten::mul 1.0


def test_repeat_reports_the_pair_of_median_ratio(tiny_llama, capsys, monkeypatch):
    """HF's static batch and microvllm run in turn; the table shows the pair whose ratio is
    the median. The runs are real; their wall times are replaced by set ones, so that
    which pair is the median is known: ratios 4x, 3x, 2x -> the second pair."""
    import dataclasses

    hf_walls, micro_walls = iter([4.0, 6.0, 2.0]), iter([1.0, 2.0, 1.0])
    real_static, real_generate = throughput.hf_static_batch, throughput.microvllm_generate

    def static(*args):
        return dataclasses.replace(real_static(*args), wall_s=next(hf_walls))

    def generate(llm, workload, name="microvllm", step_times=None):
        result, outs = real_generate(llm, workload, name, step_times)
        return (dataclasses.replace(result, wall_s=next(micro_walls)) if step_times is not None
                else result), outs   # the traced run (no step_times) keeps its time
    monkeypatch.setattr(throughput, "hf_static_batch", static)
    monkeypatch.setattr(throughput, "microvllm_generate", generate)
    argv = ["--quick", "--threads", "1", "--model", str(tiny_llama), "--workload", "random",
            "--repeat", "3"]
    assert throughput.main(argv) == 0
    out = capsys.readouterr().out
    for line in ["  pair 1/3: HF static batch 4.00 s, microvllm 1.00 s (4.0x)",
                 "  pair 2/3: HF static batch 6.00 s, microvllm 2.00 s (3.0x)",
                 "  pair 3/3: HF static batch 2.00 s, microvllm 1.00 s (2.0x)",
                 "  the rows above: the pair of median ratio of 3 (HF static batch and microvllm "
                 "timed in turn)",
                 "microvllm / HF static batch: 3.0x"]:
        assert line in out.splitlines(), f"no line {line!r} in:\n{out}"
    assert re.search(r"^HF static batch\s+[\d.]+\s+[\d.]+\s+6\.00$", out, re.MULTILINE)
    assert re.search(r"^microvllm\s+[\d.]+\s+[\d.]+\s+2\.00$", out, re.MULTILINE)


def test_repeat_must_be_positive():
    with pytest.raises(SystemExit):
        throughput.parse_args(["--quick", "--repeat", "0"])
