"""The worker side: owns every tensor (weights, KV cache, input buffers)."""
