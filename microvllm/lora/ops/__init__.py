"""The batched LoRA computation (vLLM: ``vllm/lora/ops/``): ``torch_ops`` the reference,
``triton_ops`` the kernels (Punica's shrink / expand)."""
