"""ServingMetrics renders valid Prometheus text: cumulative buckets, sums, counts."""

import re

from microvllm.engine.metrics import Histogram, ServingMetrics
from microvllm.engine.outputs import CompletionOutput, RequestOutput


def test_histogram_buckets_are_cumulative_and_end_at_inf():
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.5, 0.5, 5.0):
        h.observe(value)
    assert h.lines("x") == ['x_bucket{le="0.1"} 1', 'x_bucket{le="1.0"} 3', 'x_bucket{le="+Inf"} 4',
                            "x_sum 6.05", "x_count 4"]


def test_a_request_feeds_ttft_itl_tokens_and_success():
    m = ServingMetrics()
    m.on_arrival("r", 10.0)
    for now, ids, finished in ((10.5, [1], False), (10.7, [2], False), (11.0, [3], True)):
        out = RequestOutput("r", "p", [7, 8, 9], [CompletionOutput(0, delta_token_ids=ids,
                                                                   finish_reason="length" if finished else None)],
                            finished=finished)
        m.on_output(out, now)
    m.set_gauges(2, 1, 0.25)
    text = m.render("tiny")
    values = dict(re.findall(r"^(vllm:\S+) (\S+)$", text, re.M))
    assert values['vllm:prompt_tokens_total{model_name="tiny"}'] == "3"
    assert values['vllm:generation_tokens_total{model_name="tiny"}'] == "3"
    assert values['vllm:time_to_first_token_seconds_count{model_name="tiny"}'] == "1"
    assert values['vllm:inter_token_latency_seconds_count{model_name="tiny"}'] == "2"
    assert values['vllm:request_success_total{model_name="tiny",finished_reason="length"}'] == "1"
    assert values['vllm:num_requests_running{model_name="tiny"}'] == "2"
    assert values['vllm:kv_cache_usage_perc{model_name="tiny"}'] == "0.25"
    # Every sample line follows a # TYPE line of its metric family.
    families = set(re.findall(r"^# TYPE (\S+) (?:gauge|counter|histogram)$", text, re.M))
    for name in re.findall(r"^(vllm:[a-z_]+?)(?:_bucket|_sum|_count)?\{", text, re.M):
        assert name in families, name


def test_prefix_cache_counters_under_vllms_names(tmp_path):
    """``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` count prompt tokens looked up
    at admission and those found cached, in ``get_metrics()`` and in ``/metrics`` alike."""
    from microvllm import LLM, SamplingParams
    from microvllm.models.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path, "llama", tokenizer=False)
    llm = LLM(str(folder), max_model_len=128, trace=True)
    shared = list(range(10, 50))                       # 40 tokens: 2 full blocks of 16
    prompts = [shared + [60 + i] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for prompt in prompts:                              # one after another: the 2nd and 3rd hit
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    hits = sum(s.prefix_hit_tokens or 0 for step in llm.trace for s in step.scheduled)
    assert metrics["vllm:prefix_cache_queries"].value == sum(len(p) for p in prompts) == 123
    assert metrics["vllm:prefix_cache_hits"].value == hits == 2 * 32
    m = ServingMetrics()
    m.set_gauges(0, 0, 0.0, prefix_cache_queries=123, prefix_cache_hits=64)
    text = m.render("tiny")
    assert 'vllm:prefix_cache_queries_total{model_name="tiny"} 123' in text
    assert 'vllm:prefix_cache_hits_total{model_name="tiny"} 64' in text
