"""The gated delta rule: the linear attention of Qwen3.5's "linear_attention" layers
(Gated DeltaNet; vLLM: ``vllm/third_party/flash_linear_attention/ops/`` ``chunk_gated_delta_rule``
and ``fused_recurrent_gated_delta_rule``, Triton kernels from flash-linear-attention).

Full attention keeps every past key and value (the KV cache grows with the sequence).
A linear-attention head keeps one matrix instead, its **state** S (d_k x d_v), the same
size at token 10 and at token 100,000. Per token t of one head (q, k L2-normalised,
q scaled by d_k^-1/2; g_t <= 0 a log decay, beta_t in (0, 1) a write strength)::

    S  <-  exp(g_t) * S                         forget a little of everything
    v_old = S^T k_t                             what S recalls for key k_t now
    S  <-  S + k_t (beta_t (v_t - v_old))^T     write only the correction (the delta rule)
    o_t = S^T q_t                               read with the query

``recurrent_gated_delta_rule`` is exactly that loop, one ``gated_delta_step`` per token:
what decode runs (one token per request per step). ``chunk_gated_delta_rule`` computes the
same outputs and final state for a long prompt in chunks of C tokens with matrix products
(the prefill form): inside a chunk the C updates are folded into one triangular solve (the
"WY" or "UT" form), and only the chunk boundaries are sequential. Both take and return the
state, so a prompt can be prefilled in several steps (chunked prefill) and then decoded, the
state carried across.

Layouts (one sequence; the model runs a batch of them one by one)::

    q, k        [T, H_k, d_k]        H_k key heads; each serves H_v / H_k value heads
    v           [T, H_v, d_v]
    g, beta     [T, H_v]
    state       [H_v, d_k, d_v]      float32
    returns     (o [T, H_v, d_v] in v's dtype, state [H_v, d_k, d_v] float32)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (flash-linear-attention's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """Head-major float32 tensors: q, k normalised (q also scaled), key heads repeated
    for the value heads they serve. [T, H, d] -> [H, T, d]; [T, H] -> [H, T]."""
    group = v.shape[1] // k.shape[1]
    q, k = (x.repeat_interleave(group, dim=1) if group > 1 else x for x in (q, k))
    q = l2_normalize(q.float()) * q.shape[-1] ** -0.5
    k = l2_normalize(k.float())
    return (q.transpose(0, 1), k.transpose(0, 1), v.float().transpose(0, 1),
            g.float().transpose(0, 1), beta.float().transpose(0, 1))


def _initial(state, v, d_k: int) -> torch.Tensor:
    if state is not None:
        return state.float()
    return torch.zeros(v.shape[1], d_k, v.shape[2], dtype=torch.float32, device=v.device)


def gated_delta_step(q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, g_t: torch.Tensor,
                     beta_t: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the rule, every head at once (exercise 18 writes this)::

        q_t, k_t     [H_k, d_k]        as the layer made them, not yet normalised
        v_t          [H_v, d_v]        H_v = group * H_k: key head h serves value heads
                                       h*group .. h*group + group-1
        g_t, beta_t  [H_v]             the log decay (<= 0) and the write strength
        state        [H_v, d_k, d_v]   float32, after the previous token (left unchanged)
        returns      (o_t [H_v, d_v], the new state [H_v, d_k, d_v]), both float32

    Per value head: q, k L2-normalised (``l2_normalize``), q times d_k^-1/2, then::

        S  <-  exp(g_t) S                    forget first
        S  <-  S + k_t (beta_t (v_t - S^T k_t))^T
        o_t = S^T q_t                        read the new state
    """
    group = v_t.shape[0] // k_t.shape[0]
    ### BEGIN SOLUTION
    q_t = l2_normalize(q_t.float()).repeat_interleave(group, dim=0) * q_t.shape[-1] ** -0.5
    k_t = l2_normalize(k_t.float()).repeat_interleave(group, dim=0)
    ### END SOLUTION
    ### BEGIN SOLUTION
    S = state.float() * g_t.float().exp()[:, None, None]
    v_old = torch.einsum("hk,hkv->hv", k_t, S)
    correction = beta_t.float()[:, None] * (v_t.float() - v_old)
    S = S + k_t[:, :, None] * correction[:, None, :]
    return torch.einsum("hk,hkv->hv", q_t, S), S
    ### END SOLUTION


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor | None = None):
    """The rule token by token, ``gated_delta_step`` at each: the reference, and the decode step."""
    S = _initial(state, v, k.shape[-1])                               # [H_v, d_k, d_v]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)  # [T, H_v, d_v]
    for t in range(q.shape[0]):
        out[t], S = gated_delta_step(q[t], k[t], v[t], g[t], beta[t], S)
    return out.to(v.dtype), S


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor | None = None,
                           chunk_size: int = CHUNK_SIZE):
    """The same outputs and final state, C tokens at a time.

    Inside one chunk (positions i, j = 0..C-1; gamma_i = g_0 + ... + g_i, the log decay
    from the chunk's start; S the state before the chunk) the rule unrolls to::

        u_i = beta_i (v_i - exp(gamma_i) S^T k_i - sum_{j<i} exp(gamma_i - gamma_j) (k_i.k_j) u_j)

    a lower-triangular system (I + A) U = beta (V - exp(gamma) K S), solved once per chunk.
    Then the outputs and the next state are products::

        o_i = exp(gamma_i) S^T q_i + sum_{j<=i} exp(gamma_i - gamma_j) (q_i.k_j) u_j
        S'  = exp(gamma_last) S + sum_j exp(gamma_last - gamma_j) k_j u_j^T
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    num_heads, length, d_k = k.shape
    S = _initial(state, v.transpose(0, 1), d_k)
    pad = (-length) % chunk_size   # padded positions: g = 0 and beta = 0, they change nothing
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = q.shape[1] // chunk_size
    q, k, v = (x.reshape(num_heads, n, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(num_heads, n, chunk_size) for x in (g, beta))
    gamma = g.cumsum(-1)                                              # [H, n, C]
    # exp(gamma_i - gamma_j) for j <= i, 0 above the diagonal (never exp of a positive number).
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    # (I + A): A_ij = beta_i exp(gamma_i - gamma_j) (k_i . k_j) for j < i.
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(chunk_size, dtype=torch.float32, device=q.device)
    system = eye + A
    # The two right-hand sides that do not depend on S: U = U_v - W S.
    U_v = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False)
    W = torch.linalg.solve_triangular(system, (beta * gamma.exp())[..., None] * k, upper=False)
    attn = (q @ k.transpose(-1, -2)) * decay                          # [H, n, C, C], j <= i
    out = torch.empty_like(v)
    for c in range(n):
        U = U_v[:, c] - W[:, c] @ S                                   # [H, C, d_v]
        out[:, c] = (q[:, c] * gamma[:, c, :, None].exp()) @ S + attn[:, c] @ U
        last = gamma[:, c, -1]
        S = S * last.exp()[:, None, None] + \
            (k[:, c] * (last[:, None] - gamma[:, c]).exp()[..., None]).transpose(-1, -2) @ U
    out = out.reshape(num_heads, n * chunk_size, -1)[:, :length]
    return out.transpose(0, 1).to(out_dtype), S
