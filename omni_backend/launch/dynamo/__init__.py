"""Our LLM engine as an NVIDIA Dynamo worker: `python -m omni_backend.launch.dynamo` (worker.py; the request and
response mapping in protocol.py). Needs the optional `requirements-dynamo.txt` (scripts/setup.sh --dynamo)."""
