"""Model definitions run by the engine (our own forward passes over the paged KV cache) and the model registry
(`registry.py`) that names, for each architecture served, what runs each of its parts."""
