"""The sharded layers' arithmetic, one process: each rank's layer is built as that rank
would build it (a fake group of ``tp`` ranks), loaded from the whole weights through its
``weight_loader``, and the ranks' outputs, combined as the collectives would combine them
(a sum for all-reduce, a concatenation for all-gather), must equal the unsharded layer."""

import pytest
import torch
import torch.nn.functional as F

from microvllm.distributed import parallel_state
from microvllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    shard_heads,
)
from microvllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding


class OneRankOf(parallel_state.GroupCoordinator):
    """Rank ``rank`` of ``world_size``, whose collectives leave combining to the test."""

    def all_reduce(self, x):
        return x

    def all_gather(self, x, dim=-1):
        return x


def on_rank(monkeypatch, tp, rank, build):
    monkeypatch.setattr(parallel_state, "_TP", OneRankOf(tp, rank))
    try:
        return build()
    finally:
        monkeypatch.setattr(parallel_state, "_TP", None)


def load(layer, **weights):
    """``weight=full`` or ``("q", full)``-style parts, through each parameter's weight_loader."""
    for name, value in weights.items():
        param = getattr(layer, name)
        for shard_id, tensor in (value if isinstance(value, list) else [(None, value)]):
            args = () if shard_id is None else (shard_id,)
            param.weight_loader(param, tensor, *args)
    return layer


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_parallel_linear_gives_each_rank_its_heads(monkeypatch, tp):
    torch.manual_seed(0)
    hidden, d, heads, kv_heads = 16, 4, 4, 2
    wq, wk, wv = torch.randn(heads * d, hidden), torch.randn(kv_heads * d, hidden), torch.randn(kv_heads * d, hidden)
    x = torch.randn(3, hidden)
    q, k, v = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
    for rank in range(tp):
        layer = on_rank(monkeypatch, tp, rank, lambda: QKVParallelLinear(hidden, d, heads, kv_heads))
        load(layer, weight=[("q", wq), ("k", wk), ("v", wv)])
        nh, nkv = layer.num_heads, layer.num_kv_heads
        kv_rank = rank // layer.num_kv_head_replicas   # at tp=4 two ranks share each KV head
        out_q, out_k, out_v = layer(x).split([nh * d, nkv * d, nkv * d], dim=-1)
        torch.testing.assert_close(out_q, q[:, rank * nh * d:(rank + 1) * nh * d])
        torch.testing.assert_close(out_k, k[:, kv_rank * nkv * d:(kv_rank + 1) * nkv * d])
        torch.testing.assert_close(out_v, v[:, kv_rank * nkv * d:(kv_rank + 1) * nkv * d])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_merged_column_then_row_parallel_sum_to_the_whole_mlp(monkeypatch, tp):
    torch.manual_seed(1)
    hidden, inter = 8, 16
    gate, up, down = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    down_bias = torch.randn(hidden)
    x = torch.randn(5, hidden)
    expected = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down, down_bias)
    total = 0
    for rank in range(tp):
        gate_up = on_rank(monkeypatch, tp, rank, lambda: MergedColumnParallelLinear(hidden, [inter] * 2, bias=False))
        row = on_rank(monkeypatch, tp, rank, lambda: RowParallelLinear(inter, hidden, bias=True))
        load(gate_up, weight=[(0, gate), (1, up)])
        load(row, weight=down, bias=down_bias)   # the bias is counted on rank 0 only
        g, u = gate_up(x).chunk(2, dim=-1)
        total = total + row(F.silu(g) * u)        # the all-reduce
    torch.testing.assert_close(total, expected)


def test_column_parallel_linear_with_gather_output(monkeypatch):
    weight, x = torch.randn(6, 4), torch.randn(2, 4)
    parts = [load(on_rank(monkeypatch, 2, r, lambda: ColumnParallelLinear(4, 6, bias=False)), weight=weight)(x)
             for r in range(2)]
    torch.testing.assert_close(torch.cat(parts, dim=-1), F.linear(x, weight))


@pytest.mark.parametrize("tp", [1, 3, 4])
def test_vocab_parallel_embedding_and_lm_head_with_padding(monkeypatch, tp):
    """A vocabulary of 10 over 3 or 4 ranks: 4 or 3 rows each, the last rank padded."""
    torch.manual_seed(2)
    vocab, dim = 10, 6
    table, ids, hidden = torch.randn(vocab, dim), torch.tensor([0, 9, 3, 4, 8, 1]), torch.randn(2, dim)
    embedded, logits = 0, []
    for rank in range(tp):
        embedding = on_rank(monkeypatch, tp, rank, lambda: VocabParallelEmbedding(vocab, dim))
        lm_head = on_rank(monkeypatch, tp, rank, lambda: ParallelLMHead(vocab, dim))
        load(embedding, weight=table)
        load(lm_head, weight=table)
        embedded = embedded + embedding(ids)       # the all-reduce
        logits.append(lm_head(hidden))             # the all-gather...
    torch.testing.assert_close(embedded, F.embedding(ids, table))
    gathered = torch.cat(logits, dim=-1)
    assert gathered.shape[-1] == -(-vocab // tp) * tp
    torch.testing.assert_close(gathered[:, :vocab], F.linear(hidden, table))   # ...less the padding


@pytest.mark.parametrize("heads, kv_heads, tp, expected", [
    (9, 3, 3, (3, 1, 1)), (9, 3, 1, (9, 3, 1)), (8, 2, 4, (2, 1, 2)), (8, 8, 2, (4, 4, 1)), (12, 3, 6, (2, 1, 2)),
])
def test_shard_heads(heads, kv_heads, tp, expected):
    assert shard_heads(heads, kv_heads, tp) == expected


@pytest.mark.parametrize("heads, kv_heads, tp, words", [
    (9, 3, 2, ["num_attention_heads=9", "tensor_parallel_size=2", "[1, 3, 9]"]),
    (8, 6, 4, ["num_key_value_heads=6", "tensor_parallel_size=4", "[1, 2]"]),
    (12, 4, 6, ["tensor_parallel_size=6", "num_key_value_heads=4", "[1, 2, 4, 12]"]),
])
def test_shard_heads_refuses_what_does_not_divide(heads, kv_heads, tp, words):
    with pytest.raises(ValueError) as error:
        shard_heads(heads, kv_heads, tp)
    for word in words:
        assert word in str(error.value)
