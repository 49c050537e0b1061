"""DraftModelProposer: a smaller model guesses the next k tokens, one forward per guess
(vLLM: ``vllm/v1/spec_decode/draft_model.py``; its EAGLE proposer has the same loop).

Two kinds of draft, one loop:

* ``draft_model``: a separate, smaller model with the target's vocabulary. It has its
  own KV cache, indexed by the *same* block tables as the target's (same block ids, same
  slots), so the scheduler's allocation serves both. After every target forward the
  draft runs over the same input tokens (``after_target_forward``) so that its cache
  holds every position the target's does.
* ``layer_skip`` (self-speculative decoding, LayerSkip, Elhoushi et al. 2024): the
  draft is the target's own first N layers, then the target's final norm and LM head.
  Those layers *are* the target's, so the KV they write is the KV the target writes
  for the same tokens: the draft shares the target's cache and needs no catch-up::

      target   embed ─ L0 ─ L1 ─ ... ─ L(N-1) ─ LN ─ ... ─ L29 ─ norm ─ lm_head
      draft    embed ─ L0 ─ L1 ─ ... ─ L(N-1) ──────────────────── norm ─ lm_head
                       └─ KV of layers 0..N-1: one cache, written by both

After the target sampled token x at position p, the draft proposes::

    forward 1   input x  at p      -> argmax d1   (writes KV at p)
    forward 2   input d1 at p + 1  -> argmax d2   (writes KV at p + 1)
    ...         k forwards, batched over the requests that still want drafts

Drafts are greedy (the argmax), as vLLM's are: a draft is then a token with no
probabilities, and the rejection sampler accepts it with probability p(d) (one-hot q).
The KV written for positions p .. p+k-1 sits in slots the scheduler allocated ahead
(``num_lookahead_tokens``); the target's next forward writes those positions again
with the same tokens, and a rejected draft's KV is overwritten later.
"""

from __future__ import annotations

import torch
from torch import nn

from microvllm.attention.metadata import AttentionMetadata


class LayerSkipDraft(nn.Module):
    """The target's first ``num_layers`` layers, then its final norm (the LM head is the
    target's too: ``compute_logits``). Holds no weights of its own."""

    def __init__(self, target: nn.Module, num_layers: int):
        super().__init__()
        if not 1 <= num_layers < len(target.layers):
            raise ValueError(f"num_draft_layers={num_layers}: the target has {len(target.layers)} layers; "
                             "draft with 1 to one fewer than that")
        self.target, self.num_layers = target, num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        """``LlamaForCausalLM.forward`` stopped after ``num_layers`` layers: the same
        calls, so the same KV for those layers."""
        t = self.target
        hidden, residual = t.embed_tokens(input_ids), None
        cos_sin = t.rotary.cos_sin(positions)
        for i, layer in enumerate(t.layers[:self.num_layers]):
            hidden, residual = layer(cos_sin, hidden, residual, kv_caches[i],
                                     attn_metadata[t.layout.layer_to_group[i]])
        hidden, _ = t.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)


class DraftModelProposer:
    """Proposes up to k greedy drafts per request with ``draft`` (a model, or a
    ``LayerSkipDraft``) over ``kv_caches`` (its own, or the target's first layers')."""

    def __init__(self, draft: nn.Module, kv_caches: list[torch.Tensor], num_speculative_tokens: int, *,
                 shares_target_kv: bool):
        self.draft, self.kv_caches, self.k = draft, kv_caches, num_speculative_tokens
        self.shares_target_kv = shares_target_kv

    def after_target_forward(self, inputs) -> None:
        """A separate draft model runs over the target's input of this step (``ModelInputs``),
        so its cache has every position the target's has (prefill chunks, prefix-cache
        misses, recomputed preempted requests). A self-draft already shares them."""
        if not self.shares_target_kv:
            self.draft(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)

    @torch.inference_mode()
    def propose(self, runner, states, max_drafts: list[int]) -> list[list[int]]:
        """Drafts for each request that just sampled; ``runner``: the model runner (its
        block tables say where each position's KV goes)."""
        drafts: list[list[int]] = [[] for _ in states]
        max_drafts = [min(room, self.k) for room in max_drafts]
        active = [b for b, room in enumerate(max_drafts) if room > 0]
        if not active:
            return drafts
        device = runner.device
        tokens = torch.tensor([states[b].token_ids[-1] for b in active], dtype=torch.long, device=device)
        positions = torch.tensor([len(states[b].token_ids) - 1 for b in active], dtype=torch.long, device=device)
        for step in range(max(max_drafts)):
            keep = [i for i, b in enumerate(active) if max_drafts[b] > step]
            if len(keep) < len(active):   # requests out of room leave the batch
                index = torch.tensor(keep, dtype=torch.long, device=device)
                active, tokens, positions = [active[i] for i in keep], tokens[index], positions[index]
            metadata = self._decode_metadata(runner, [states[b].req_id for b in active], positions)
            hidden = self.draft(tokens, positions, self.kv_caches, metadata)
            tokens = self.draft.compute_logits(hidden).argmax(dim=-1)
            positions = positions + 1
            for b, token in zip(active, tokens.tolist()):
                drafts[b].append(token)
        return drafts

    @staticmethod
    def _decode_metadata(runner, req_ids: list[str], positions: torch.Tensor) -> list[AttentionMetadata]:
        """Attention metadata of a one-token-per-request step at ``positions``, one per
        cache group, from the runner's block tables."""
        num = len(req_ids)
        positions_cpu = positions.tolist()
        seq_lens_cpu = [p + 1 for p in positions_cpu]
        query_start_loc = torch.arange(num + 1, dtype=torch.int32)
        request_index = torch.arange(num, dtype=torch.long)
        max_blocks = -(-max(seq_lens_cpu) // runner.block_size)
        metadata = []
        for table in runner.block_tables:
            batch_table = table.gather(req_ids, max_blocks)
            metadata.append(AttentionMetadata(
                num_actual_tokens=num, max_query_len=1, max_seq_len=max(seq_lens_cpu),
                query_start_loc=query_start_loc.to(runner.device),
                seq_lens=torch.tensor(seq_lens_cpu, dtype=torch.int32, device=runner.device),
                block_table=batch_table.to(runner.device),
                slot_mapping=table.slot_mapping(batch_table, request_index, positions.cpu()).to(runner.device),
                query_start_loc_cpu=query_start_loc.tolist(), seq_lens_cpu=seq_lens_cpu, num_decodes=num))
        return metadata
