"""Decode worker: receives KV handoffs, generates (continuous, speculative), streams tokens back."""
