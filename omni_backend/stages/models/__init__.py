"""The stages' side of each multimodal architecture of the model registry (omni_backend/engine/models/registry.py),
one module per architecture: its encoder (tower + connector, run by the encoder stage of its media kind) and its
prompt processor (run by preprocess)."""
