"""Prefill worker: prompt -> KV cache + first token, handed to decode over kvtransfer."""
