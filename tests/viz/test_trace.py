"""The trace format: JSON round trip, clear errors on corrupt input, accounting checks."""

import json

import pytest

from microvllm.trace import RequestStep, StepTrace, Trace, TraceSink, short_hash, step_kind
from microvllm.viz.demo import KINDS, demo_trace


@pytest.mark.parametrize("kind", KINDS)
def test_json_round_trip_is_exact(kind, tmp_path):
    trace = demo_trace(kind)
    again = Trace.from_json(trace.to_json())
    assert again == trace
    assert isinstance(again.steps[0].scheduled[0], RequestStep)
    trace.save(tmp_path / "run.json")
    assert Trace.load(tmp_path / "run.json") == trace


def test_round_trip_keeps_none_and_several_cache_groups():
    trace = demo_trace("sliding_window", hybrid=True)
    again = Trace.from_json(trace.to_json())
    assert again.kv_cache_groups == ["full_attention", "sliding_window"]
    assert again.sliding_window == 8
    assert any(h is None for h in again.steps[0].block_hashes)
    assert again == trace


def _corrupt(mutate):
    data = json.loads(demo_trace("prefix").to_json())
    mutate(data)
    return json.dumps(data)


@pytest.mark.parametrize("text, words", [
    (demo_trace("prefix").to_json()[:500], "not valid JSON"),
    ("[]", "expected a JSON object"),
    (_corrupt(lambda d: d.pop("block_size")), "missing the field 'block_size'"),
    (_corrupt(lambda d: d["steps"][3].pop("token_budget")), "trace.steps[3]: missing the field 'token_budget'"),
    (_corrupt(lambda d: d["steps"][2]["scheduled"][0].pop("kind")), "steps[2].scheduled[0]: missing the field 'kind'"),
    (_corrupt(lambda d: d["steps"][1].update(ref_cnts="many")), "trace.steps[1].ref_cnts: expected a list"),
    (_corrupt(lambda d: d["steps"][1]["ref_cnts"].__setitem__(4, "2")), "trace.steps[1].ref_cnts[4]: expected int"),
    (_corrupt(lambda d: d["steps"][1]["free"].__setitem__(4, 1)), "trace.steps[1].free[4]: expected bool"),
    (_corrupt(lambda d: d["steps"][1]["ref_cnts"].pop()), "ref_cnts has 23 entries, expected num_blocks=24"),
    (_corrupt(lambda d: d["steps"][0]["scheduled"][0].update(kind="prefil")), "has kind 'prefil'"),
    (_corrupt(lambda d: d["steps"][0]["block_tables"]["r0"][0].append(99)), "holds block ids [99] outside 0..23"),
    (_corrupt(lambda d: d["steps"][0]["block_tables"]["r0"].append([])), "expected one per kv_cache_group"),
    (_corrupt(lambda d: d["steps"][4].update(step=1)), "step numbers must increase"),
    (_corrupt(lambda d: d["steps"][0].update(colour="red")), "unknown field(s) ['colour']"),
    (_corrupt(lambda d: d.update(format="other")), "'format' is 'other'"),
    (_corrupt(lambda d: d.update(version=99)), "version 99 is not supported"),
])
def test_corrupt_json_raises_a_value_error_that_names_the_problem(text, words):
    with pytest.raises(ValueError) as error:
        Trace.from_json(text)
    assert words in str(error.value)


def test_load_of_a_truncated_file_says_so(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text(demo_trace("chunked").to_json()[:-40])
    with pytest.raises(ValueError, match="cut short"):
        Trace.load(path)


@pytest.mark.parametrize("kind", KINDS)
def test_demo_traces_pass_the_accounting_checks(kind):
    demo_trace(kind).check_consistency()


@pytest.mark.parametrize("field, value, words", [
    ("ref_cnts", 5, "block 1 has ref count 5 but 1 block tables hold it"),
    ("num_free_blocks", 0, "num_free_blocks=0 but"),
    ("token_budget", 3, "over the budget 3"),
])
def test_check_consistency_names_the_broken_invariant(field, value, words):
    trace = demo_trace("prefix")
    step = trace[0]
    if field == "ref_cnts":
        step.ref_cnts[1] = value
    else:
        setattr(step, field, value)
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        trace.check_consistency()


def test_sequence_protocol_and_queries():
    trace = demo_trace("prefix")
    assert len(trace) == len(trace.steps) and trace[0] is trace.steps[0]
    assert [s.step for s in trace] == list(range(len(trace)))
    assert trace.request_ids() == ["r0", "r1", "r2", "r3"]       # order of arrival
    owners = trace.owner_of_blocks(2)                               # r1 was admitted with a hit on r0's blocks
    shared = [b for b, who in enumerate(owners) if len(who) == 2]
    assert shared and all(set(owners[b]) == {"r0", "r1"} for b in shared)
    assert all(trace[2].ref_cnts[b] == 2 for b in shared)
    assert owners[trace.null_block_id] == []
    preemption = demo_trace("preemption")
    steps = preemption.preemption_steps()
    assert len(steps) >= 2 and steps == sorted(steps)
    assert [i for i in range(len(preemption)) if preemption[i].preempted] == steps


def test_step_kind():
    assert step_kind(0, 7, 7, 0, is_new=True) == "prefill"           # a whole prompt
    assert step_kind(4, 3, 7, 0, is_new=False) == "prefill"          # the last chunk of a prompt
    assert step_kind(7, 1, 8, 1, is_new=False) == "decode"           # the newest sampled token
    assert step_kind(8, 1, 9, 2, is_new=True) == "prefill"           # resumed, only one token left after hits
    assert step_kind(6, 1, 7, 0, is_new=False) == "prefill"          # a 1-token last chunk of a prompt


def test_trace_sink_records_steps():
    sink = TraceSink(block_size=4, num_blocks=3, max_num_batched_tokens=8, max_num_seqs=2)
    sink.record(StepTrace(step=0, token_budget=8, max_num_seqs=2, ref_cnts=[0, 0, 0],
                          block_hashes=[None] * 3, free=[False, True, True], num_free_blocks=2))
    assert len(sink.trace) == 1
    sink.trace.check_consistency()
    assert Trace.from_json(sink.trace.to_json()) == sink.trace


def test_short_hash():
    assert short_hash(b"\x01\xab\xff\x00\x12") == "01abff00"
    assert short_hash(255) == "000000ff"
    assert len(short_hash(("parent", (1, 2, 3)))) == 8
    assert short_hash(("parent", (1, 2, 3))) == short_hash(("parent", (1, 2, 3)))


def test_demo_traces_do_not_depend_on_the_hash_seed():
    """Two processes with different PYTHONHASHSEED record the same traces (a trace is deterministic:
    e.g. requests that finish in one step free their blocks in batch order, not a set's order)."""
    import os
    import subprocess
    import sys

    code = ("from microvllm.viz.demo import KINDS, demo_trace\n"
            "import hashlib\n"
            "print(hashlib.sha256(''.join(demo_trace(k).to_json() for k in KINDS).encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONHASHSEED=seed),
                              capture_output=True, text=True, check=True).stdout for seed in ("1", "2", "3")}
    assert len(digests) == 1
