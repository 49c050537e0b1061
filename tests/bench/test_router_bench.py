"""``microvllm bench router --quick``: every policy's row is there and every request of
every policy completed (through vllm-router and through the course router's HTTP proxy).
Structure only: the figures of a tiny random model on a shared CPU mean nothing."""

import json

import pytest

from microvllm.bench.router import ALL_POLICIES, COURSE_POLICIES, VLLM_ROUTER_POLICIES, main
from microvllm.testing import vllm_router_binary

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(vllm_router_binary() is None,
                       reason="the vllm-router wheel is not installed (pip install vllm-router: the dev extra)"),
]


def test_quick_bench_runs_every_policy_to_completion(tmp_path, capsys):
    out = tmp_path / "router.json"
    assert main(["--quick", "--logs", str(tmp_path / "logs"), "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    header, units, *rows = printed[printed.index("front "):].splitlines()[:2 + len(ALL_POLICIES)]
    assert header.split() == ["front", "policy", "hit", "rate", "TTFT", "p50", "TTFT", "p99", "req/s", "out",
                              "tok/s", "per", "replica", "completed"]
    assert [tuple(row.split()[:2]) for row in rows] == \
        [("vllm-router", p) for p in VLLM_ROUTER_POLICIES] + [("course", p) for p in COURSE_POLICIES]
    assert "cache_aware / round_robin hit rate" in printed

    results = json.loads(out.read_text())
    assert [f"{r['front']}:{r['policy']}" for r in results] == list(ALL_POLICIES)
    for r in results:
        assert r["error"] == "", r
        assert r["completed"] == r["requests"] == 12, r
        assert sum(r["per_replica"]) == r["requests"], r          # the replicas served each one once
        assert 0.0 <= r["hit_rate"] <= 1.0 and r["ttft_p50_ms"] <= r["ttft_p99_ms"], r
        assert r["output_tokens_per_s"] > 0, r
    by_name = {f"{r['front']}:{r['policy']}": r for r in results}
    assert by_name["vllm-router:round_robin"]["per_replica"] == [6, 6]
    assert by_name["course:round_robin"]["per_replica"] == [6, 6]
