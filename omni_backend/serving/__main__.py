"""`python -m omni_backend.serving`: serve the OpenAI-compatible front door with uvicorn until Ctrl-C/SIGTERM.

Flags override the environment (see `omni_backend.serving.config`).
"""

from __future__ import annotations

import argparse
import sys

import uvicorn

from omni_backend.serving.app import create_app
from omni_backend.serving.config import ServingConfig, origins, stage_endpoints


def parse_args(argv: list[str] | None = None) -> ServingConfig:
    """The front door's settings from `argv` over the environment; a value a setting refuses ends the program
    with its message (exit status 2, argparse's)."""
    parser = argparse.ArgumentParser(prog="python -m omni_backend.serving",
                                     description="OpenAI-compatible HTTP front door over Triton.")
    try:
        defaults = ServingConfig.from_env()
    except ValueError as exc:
        parser.error(str(exc))
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument("--triton-grpc", default=defaults.triton_grpc, help="Triton gRPC host:port")
    parser.add_argument("--triton-http", default=defaults.triton_http, help="Triton HTTP host:port (for /v2)")
    parser.add_argument("--triton-metrics", default=defaults.triton_metrics_url, help="Triton metrics URL")
    parser.add_argument("--model", action="append", dest="models",
                        help="served model (a chat entry point on Triton); repeat for more; default omni_chat")
    parser.add_argument("--api-key", default=defaults.api_key)
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    parser.add_argument("--max-concurrent-requests", type=int, default=defaults.max_concurrent_requests)
    parser.add_argument("--graceful-shutdown-s", type=int, default=defaults.graceful_shutdown_s,
                        help="seconds requests in flight may run on after SIGTERM/SIGINT (0: cut at once)")
    parser.add_argument("--allowed-origins", default=",".join(defaults.allowed_origins),
                        help="browser origins CORS allows, comma-separated ('*': any; default none: CORS off)")
    parser.add_argument("--docs", action=argparse.BooleanOptionalAction, default=defaults.docs,
                        help="publish /openapi.json, /docs and /redoc (default: on)")
    parser.add_argument("--stage-endpoints", default=None,
                        help="stages on a tritonserver of their own: stage=host:port (gRPC), comma-separated; "
                             "stages: tts, diffusion (default: OMNI_STAGE_ENDPOINTS, else none)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    try:
        config = ServingConfig(
            triton_grpc=args.triton_grpc, triton_http=args.triton_http, triton_metrics_url=args.triton_metrics,
            models=tuple(args.models or defaults.models), api_key=args.api_key, max_body_bytes=args.max_body_bytes,
            max_concurrent_requests=args.max_concurrent_requests, graceful_shutdown_s=args.graceful_shutdown_s,
            host=args.host, port=args.port, allowed_origins=origins(args.allowed_origins),
            admin_key=defaults.admin_key, docs=args.docs,
            stage_endpoints=defaults.stage_endpoints if args.stage_endpoints is None
            else stage_endpoints(args.stage_endpoints),
        )
    except ValueError as exc:
        parser.error(str(exc))
    config.log_level = args.log_level
    return config


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level=getattr(config, "log_level", "info"),
                timeout_graceful_shutdown=config.graceful_shutdown_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
