"""``microvllm bench hybrid --quick``: both settings' rows, snapshots hit only prefixes of
whole blocks, and the greedy tokens are the same with and without them."""

from microvllm.bench.hybrid import main


def test_quick_bench_snapshots_hit_and_change_no_token(capsys):
    assert main(["--quick"]) == 0
    printed = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in printed.splitlines() if line.split()[:1] in (["none"], ["all"])}
    none, snapshots = rows["none"], rows["all"]
    assert none[2:5] == ["0.0%", "0.0%", "0.0%"]          # no snapshot: no hit, whatever the prefix
    assert snapshots[2] == "0.0%"                           # shorter than a block: no full block to resume
    assert float(snapshots[3].rstrip("%")) > 50             # several blocks: most of each resumed
    assert int(snapshots[5]) < int(none[5])                 # fewer prompt tokens computed
    assert "greedy tokens identical with and without snapshots: True" in printed
