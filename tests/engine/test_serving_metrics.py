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
    values = dict(re.findall(r"^(microvllm:\S+) (\S+)$", text, re.M))
    assert values['microvllm:prompt_tokens_total{model_name="tiny"}'] == "3"
    assert values['microvllm:generation_tokens_total{model_name="tiny"}'] == "3"
    assert values['microvllm:time_to_first_token_seconds_count{model_name="tiny"}'] == "1"
    assert values['microvllm:inter_token_latency_seconds_count{model_name="tiny"}'] == "2"
    assert values['microvllm:request_success_total{model_name="tiny",finished_reason="length"}'] == "1"
    assert values['microvllm:num_requests_running{model_name="tiny"}'] == "2"
    assert values['microvllm:kv_cache_usage_perc{model_name="tiny"}'] == "0.25"
    # Every sample line follows a # TYPE line of its metric family.
    families = set(re.findall(r"^# TYPE (\S+) (?:gauge|counter|histogram)$", text, re.M))
    for name in re.findall(r"^(microvllm:[a-z_]+?)(?:_bucket|_sum|_count)?\{", text, re.M):
        assert name in families, name
