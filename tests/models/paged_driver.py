"""A minimal driver that runs one sequence through a model over a paged KV cache
whose blocks are scattered in the pool — enough to test the model and attention
before the engine exists (the engine's runner does the same for many requests)."""

import torch

from microvllm.attention.metadata import AttentionMetadata


def make_kv_caches(model, num_blocks, block_size, dtype=torch.float32):
    """As the worker allocates them: a tensor per layer, shared between groups in a hybrid."""
    shape = (2, num_blocks, block_size, *model.attention_dims())
    buffers = [torch.zeros(shape, dtype=dtype) for _ in range(model.layout.num_kv_buffers)]
    return [buffers[model.layout.layer_to_buffer[i]] for i in range(len(model.layers))]


def metadata_for(block_table, block_size, start, num_tokens):
    """Metadata for one request computing tokens [start, start + num_tokens)."""
    positions = torch.arange(start, start + num_tokens)
    blocks = torch.tensor(block_table)[positions // block_size]
    slot_mapping = (blocks * block_size + positions % block_size).long()
    seq_len = start + num_tokens
    return AttentionMetadata(
        num_actual_tokens=num_tokens, max_query_len=num_tokens, max_seq_len=seq_len,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_table=torch.tensor([block_table], dtype=torch.int32),
        slot_mapping=slot_mapping, query_start_loc_cpu=[0, num_tokens], seq_lens_cpu=[seq_len])


@torch.no_grad()
def greedy_paged(model, prompt_ids, max_new_tokens, block_size=16, num_blocks=64, seed=0):
    """Prefill the prompt, then decode one token at a time. Returns (prompt logits, new ids)."""
    g = torch.Generator().manual_seed(seed)
    scattered = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # never block 0
    kv_caches = make_kv_caches(model, num_blocks, block_size, model.embed_tokens.weight.dtype)
    groups = model.layout.num_groups
    per_group = len(scattered) // groups    # each group its own blocks: a hybrid's groups share tensors
    tables = [scattered[i * per_group:(i + 1) * per_group] for i in range(groups)]
    ids = list(prompt_ids)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), kv_caches,
                   [metadata_for(t, block_size, 0, len(ids)) for t in tables])
    prompt_logits = model.compute_logits(hidden)
    new = [int(prompt_logits[-1].argmax())]
    while len(new) < max_new_tokens:
        pos = len(ids) + len(new) - 1
        hidden = model(torch.tensor([new[-1]]), torch.tensor([pos]), kv_caches,
                       [metadata_for(t, block_size, pos, 1) for t in tables])
        new.append(int(model.compute_logits(hidden)[-1].argmax()))
    return prompt_logits, new
