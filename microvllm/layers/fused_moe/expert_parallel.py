"""Expert parallelism: each rank holds whole experts, and tokens travel to them
(vLLM: ``layers/fused_moe/modular_kernel.py``'s dispatch / combine around the experts,
``prepare_finalize/``, and ``distributed/device_communicators/all2all.py``).

With ``enable_expert_parallel=True`` and N ranks, rank r holds experts
``r*E/N .. (r+1)*E/N - 1``, whole. Attention is still tensor-parallel, so after it
every rank holds the same ``T`` tokens. One MoE layer then goes::

    1. split      rank r takes its slice of the tokens (T/N rows) and their routing
    2. dispatch   each (token, expert) pair's row goes to the rank holding the expert:
                  all-to-all, with per-rank counts exchanged first (a rank must know
                  how many rows to expect from each peer)
    3. experts    each rank runs its experts on the rows it received (step (b) or (c))
    4. combine    the results go back by the reverse all-to-all; each rank adds its
                  tokens' k results, weighted by the router, into its slice
    5. gather     all-gather the slices, so every rank holds all T rows again

       rank 0 (experts 0-3)            rank 1 (experts 4-7)
       tokens 0..T/2 ──┐                ┌── tokens T/2..T
                       ├─ all-to-all ───┤
       rows for 0-3 <──┘                └──> rows for 4-7
       run experts 0-3                  run experts 4-7
                       ── all-to-all back ──
       combine slice 0 ─── all-gather ─── combine slice 1

Why all-to-all: each row crosses the wire once each way, ``T*k*H`` values in all,
where the alternative — all-gather every token to every rank, run the local experts
on all of them, then reduce-scatter the sums (vLLM's "naive" all2all backend) —
moves ``N`` times more. Both gloo (a CPU) and NCCL have ``all_to_all_single`` with
uneven splits, so that is what runs; gloo has no list form of all-to-all and no
reduce-scatter, which rules the alternative out on a CPU anyway.

Step 1 is the sequence-parallel trick vLLM uses when attention is tensor-parallel
(``use_sequence_parallel_moe``): without it every rank would dispatch the same tokens
and each expert would compute every row N times.
"""

from __future__ import annotations

from typing import Callable

import torch

from microvllm.distributed.parallel_state import GroupCoordinator


def rows_per_rank(num_tokens: int, world_size: int) -> int:
    """``ceil(T / N)``: the most rows one rank's slice holds (the all-gather's size)."""
    return -(-num_tokens // world_size)


def token_slice(num_tokens: int, world_size: int, rank: int) -> slice:
    """Rank ``rank``'s rows of ``num_tokens``: equal slices of ``ceil(T / N)`` (the last
    ones shorter or empty)."""
    per_rank = rows_per_rank(num_tokens, world_size)
    return slice(min(rank * per_rank, num_tokens), min((rank + 1) * per_rank, num_tokens))


def dispatch_combine(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     num_local_experts: int, run_experts: Callable, group: GroupCoordinator) -> torch.Tensor:
    """The MoE layer's output ``[T, H]`` (on every rank) for ``hidden [T, H]`` routed by
    ``topk_weights, topk_ids [T, k]`` (global expert ids), with this rank's experts run by
    ``run_experts(rows [n, H], weights [n, 1], local_ids [n, 1]) -> [n, H]``."""
    world, top_k = group.world_size, topk_ids.shape[-1]
    mine = token_slice(hidden.shape[0], world, group.rank_in_group)
    x, weights, ids = hidden[mine], topk_weights[mine].flatten(), topk_ids[mine].flatten()

    # 2. dispatch: pairs ordered by the rank that holds their expert
    owner = ids // num_local_experts
    order = torch.argsort(owner, stable=True)
    send_counts = torch.bincount(owner, minlength=world)
    recv_counts = group.all_to_all_single(send_counts, [1] * world, [1] * world)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    rows = group.all_to_all_single(x[order // top_k], recv, send)
    local_ids = group.all_to_all_single(ids[order] - owner[order] * num_local_experts, recv, send)

    # 3. this rank's experts on the rows it received (each row is one pair: weight 1 here,
    #    the router's weight is applied by the pair's own rank in 4)
    y = run_experts(rows, torch.ones(rows.shape[0], 1), local_ids[:, None])

    # 4. combine: back to the ranks they came from, in the order they were sent
    back = group.all_to_all_single(y, send, recv)
    part = torch.zeros_like(x).index_add_(0, order // top_k, back * weights[order, None].to(back.dtype))

    # 5. gather: every rank's slice, padded to equal size for the all-gather
    padded = part.new_zeros(rows_per_rank(hidden.shape[0], world), part.shape[1])
    padded[:part.shape[0]] = part
    return group.all_gather(padded, dim=0)[:hidden.shape[0]]
