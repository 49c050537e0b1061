"""Model architectures (Llama, Mistral, Qwen3), the loader, and the embedded/tiny models."""
