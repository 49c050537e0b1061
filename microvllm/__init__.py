"""microvllm"""
