"""OpenAI-compatible HTTP front door over Triton (FastAPI + uvicorn, gRPC to Triton).

Run it with `python -m omni_backend.serving --triton-grpc localhost:8001 --port 9000` (or `scripts/serve.sh`,
which starts it beside tritonserver). `create_app(ServingConfig(...))` builds the ASGI app.
"""

from omni_backend.serving.app import create_app
from omni_backend.serving.config import ServingConfig

__all__ = ["ServingConfig", "create_app"]
