"""``microvllm bench kv-tier --quick``: both rows print, the tier turns every returning
prefix into a hit, and greedy tokens agree."""

from microvllm.cli.main import main as cli_main


def test_quick_bench_shows_more_hits_with_the_tier_and_the_same_tokens(capsys):
    assert cli_main(["bench", "kv-tier", "--quick"]) == 0
    out = capsys.readouterr().out
    rows = {line[:10].strip(): line[10:].split() for line in out.splitlines()
            if line.startswith(("no tier ", "tier "))}
    hit_rate = {name: float(row[0].rstrip("%")) for name, row in rows.items()}
    assert hit_rate["tier"] > hit_rate["no tier"]
    assert int(rows["tier"][4]) > 0 and int(rows["no tier"][4]) == 0   # blocks loaded
    assert "greedy tokens identical: yes" in out
