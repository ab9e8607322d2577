"""One-time setup steps run by `scripts/setup.sh`: tritonserver runtime layout and model conversion.

Run everything with `python -m omni_backend.setup`; each step is idempotent and silent when nothing changed.
"""
