"""Speculative decoding: proposers that guess each request's next k tokens, so that the
target checks them all in one forward (vLLM: ``vllm/v1/spec_decode/``). The rejection
sampler, which decides what is kept, lives beside the sampler (``sample/rejection_sampler.py``).

    ngram_proposer.py   prompt lookup over the request's own tokens
    draft_model.py      a smaller model (its own KV cache), or the target's first layers
                        (layer_skip: shares the target's KV cache)

The counts of drafts and accepted drafts per position live with the scheduler, which rolls
rejected drafts back (``core/spec_decode_stats.py``).
"""
