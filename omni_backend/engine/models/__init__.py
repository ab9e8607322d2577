"""Model definitions run by the engine (our own forward passes over the paged KV cache)."""
