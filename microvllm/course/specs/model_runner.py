"""Exercise 07b: slot mapping and the model runner's input preparation."""

from microvllm.course.exercise import Exercise, Part
from microvllm.worker.block_table import BlockTable
from microvllm.worker.model_runner import ModelRunner

EXERCISE = Exercise(
    number="07", slug="model_runner", title="Slot mapping and input preparation",
    lecture="07 · the model runner and the sampler",
    intro="""You write how the model runner turns the scheduler's plan into flat tensors: where
each new token's key and value go in the paged cache (`BlockTable.slot_mapping`) and the whole
step's inputs (`ModelRunner._prepare_inputs`).""",
    setup="""
import torch

import microvllm.worker.model_runner
from microvllm.attention.metadata import AttentionMetadata
from microvllm.checks import check_prepare_inputs, check_slot_mapping, run_engine_with
from microvllm.worker.model_runner import ModelInputs
""",
    parts=(Part(BlockTable, intro="""The runner keeps one row per running request and appends the
new block ids the scheduler sends each step; `gather` picks the batch's rows."""),
           Part(ModelRunner, methods=("_prepare_inputs",), intro="""Your runner is the engine's
`ModelRunner` with your `_prepare_inputs`; `self.requests[req_id]` holds each request's
`token_ids` and `num_computed_tokens` (before this step), `self.block_tables` one `BlockTable` per
cache group (it builds *your* `BlockTable`).""")),
    todos={
        "BlockTable.slot_mapping": "for every token: block_table[its request, position // B] * B + "
                                   "position % B, as an int64 tensor, without a Python loop",
        "ModelRunner._prepare_inputs": "flatten the plan into a ModelInputs: req_ids, states, input_ids, "
                                       "positions, one AttentionMetadata per cache group, the sampling "
                                       "requests' indices, logits_indices",
    },
    contract="""
`slot_mapping(batch_table, request_index, positions)` returns, for every token `t` of the step,
`batch_table[request_index[t], positions[t] // block_size] * block_size + positions[t] % block_size`
as an int64 tensor of shape `[num_tokens]` (vectorized: one indexing op, no Python loop over tokens).

`_prepare_inputs(plan)` lays out every scheduled request's tokens as one contiguous run of rows
(in any request order; the engine puts decodes first and says so with `num_decodes`) and returns
`ModelInputs(req_ids, states, input_ids, positions, attn_metadata, sampling_req_indices,
logits_indices)` (a small dataclass: `req_ids` and `states` in row order):
- `input_ids[rows of r] = token_ids[c : c + n]` and `positions[rows of r] = c .. c + n - 1`, where
  `c` is the request's `num_computed_tokens` and `n = plan.num_scheduled_tokens[r]`;
- per cache group, an `AttentionMetadata` with `num_actual_tokens`, `max_query_len`,
  `max_seq_len`, `query_start_loc` (`[0, end of request 0, ...]`, int32), `seq_lens` (`c + n`,
  int32), `block_table` (the batch's rows, `table.gather(req_ids, max_blocks)`), `slot_mapping`,
  and the host copies `query_start_loc_cpu` / `seq_lens_cpu`;
- `attn_metadata`: that list, one per cache group;
- `sampling_req_indices`: the batch indices of the requests whose chunk reaches their last known token
  (`c + n == len(token_ids)`); a partial prefill chunk samples nothing. "Known" counts every token
  the runner holds: a request resumed after preemption arrives as a new request whose
  `NewRequestData` carries its prompt *and* the tokens it had generated, and recomputes them all
  before it samples again;
- `logits_indices`: for each of those, its last row, `query_start_loc[i + 1] - 1`.

Only `slot_mapping` must do without a Python loop over tokens. The engine's `_prepare_inputs` builds
positions, `query_start_loc` and the slots with tensor operations, but gathers `input_ids` with a
Python comprehension over each request's token list (`token_ids` is a Python list); you may too.
""",
    hints=(
        """Slot mapping is two gathers and an add: `batch_table[request_index, positions // B]`
gives each token's physical block id (cast it `.long()`), then `* B + positions % B`.""",
        """Build `request_index` (which request each row belongs to) with
`torch.repeat_interleave(torch.arange(num_reqs), counts)`; `query_start_loc` is a 0 followed by
`counts.cumsum(0)`; a row's offset inside its chunk is `arange(num_tokens) - query_start_loc[request_index]`.""",
        """Before you run this, write down the step's rows: request `a` (10 prompt tokens, 4 cached,
6 scheduled), and two requests resumed after preemption: `b` (3 prompt + 2 output tokens, 4
scheduled) and `c` (2 prompt + 1 output token, 3 scheduled). Which requests sample a token this
step, and from which rows? Where does each chunk end: at the end of its prompt, or of everything
the request knows?
```python
# Test case: paste it into a new cell and run it (it uses your classes above)
from microvllm.checks.model_runner import RecordingModel
from microvllm.core.sched_output import NewRequestData, SchedulerOutput
from microvllm.sampling_params import SamplingParams
runner = ModelRunner(RecordingModel(num_groups=1), [], block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                     max_model_len=64, eos_token_ids=set(), seed=0)
greedy = SamplingParams(temperature=0.0)
plan = SchedulerOutput(
    (NewRequestData("a", tuple(range(10, 20)), (), greedy, ((1, 2, 3),), 4),   # 10 prompt tokens, 4 cached
     NewRequestData("b", (7, 8, 9), (5, 6), greedy, ((4, 5),), 0),           # resumed: 3 prompt + 2 output tokens
     NewRequestData("c", (1, 2), (3,), greedy, ((6,),), 0)),                 # resumed: 2 prompt + 1 output token
    (), {"a": 6, "b": 4, "c": 3}, 13)
runner._update_states(plan)
inputs = runner._prepare_inputs(plan)
metadata = inputs.attn_metadata[0]
qsl = metadata.query_start_loc.tolist()     # any request order is fine: compare request by request
rows = {req_id: (inputs.input_ids[qsl[i]:qsl[i + 1]].tolist(), inputs.positions[qsl[i]:qsl[i + 1]].tolist(),
                 metadata.seq_lens[i].item(), metadata.slot_mapping[qsl[i]:qsl[i + 1]].tolist())
        for i, req_id in enumerate(inputs.req_ids)}
assert rows == {"a": ([14, 15, 16, 17, 18, 19], [4, 5, 6, 7, 8, 9], 10, [8, 9, 10, 11, 12, 13]),
                "b": ([7, 8, 9, 5], [0, 1, 2, 3], 4, [16, 17, 18, 19]),
                "c": ([1, 2, 3], [0, 1, 2], 3, [24, 25, 26])}, rows
sampling = [inputs.req_ids[i] for i in inputs.sampling_req_indices]
assert sorted(sampling) == ["a", "c"], sampling
assert inputs.logits_indices.tolist() == [qsl[inputs.req_ids.index(r) + 1] - 1 for r in sampling], inputs.logits_indices
```""",
    ),
    checks=("check_slot_mapping(BlockTable)", "check_prepare_inputs(ModelRunner)"),
    engine_intro="""`components={"block_table": BlockTable, "model_runner": ModelRunner}` makes the
worker build your runner, which keeps your block tables and prepares every step's inputs. Six prompts,
one greedy and five sampling with their own seeds (so your runner must hand each row its own request's
parameters), in blocks of 8 with a budget of 8 tokens and 7 usable blocks: steps mix prefill chunks
and decodes, and requests are preempted, then resumed with their prompt and output tokens recomputed
in chunks (so which rows sample must follow all known tokens, not the prompt). The tokens must equal
the reference engine's.""",
    engine='run_engine_with({"block_table": BlockTable, "model_runner": ModelRunner})',
)
