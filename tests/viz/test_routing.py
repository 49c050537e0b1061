"""plot_routing draws what the router's report says: each request's replica, its hit and computed
blocks, for a hand-made report and for a real run of two replicas behind the Router."""

import math

import pytest
from matplotlib.colors import to_hex

from microvllm.router.router import Decision, ReplicaReport, RouteReport
from microvllm.viz import plot_routing
from microvllm.viz.canvas import figure_to_png
from microvllm.viz.routing import replica_color, routing_rows


def bars(ax, gid):
    return [p for p in ax.patches if p.get_gid() == gid]


def hand_made() -> RouteReport:
    decisions = [Decision("r0", 0, "first", 0, 18, hit_tokens=0),
                 Decision("r1", 1, "second", 0, 21, hit_tokens=16),
                 Decision("r2", 0, "third", 4, 16, hit_tokens=12),
                 Decision("r3", 2, "fourth", 0, 3, hit_tokens=0)]
    report = RouteReport("hand_made", decisions=decisions,
                         replicas=[ReplicaReport(2, 34, 12), ReplicaReport(1, 21, 16), ReplicaReport(1, 3, 0)])
    return report


def assert_drawn(ax, report, block_size):
    hits, computed = bars(ax, "hit-blocks"), bars(ax, "computed-blocks")
    assert len(hits) == len(computed) == len(report.decisions)
    for y, (d, hit, rest) in enumerate(zip(report.decisions, hits, computed)):
        blocks = math.ceil(d.prompt_tokens / block_size)
        color = to_hex(replica_color(d.replica))
        assert hit.get_width() == d.hit_tokens // block_size and hit.get_x() == 0
        assert rest.get_x() == hit.get_width() and hit.get_width() + rest.get_width() == blocks
        assert hit.get_y() + hit.get_height() / 2 == pytest.approx(y) == rest.get_y() + rest.get_height() / 2
        assert to_hex(hit.get_facecolor()) == color and to_hex(rest.get_edgecolor()) == color
        assert to_hex(rest.get_facecolor()) == "#ffffff" and rest.get_hatch()


def test_a_hand_made_report_is_drawn_row_by_row():
    report = hand_made()
    fig = plot_routing(report, block_size=4, prefix_of=[3, 1, 3, 0])
    (ax,) = fig.axes
    assert_drawn(ax, report, 4)
    assert routing_rows(report, 4) == [(0, 0, 5), (1, 4, 6), (0, 3, 4), (2, 0, 1)]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["S3", "S1", "S3", "S0"]
    assert ax.get_ylim() == (3.5, -0.5)                     # request 0 at the top
    assert ax.get_title().startswith(f"hand_made: {report.hit_rate:.0%} of prompt tokens")
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[:3] == ["replica 0", "replica 1", "replica 2"]
    assert figure_to_png(fig).startswith(b"\x89PNG")


def test_errors_say_what_to_pass():
    with pytest.raises(ValueError, match="needs block_size="):
        plot_routing(hand_made())
    with pytest.raises(ValueError, match="not a multiple of block_size=5"):
        plot_routing(hand_made(), block_size=5)
    with pytest.raises(ValueError, match="no decisions"):
        plot_routing(RouteReport("empty"), block_size=4)


def test_a_real_comparison_one_panel_per_policy(tmp_path):
    from microvllm.models.tiny import make_tiny_model
    from microvllm.router import compare_policies, shared_prefix_workload

    folder = make_tiny_model(tmp_path / "llama", "llama", seed=7)
    workload = shared_prefix_workload(num_prefixes=3, questions_per_prefix=4)
    comparison = compare_policies(folder, ["round_robin", "prefix_aware"], workload=workload)
    fig = plot_routing(comparison)
    assert len(fig.axes) == 2
    for ax, (name, report) in zip(fig.axes, comparison.reports.items()):
        assert_drawn(ax, report, workload.block_size)
        assert ax.get_title().startswith(f"{name}: {report.hit_rate:.0%}")
        # the hatched-or-filled blocks add up to the report's hit tokens
        assert sum(b.get_width() for b in bars(ax, "hit-blocks")) * workload.block_size == report.hit_tokens
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == [f"S{k}" for k in workload.prefix_of]
    round_robin = [to_hex(b.get_facecolor()) for b in bars(fig.axes[0], "hit-blocks")]
    assert round_robin == [to_hex(replica_color(i % 2)) for i in range(len(workload.prompts))]
