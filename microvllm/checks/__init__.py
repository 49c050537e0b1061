"""Checkers for the course's exercises: the engine's own tests, run against your code.

    from microvllm.checks import check_block_pool
    check_block_pool(MyBlockPool)        # prints ✓ / ✗ lines, returns a CheckResult

Each ``check_<component>(your_class_or_function)`` runs example cases and a hypothesis
property test and reports, for a failure, the input, what was expected, what came back and
a hint. A part that still raises ``NotImplementedError`` is reported as "not implemented
yet". ``run_engine_with({"block_pool": MyBlockPool})`` then runs the real engine on your
code, on a workload chosen for that component, and compares it with the reference engine:
the tokens (seeded sampling too, for a sampler) and, for a scheduler, block pool or KV
cache manager, every step's decisions (see ``engine_run.py``).

    exercise              checkers
    01 detokenizer        check_detokenizer, check_find_stop_string
    03 block pool         check_free_block_queue, check_block_pool
    04 prefix cache       check_hash_block_tokens, check_get_computed_blocks
    05 scheduler          check_scheduler
    06 decode kernel      check_decode_kernel
    07 sampler            check_sampler
    07 model runner       check_slot_mapping, check_prepare_inputs
    14 rejection sampler  check_rejection_sampler
    15 token mask         check_token_trie
    16 Q4_1 blocks        check_q4_1, run_gguf_with (the embedded GGUF file, enforce_eager=True)
    17 MoE permutation    check_moe_align, run_moe_with (a tiny Qwen3-MoE, enforce_eager=True)
    18 gated delta step   check_gated_delta_step, run_gated_deltanet_with (a tiny Qwen3.5)
    19 KV connector       check_kv_connector, run_kv_tier_with (a tiny Llama with a second KV tier)
    20 prefix router      check_prefix_choice, run_router_with (two replicas of a tiny Llama)
    21 Hermes parser      check_hermes_parser, run_hermes_parser_with (a tiny Llama served twice, the openai client)
    22 batched LoRA       check_lora_batch, run_lora_with (a tiny Llama, two adapters and the base in one batch)
"""

from microvllm.checks.attention import check_decode_kernel
from microvllm.checks.block_pool import check_block_pool
from microvllm.checks.detokenizer import check_detokenizer, check_find_stop_string
from microvllm.checks.engine_run import run_engine_with
from microvllm.checks.free_queue import check_free_block_queue
from microvllm.checks.lora_batch import check_lora_batch, run_lora_with
from microvllm.checks.model_runner import check_prepare_inputs
from microvllm.checks.moe_align import check_moe_align, run_moe_with
from microvllm.checks.prefix_cache import check_get_computed_blocks, check_hash_block_tokens
from microvllm.checks.prefix_router import check_prefix_choice, run_router_with
from microvllm.checks.quantization import check_q4_1, run_gguf_with
from microvllm.checks.rejection_sampler import check_rejection_sampler
from microvllm.checks.report import CheckFailure, CheckResult
from microvllm.checks.sampler import check_sampler
from microvllm.checks.scheduler import check_scheduler
from microvllm.checks.slot_mapping import check_slot_mapping
from microvllm.checks.structured_output import check_token_trie

__all__ = [
    "CheckFailure", "CheckResult", "check_block_pool", "check_q4_1", "check_decode_kernel", "check_detokenizer",
    "check_find_stop_string", "check_free_block_queue", "check_get_computed_blocks",
    "check_hash_block_tokens", "check_lora_batch", "check_moe_align",
    "check_prefix_choice", "check_prepare_inputs", "check_rejection_sampler", "check_sampler", "check_scheduler",
    "check_slot_mapping", "check_token_trie", "run_engine_with", "run_gguf_with", "run_lora_with",
    "run_moe_with", "run_router_with",
]
