"""LoRA adapters served together on one base model (vLLM: ``vllm/lora/``): ``LoRARequest``
on ``generate`` picks a request's adapter; the linear layers are wrapped (``*WithLoRA``)
so that each token of a mixed batch gets its own adapter's low-rank update.

    request.py         LoRARequest(lora_name, lora_int_id, lora_path)     what a request asks for;
                       AdapterDigests: each adapter's lora_digest        its blocks' prefix-cache key
    peft_helper.py     PEFTHelper: adapter_config.json read and checked    r, alpha, targets, scaling;
                       adapter_digest: the sha256 of the adapter's files
    lora_weights.py    LoRALayerWeights: one layer's A [r, in], B [out, r]
    lora_model.py      LoRAModel: one adapter's layers, from its safetensors
    layers.py          *WithLoRA: base(x) + B_slot(t) A_slot(t) x, stacked slots per layer
    punica_wrapper.py  LoRAMapping, PunicaWrapper: the step's token -> slot, the batched update
    ops/               the gather ops: torch reference, Triton kernels
    model_manager.py   LoRAModelManager: wraps the model; device slots + CPU LRU of adapters
    worker_manager.py  LRUCacheWorkerLoRAManager: per step, load/activate adapters, set the mapping

Outside this package: ``config/lora.py`` (LoRAConfig), ``core/lora_scheduling.py`` (at most
``max_loras`` adapters per step), ``core/kv_cache_utils.py`` (the adapter's digest in every
block hash), ``worker/model_runner.py`` (``_set_active_loras`` before each forward).
"""
