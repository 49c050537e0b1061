"""ModelRunner: turns the scheduler's plan into tensors, runs the model, samples.

One step, three requests (a 4-token prefill chunk of ``a`` whose first 8 tokens are
cached, and two decodes)::

    plan: num_scheduled_tokens = {a: 4, b: 1, c: 1}
    input_ids        [a8 a9 a10 a11 | b17 | c5]         tokens not yet computed
    positions        [ 8  9  10  11 |  17 |  5]         num_computed_tokens + i
    query_start_loc  [0, 4, 5, 6]
    seq_lens         [12, 18, 6]                        context incl. this step
    slot_mapping     [block_table[a][8//B]*B + 8%B, ...] where each new K/V is written
    logits_indices   [3, 4, 5]    last row of each request whose next token is due

A request whose chunk does not reach its last known token (a partial prefill) is
in the batch but gets no logits and no sample. The runner keeps its own copy of each
request's tokens and block table between steps (``CachedRequestState``,
``BlockTable``), so the scheduler only sends what changed.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from microvllm.attention.metadata import AttentionMetadata
from microvllm.config.lora import LoRAConfig
from microvllm.distributed.kv_transfer.kv_connector.base import KVConnectorOutput
from microvllm.lora.punica_wrapper import LoRAMapping
from microvllm.lora.worker_manager import LRUCacheWorkerLoRAManager
from microvllm.sample.logprobs import LogprobsLists, compute_logprobs, gather_logprobs, prompt_logprobs_of_chunk
from microvllm.sample.metadata import SamplingMetadata, make_generator
from microvllm.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler, SpecDecodeMetadata
from microvllm.sample.sampler import Sampler
from microvllm.sampling_params import SamplingParams
from microvllm.worker.block_table import BlockTable


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]          # prompt + outputs known to the runner
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    num_computed_tokens: int = 0
    lora_request: Any = None      # its LoRA adapter (a LoRARequest), None: the base model

    @property
    def lora_int_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]                                   # requests that got a new token
    sampled_token_ids: dict[str, list[int]]              # one token, or 1..d+1 with d drafts
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)          # one row per token
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)   # this chunk's rows
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)        # drafts for next step
    expert_load: dict[str, list[int]] = field(default_factory=dict)  # MoE layer -> pairs per expert (Worker)
    # KV connector (Worker): requests whose blocks finished being saved / loaded this step.
    kv_connector_output: KVConnectorOutput | None = None


@dataclass
class ModelInputs:
    """One step's inputs, as ``_prepare_inputs`` lays them out (the module docstring
    draws them). Built on the CPU; ``to(device)`` moves the tensors where the model is.

    req_ids               the batch's requests, in row order (decodes first)
    states                each one's ``CachedRequestState`` (same order)
    input_ids, positions  one row per scheduled token
    attn_metadata         one ``AttentionMetadata`` per cache group
    sampling_req_indices  batch indices of the requests that sample this step
    logits_indices        the row of each one's logits (its chunk's last row)
    """

    req_ids: list[str]
    states: list[CachedRequestState]
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: list[AttentionMetadata]
    sampling_req_indices: list[int]
    logits_indices: torch.Tensor

    def to(self, device: torch.device) -> "ModelInputs":
        """The step's tensors on ``device`` (as vLLM copies its CPU-built inputs to the GPU);
        the host lists (``query_start_loc_cpu``, ``seq_lens_cpu``) stay. Where they already
        are (a CPU), nothing is copied: ``Tensor.to`` returns the tensor itself."""
        for m in self.attn_metadata:
            m.query_start_loc, m.seq_lens = m.query_start_loc.to(device), m.seq_lens.to(device)
            m.block_table, m.slot_mapping = m.block_table.to(device), m.slot_mapping.to(device)
        return dataclasses.replace(self, input_ids=self.input_ids.to(device), positions=self.positions.to(device),
                                   logits_indices=self.logits_indices.to(device))


class ModelRunner:
    def __init__(self, model, kv_caches: list[torch.Tensor], *, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, eos_token_ids: set[int],
                 seed: int, sampler_class: type[Sampler] = Sampler,
                 block_table_class: type[BlockTable] = BlockTable, decode_step_runner=None, device="cpu",
                 drafter=None, rejection_sampler_class: type[RejectionSampler] = RejectionSampler,
                 disable_by_batch_size: int | None = None, lora_config: LoRAConfig | None = None):
        # Where the model and its inputs are, with its index ("cuda:0") as tensors and
        # generators report theirs.
        self.model, self.device = model, torch.empty(0, device=device).device
        # The platform's runner for decode-only steps (the CPU's decode fast path; CUDA
        # graphs on a GPU), or None (enforce_eager=True, or none applies here).
        self.decode_step_runner = decode_step_runner
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.sampler = sampler_class(seed)  # its generator serves requests without a seed
        if self.sampler.generator.device != self.device:   # noise is drawn where the logits are
            self.sampler.generator = make_generator(seed, self.device)
        self.requests: dict[str, CachedRequestState] = {}
        self.paused_generators: dict[str, torch.Generator] = {}   # of preempted seeded requests
        # Speculative decoding (None: off): proposes each request's next drafts after it
        # samples (spec_decode/); the rejection sampler checks them at the next step.
        self.drafter, self.disable_by_batch_size = drafter, disable_by_batch_size
        self.rejection_sampler = rejection_sampler_class(self.sampler.generator)
        max_blocks = -(-max_model_len // block_size)
        self.block_tables = [block_table_class(max_num_seqs, max_blocks, block_size)
                             for _ in range(model.layout.num_groups)]
        # Persistent input buffers: each step fills a prefix of them in place.
        self.input_ids = torch.zeros(max_num_batched_tokens, dtype=torch.long)
        self.positions = torch.zeros(max_num_batched_tokens, dtype=torch.long)
        self.arange = torch.arange(max(max_num_batched_tokens, max_num_seqs) + 1, dtype=torch.long)
        # LoRA (lora_config None: off, and nothing below runs): the model's projections are
        # wrapped (lora/layers.py); each step activates its requests' adapters in the
        # device slots and tells the wrappers which token runs with which (_set_active_loras).
        self.lora_manager: LRUCacheWorkerLoRAManager | None = None
        if lora_config is not None:
            dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
            self.lora_manager = LRUCacheWorkerLoRAManager(lora_config, max_num_batched_tokens, dtype, self.device)
            self.lora_manager.create_lora_manager(model)
            # The platform's decode path (CUDA graphs, the CPU fast path) was built around
            # the unwrapped layers and a fixed token count: decodes run the model as written.
            self.decode_step_runner = None

    # ---------------------------------------------------------------- state
    def _update_states(self, plan) -> None:
        for req_id in plan.preempted_req_ids:
            # A seeded request's random stream continues where it stopped when the request
            # resumes (as in vLLM): restarting it would replay the draws of its first tokens.
            state = self.requests.get(req_id)
            if state is not None and state.generator is not None:
                self.paused_generators[req_id] = state.generator
        for req_id in plan.finished_req_ids:
            self.paused_generators.pop(req_id, None)
        for req_id in plan.finished_req_ids | plan.preempted_req_ids:
            self._remove(req_id)
        for new in plan.scheduled_new_reqs:
            self._remove(new.req_id)  # a resumed request starts over
            params = new.sampling_params
            seed = getattr(params, "seed", None)
            generator = self.paused_generators.pop(new.req_id, None)
            if generator is None and seed is not None:
                generator = make_generator(seed)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids), sampling_params=params,
                generator=generator, num_computed_tokens=new.num_computed_tokens,
                lora_request=getattr(new, "lora_request", None))
            for table, ids in zip(self.block_tables, new.block_ids):
                table.add_request(new.req_id, list(ids))
        for cached in plan.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.num_computed_tokens = cached.num_computed_tokens
            for table, ids in zip(self.block_tables, cached.new_block_ids):
                table.append(cached.req_id, list(ids))
        # This step's drafts go after each request's tokens, as if they were its tokens:
        # the inputs are then built as for any chunk. execute_model takes them off again.
        for req_id, drafts in plan.scheduled_spec_decode_tokens.items():
            self.requests[req_id].token_ids.extend(drafts)

    def _remove(self, req_id: str) -> None:
        if self.requests.pop(req_id, None) is not None:
            for table in self.block_tables:
                table.remove_request(req_id)

    # --------------------------------------------------------------- inputs
    def _prepare_inputs(self, plan) -> ModelInputs:
        """Flatten this step's plan into the model's inputs (see the module docstring).

        Returns a ``ModelInputs``: the batch's requests in row order and their states; one
        row per scheduled token (``input_ids``, ``positions``); one ``AttentionMetadata``
        per cache group (``query_start_loc``, ``seq_lens``, ``block_table``,
        ``slot_mapping``); the batch indices of the requests that sample this step and
        the row of each one's logits (its last row)."""
        ### BEGIN SOLUTION
        req_ids = [r.req_id for r in plan.scheduled_new_reqs] + \
                  [r.req_id for r in plan.scheduled_cached_reqs]
        # Decodes first (as vLLM's reorder_batch does): their rows are then one
        # contiguous slice that attention can treat as a single batch.
        req_ids.sort(key=lambda r: plan.num_scheduled_tokens[r] != 1)
        num_decodes = sum(1 for r in req_ids if plan.num_scheduled_tokens[r] == 1)
        num_scheduled = [plan.num_scheduled_tokens[r] for r in req_ids]
        states = [self.requests[r] for r in req_ids]
        num_tokens = sum(num_scheduled)
        start = [s.num_computed_tokens for s in states]

        counts = torch.tensor(num_scheduled, dtype=torch.long)
        request_index = torch.repeat_interleave(self.arange[:len(req_ids)], counts)
        query_start_loc = torch.zeros(len(req_ids) + 1, dtype=torch.int32)
        torch.cumsum(counts, 0, out=query_start_loc[1:])
        # position of token t = its request's num_computed_tokens + its offset in the chunk
        offsets = self.arange[:num_tokens] - query_start_loc[:-1].long()[request_index]
        positions = self.positions[:num_tokens]
        torch.add(torch.tensor(start, dtype=torch.long)[request_index], offsets, out=positions)
        input_ids = self.input_ids[:num_tokens]
        flat = [t for s, a, n in zip(states, start, num_scheduled) for t in s.token_ids[a:a + n]]
        input_ids.copy_(torch.tensor(flat, dtype=torch.long))

        seq_lens_cpu = [a + n for a, n in zip(start, num_scheduled)]
        seq_lens = torch.tensor(seq_lens_cpu, dtype=torch.int32)
        max_blocks = -(-max(seq_lens_cpu) // self.block_size)
        qsl_cpu = query_start_loc.tolist()
        metadata = []
        for table in self.block_tables:
            batch_table = table.gather(req_ids, max_blocks)
            metadata.append(AttentionMetadata(
                num_actual_tokens=num_tokens, max_query_len=max(num_scheduled),
                max_seq_len=max(seq_lens_cpu), query_start_loc=query_start_loc, seq_lens=seq_lens,
                block_table=batch_table,
                slot_mapping=table.slot_mapping(batch_table, request_index, positions),
                query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens_cpu, num_decodes=num_decodes))

        # Only requests whose chunk reaches their last known token sample a new one.
        sampling = [i for i, (s, n) in enumerate(zip(seq_lens_cpu, states)) if s == len(n.token_ids)]
        logits_indices = torch.tensor([qsl_cpu[i + 1] - 1 for i in sampling], dtype=torch.long)
        return ModelInputs(req_ids=req_ids, states=states, input_ids=input_ids, positions=positions,
                           attn_metadata=metadata, sampling_req_indices=sampling, logits_indices=logits_indices)
        ### END SOLUTION

    def _set_active_loras(self, inputs: ModelInputs, plan) -> None:
        """This step's adapters into the device slots, and each token's adapter for the
        wrapped layers (vLLM: ``LoRAModelRunnerMixin.set_active_loras``)::

            rows        a a a | b | c c      (prefill chunks and decodes alike)
            index       7 7 7 | 0 | 3 3      lora_int_id per token, 0: the base model
            prompt      7     | 0 | 3        per request that samples (its logits row)
        """
        assert self.lora_manager is not None
        requests = {s.lora_request for s in inputs.states if s.lora_request is not None}
        if not requests:   # the base model alone: the wrappers add nothing, at no cost
            self.lora_manager.set_active_adapters(set(), None)
            return
        ids = [s.lora_int_id for s in inputs.states]
        index_mapping = tuple(i for i, s in zip(ids, inputs.states) for _ in range(plan.num_scheduled_tokens[s.req_id]))
        prompt_mapping = tuple(ids[i] for i in inputs.sampling_req_indices)
        self.lora_manager.set_active_adapters(requests, LoRAMapping(index_mapping, prompt_mapping))

    # ------------------------------------------------------------------ step
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                  metadata: list[AttentionMetadata]) -> torch.Tensor:
        """One forward pass -> hidden states ``[T, hidden]``. A decode-only step may go to
        the platform's decode-step runner instead: the same layers with fewer calls
        around them, the same result (vLLM's model runner applies CUDA graphs here, in
        the same way). With ``enforce_eager=True`` there is none: the model runs as written."""
        runner = self.decode_step_runner
        if runner is not None and runner.applies(len(input_ids), metadata):
            return runner(input_ids, positions, self.kv_caches, metadata)
        return self.model(input_ids, positions, self.kv_caches, metadata)

    @torch.inference_mode()
    def execute_model(self, plan) -> ModelRunnerOutput:
        self._update_states(plan)
        if plan.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], {})
        inputs = self._prepare_inputs(plan).to(self.device)
        req_ids, states = inputs.req_ids, inputs.states
        self._make_generators_on_device(states)
        if self.lora_manager is not None:
            self._set_active_loras(inputs, plan)
        hidden = self.run_model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        if self.drafter is not None:   # a draft model computes the same positions' KV
            self.drafter.after_target_forward(inputs)
        prompt_logprobs = self._prompt_logprobs(req_ids, states, hidden, inputs.attn_metadata[0], plan)
        for state, req_id in zip(states, req_ids):
            state.num_computed_tokens += plan.num_scheduled_tokens[req_id]
        if not inputs.sampling_req_indices:
            return ModelRunnerOutput([], {}, prompt_logprobs=prompt_logprobs)
        sampled_states = [states[i] for i in inputs.sampling_req_indices]
        if plan.scheduled_spec_decode_tokens:
            return self._sample_with_drafts(plan, inputs, hidden, sampled_states, prompt_logprobs)
        logits = self.model.compute_logits(hidden[inputs.logits_indices]).float()
        # Structured outputs: the sampler masks these rows (forbidden ids -> -inf) after it
        # has taken the raw logprobs.
        grammar_rows = None
        if plan.grammar_bitmask is not None:
            row_of = {s.req_id: row for row, s in enumerate(sampled_states)}
            grammar_rows = [row_of[r] for r in plan.structured_output_request_ids]
        sampling_metadata = SamplingMetadata.from_params(
            [s.sampling_params for s in sampled_states],
            [s.generator for s in sampled_states],
            num_output_tokens=[s.num_output_tokens for s in sampled_states],
            eos_token_ids=self.eos_token_ids,
            token_ids=[s.token_ids for s in sampled_states],  # for penalties
            num_prompt_tokens=[s.num_prompt_tokens for s in sampled_states],
            grammar_bitmask=plan.grammar_bitmask, grammar_rows=grammar_rows)
        # Built on the CPU, as the inputs are; the sampler reads it where the logits are.
        out = self.sampler(logits, sampling_metadata.to(logits.device))
        tokens = out.sampled_token_ids.tolist()
        result = ModelRunnerOutput(req_ids=[s.req_id for s in sampled_states], sampled_token_ids={},
                                   prompt_logprobs=prompt_logprobs)
        for state, token in zip(sampled_states, tokens):
            state.token_ids.append(token)
            result.sampled_token_ids[state.req_id] = [token]
        if out.logprobs_tensors is not None:
            ids, logprobs, ranks = out.logprobs_tensors.tolists()
            for row, state in enumerate(sampled_states):
                n = state.sampling_params.logprobs
                if n is not None:  # column 0 is the sampled token, then the top n
                    result.logprobs[state.req_id] = LogprobsLists(
                        [ids[row][:n + 1]], [logprobs[row][:n + 1]], [ranks[row]])
        self._propose_drafts(plan, sampled_states, result)
        return result

    # ------------------------------------------------- speculative decoding
    def _sample_with_drafts(self, plan, inputs: ModelInputs, hidden: torch.Tensor,
                            sampled_states: list[CachedRequestState],
                            prompt_logprobs: dict[str, LogprobsLists]) -> ModelRunnerOutput:
        """Check this step's drafts: logits at each draft's position and the bonus one, the
        sampler's rules applied per position, then the rejection sampler::

            request a (2 drafts)   rows  [ a:o2  a:d0  a:d1 ]   each predicts the next token
            request b (none)       rows  [ b:o5 ]               an ordinary sample
            -> a keeps d0 (say) and the target's token after it; b gets one token

        Each row is sampled as the request would be after the drafts before it (its
        min_tokens count, penalties and bad words see them), so the output follows exactly
        the distribution of decoding without drafts."""
        qsl = inputs.attn_metadata[0].query_start_loc_cpu
        assert qsl is not None
        drafts = [list(plan.scheduled_spec_decode_tokens.get(s.req_id, ())) for s in sampled_states]
        for state, own in zip(sampled_states, drafts):   # the drafts are not tokens (yet)
            if own:
                del state.token_ids[-len(own):]
        rows = [row for i, own in zip(inputs.sampling_req_indices, drafts)
                for row in range(qsl[i + 1] - 1 - len(own), qsl[i + 1])]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)]).float()
        # Structured requests have no drafts: one row each (its first), masked by the
        # sampler's rules below, after the raw logprobs are taken.
        grammar_rows = None
        if plan.grammar_bitmask is not None:
            first_row = dict(zip((s.req_id for s in sampled_states),
                                 itertools.accumulate((len(d) + 1 for d in drafts), initial=0)))
            grammar_rows = [first_row[r] for r in plan.structured_output_request_ids]
        # One "virtual request" per row: request a after 0, 1, ... of its drafts.
        per_row = [(s, own[:j]) for s, own in zip(sampled_states, drafts) for j in range(len(own) + 1)]
        needs_history = any(s.sampling_params.has_penalties or getattr(s.sampling_params, "bad_words_token_ids", None)
                            for s in sampled_states)
        metadata = SamplingMetadata.from_params(
            [s.sampling_params for s, _ in per_row], [s.generator for s, _ in per_row],
            num_output_tokens=[s.num_output_tokens + len(seen) for s, seen in per_row],
            eos_token_ids=self.eos_token_ids,
            token_ids=[s.token_ids + seen for s, seen in per_row] if needs_history else None,
            num_prompt_tokens=[s.num_prompt_tokens for s, _ in per_row] if needs_history else None,
            grammar_bitmask=plan.grammar_bitmask, grammar_rows=grammar_rows,
        ).to(logits.device)
        raw_logprobs = compute_logprobs(logits) if metadata.max_num_logprobs is not None else None
        output = self.rejection_sampler(SpecDecodeMetadata.from_lists(drafts, logits.device),
                                        self.sampler.apply_logits_processors(logits, metadata), metadata,
                                        [s.generator for s in sampled_states])
        result = ModelRunnerOutput(req_ids=[s.req_id for s in sampled_states], sampled_token_ids={},
                                   prompt_logprobs=prompt_logprobs)
        first = 0
        for state, own, tokens in zip(sampled_states, drafts, output.tolist()):
            tokens = [t for t in tokens if t != PLACEHOLDER_TOKEN_ID]
            state.token_ids.extend(tokens)
            result.sampled_token_ids[state.req_id] = tokens
            n = state.sampling_params.logprobs
            if raw_logprobs is not None and n is not None:   # row first + i predicted token i
                got = gather_logprobs(raw_logprobs[first:first + len(tokens)], n,
                                      torch.tensor(tokens, device=logits.device))
                ids, values, ranks = got.tolists()
                result.logprobs[state.req_id] = LogprobsLists([r[:n + 1] for r in ids],
                                                              [r[:n + 1] for r in values], ranks)
            first += len(own) + 1
        self._propose_drafts(plan, sampled_states, result)
        return result

    def _propose_drafts(self, plan, sampled_states: list[CachedRequestState], result: ModelRunnerOutput) -> None:
        """The drafter's guesses for each request that just sampled, for the next step: at
        most k, and never more than the request may still produce (max_tokens,
        max_model_len: the last of the up to d + 1 new tokens comes from the target).
        Structured requests get none: their drafts would need the grammar too."""
        if self.drafter is None:
            return
        limit = self.disable_by_batch_size
        if limit is not None and len(plan.num_scheduled_tokens) >= limit:
            return   # a batch this large gains nothing from drafts
        rooms = []
        for state in sampled_states:
            room = self.max_model_len - len(state.token_ids) - 1
            max_tokens = state.sampling_params.max_tokens
            if max_tokens is not None:
                room = min(room, max_tokens - state.num_output_tokens - 1)
            if state.req_id in plan.structured_output_request_ids:
                room = 0
            rooms.append(max(room, 0))
        for state, drafts in zip(sampled_states, self.drafter.propose(self, sampled_states, rooms)):
            if drafts:
                result.spec_token_ids[state.req_id] = drafts

    def _prompt_logprobs(self, req_ids, states, hidden, metadata, plan) -> dict[str, LogprobsLists]:
        """Prompt logprobs of the requests that asked (``SamplingParams.prompt_logprobs``)."""
        result = {}
        for i, (req_id, state) in enumerate(zip(req_ids, states)):
            num_logprobs = getattr(state.sampling_params, "prompt_logprobs", None)
            if num_logprobs is None:
                continue
            first_row = metadata.query_start_loc_cpu[i]
            lists = prompt_logprobs_of_chunk(
                self.model.compute_logits, hidden[first_row:metadata.query_start_loc_cpu[i + 1]],
                state.token_ids, state.num_prompt_tokens, state.num_computed_tokens,
                plan.num_scheduled_tokens[req_id], num_logprobs)
            if lists is not None:
                result[req_id] = lists
        return result

    def _make_generators_on_device(self, states: list[CachedRequestState]) -> None:
        """A seeded request's generator is made where the logits are (sampling noise is
        drawn there). ``_update_states`` made new ones on the CPU, from the seed, and none
        has been drawn from yet: remake those elsewhere (nothing to do on a CPU). A resumed
        request's generator was made here already and is kept."""
        for state in states:
            if state.generator is not None and state.generator.device != self.device:
                state.generator = make_generator(state.sampling_params.seed, self.device)
