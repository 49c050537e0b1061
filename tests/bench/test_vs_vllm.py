"""``bench vs-vllm`` without vLLM: its offline child on a tiny model, the result files it
reads from ``vllm bench serve``, the comparisons it prints, and its refusals."""

import json
import subprocess
import sys

import pytest

from microvllm.bench import vs_vllm
from microvllm.bench.vs_vllm import Comparison, ServeResult, compare_tokens, describe, summary
from microvllm.models.tiny import make_tiny_model

VLLM_RESULT = {"completed": 64, "failed": 0, "output_throughput": 168.6, "median_ttft_ms": 495.6,
               "p99_ttft_ms": 1519.9, "median_itl_ms": 126.6, "p99_itl_ms": 1020.8, "duration": 24.3}


def test_a_vllm_bench_serve_result_is_read_in_seconds():
    r = ServeResult.from_vllm_json(VLLM_RESULT)
    assert (r.completed, r.failed, r.output_tok_s) == (64, 0, 168.6)
    assert r.ttft_p99_s == pytest.approx(1.5199) and r.itl_median_s == pytest.approx(0.1266)


def test_a_result_without_the_percentiles_says_which_flags_make_them():
    partial = {k: v for k, v in VLLM_RESULT.items() if k != "p99_itl_ms"}
    with pytest.raises(ValueError, match="'p99_itl_ms'.*--metric-percentiles 50,99"):
        ServeResult.from_vllm_json(partial)


def test_tokens_are_compared_request_by_request():
    assert compare_tokens([[1, 2], [3, 4]], [[1, 2], [3, 4]]) == "tokens 2/2 identical"
    assert compare_tokens([[1, 2], [3, 4, 5]], [[1, 2], [3, 9, 5]]) == \
        "tokens 1/2 identical (request 1 differs from token 1)"


def offline(tok_s, prefill_tok_s=800.0):
    return {"tok_s": tok_s, "prefill_tok_s": prefill_tok_s, "start_s": 3.0, "peak_rss_mb": 2048.0}


def test_the_report_gives_each_ratio_and_its_range_over_rounds():
    slow, fast = ServeResult(**{**vars(ServeResult.from_vllm_json(VLLM_RESULT))}), ServeResult.from_vllm_json(
        {**VLLM_RESULT, "p99_ttft_ms": 760.0, "p99_itl_ms": 510.4, "output_throughput": 337.2})
    results = [Comparison("offline", "float32", "batch 32", 0, offline(300.0), offline(250.0, 1000.0), (0.5, 1.5)),
               Comparison("offline", "float32", "batch 32", 1, offline(330.0, 880.0), offline(300.0)),
               Comparison("serve", "float32", "rate 4", 0, vars(fast), vars(slow))]
    assert "1.20x" in describe(results[0]) and "load 0.50->1.50" in describe(results[0])
    assert "prefill alone 800 vs 1000 prompt tok/s = 0.80x" in describe(results[0])
    line = describe(results[2])
    assert "TTFT p99 0.76 vs 1.52 s (0.50x)" in line and "(2.00x)" in line   # ITL halved, tok/s doubled
    lines = summary(results)
    assert lines[0] == "offline  float32  batch 32: throughput 1.10-1.20x vLLM, prefill alone 0.80-1.10x"
    assert "TTFT p99 0.50-0.50x, ITL p99 0.50-0.50x, tok/s 2.00-2.00x" in lines[1]


def test_a_python_without_vllm_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(SystemExit, match="no such program"):
        vs_vllm.check_vllm(str(tmp_path / "nothing" / "python"))
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="cannot import vLLM.*\n.*install vLLM there first"):
            vs_vllm.check_vllm(sys.executable)


def test_the_offline_child_runs_microvllm_and_writes_tokens_and_timing(tmp_path):
    folder = make_tiny_model(tmp_path / "llama", "llama", seed=3)
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(vs_vllm.OFFLINE_CHILD), "--engine", "microvllm", "--model",
                           str(folder), "--batch", "3", "--input-len", "10", "--output-len", "5",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [len(t) for t in result["token_ids"]] == [5, 5, 5]
    assert result["output_tokens"] == 15 and result["tok_s"] > 0 and result["peak_rss_mb"] > 0
    assert result["prefill_s"] > 0 and result["prefill_tok_s"] == pytest.approx(3 * 10 / result["prefill_s"])
    # The same prompts through the engine here: the child ran them greedily, as given.
    from microvllm import LLM, SamplingParams
    from microvllm.bench.vs_vllm_offline import prompt_ids, vocab_size

    prompts = prompt_ids(3, 10, 0, vocab_size(str(folder)))
    llm = LLM(str(folder), max_num_seqs=3, max_model_len=31)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == result["token_ids"]
