"""``microvllm bench pd --quick``: both arms (a colocated server; a kv_producer and a
kv_consumer behind the real vllm-router) ran to completion, the table has its rows, and
the decode stream's greedy tokens are identical in both arms. Structure only: the
timings of a tiny random model on a shared CPU mean nothing."""

import json

import pytest

from microvllm.bench.pd import main
from microvllm.testing import vllm_router_binary

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(vllm_router_binary() is None,
                       reason="the vllm-router wheel is not installed (pip install vllm-router: the dev extra)"),
]


def test_quick_bench_runs_both_arms_with_identical_stream_tokens(tmp_path, capsys):
    out = tmp_path / "pd.json"
    assert main(["--quick", "--logs", str(tmp_path / "logs"), "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "cores, bf16 units:" in printed                      # the machine is named
    lines = printed[printed.index("arm "):].splitlines()
    assert lines[0].split() == ["arm", "quiet", "p50", "mean", "p50", "p99", "max", "n", "p50", "p99",
                                "completed"]
    assert [row.split()[0] for row in lines[1:3]] == ["colocated", "disaggregated"]
    assert "stream's greedy tokens identical across arms: yes (48 tokens)" in printed

    report = json.loads(out.read_text())
    colocated, disaggregated = report["results"]
    for r in (colocated, disaggregated):
        assert r["error"] == "", r
        assert r["flood_completed"] == r["flood_requests"] == 4, r
        assert r["stream_tokens"] == len(r["tokens"]) == 48, r
        assert r["itl_flood_p50_ms"] <= r["itl_flood_p99_ms"] <= r["itl_flood_max_ms"], r
        assert 0 < r["flood_ttft_p50_ms"] <= r["flood_ttft_p99_ms"], r
    assert colocated["tokens"] == disaggregated["tokens"]
    assert "router + client" in colocated["pinned"] and "decode" in disaggregated["pinned"]
