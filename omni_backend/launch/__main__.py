"""`python -m omni_backend.launch`: run tritonserver on the rendered model repository, and the OpenAI-compatible
front door beside it, until Ctrl-C/SIGTERM.

Started by `scripts/serve.sh` after setup. Ports come from flags, else `OMNI_HTTP_PORT`, `OMNI_GRPC_PORT`,
`OMNI_METRICS_PORT`, `OMNI_OPENAI_PORT`, else 8000/8001/8002/9000 (`--openai-port 0` serves without the front
door; its other settings are in `omni_backend.serving.config`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from omni_backend import paths
from omni_backend.serving.config import ServingConfig
from omni_backend.launch.front_door import FrontDoorProcess
from omni_backend.launch.tritonserver import TritonServer, TritonServerError
from omni_backend.operator_key import ADMIN_KEY_HEADER

USAGE = """\
omni_chat is ready. Try:

  curl -s -X POST localhost:{http}/v2/models/omni_chat/generate \\
    -d '{{"text_input": "[{{\\"role\\": \\"user\\", \\"content\\": \\"What is the capital of France?\\"}}]", "max_tokens": 32, "temperature": 0}}'

  # plain text is continued as it is; "stream": true on generate_stream sends server-sent events:
  curl -sN -X POST localhost:{http}/v2/models/omni_chat/generate_stream \\
    -d '{{"text_input": "Once upon a time", "max_tokens": 32, "stream": true}}'

  gRPC streaming: localhost:{grpc} (tritonclient.grpc start_stream / async_stream_infer)
  metrics:        http://localhost:{metrics}/metrics
Ctrl-C stops the server."""

OPENAI_USAGE = """\
OpenAI API on localhost:{openai} (any OpenAI client with base_url http://localhost:{openai}/v1):
  curl -s localhost:{openai}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "omni_chat", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "max_tokens": 32}}'
"""


def _port(value: str | None, default: int) -> int:
    return int(value) if value else default


def _front_door_config(args, admin_key: str) -> ServingConfig:
    """Front door settings: the environment's (OMNI_API_KEY, ...), pointed at this tritonserver's ports and
    holding its operator key."""
    config = ServingConfig.from_env()
    config.admin_key = admin_key
    config.port = args.openai_port
    config.triton_grpc = f"localhost:{args.grpc_port}"
    config.triton_http = f"localhost:{args.http_port}"
    config.triton_metrics_url = f"http://localhost:{args.metrics_port}/metrics"
    return config


def main(argv: list[str] | None = None) -> int:
    """Start the server, print how to call it, wait for a signal, stop it. Returns the exit code."""
    parser = argparse.ArgumentParser(prog="scripts/serve.sh", description="Serve omni_chat with tritonserver.")
    parser.add_argument("--http-port", type=int, default=_port(os.environ.get("OMNI_HTTP_PORT"), 8000))
    parser.add_argument("--grpc-port", type=int, default=_port(os.environ.get("OMNI_GRPC_PORT"), 8001))
    parser.add_argument("--metrics-port", type=int, default=_port(os.environ.get("OMNI_METRICS_PORT"), 8002))
    parser.add_argument("--openai-port", type=int, default=_port(os.environ.get("OMNI_OPENAI_PORT"), 9000),
                        help="port of the OpenAI-compatible front door (0: do not start it)")
    parser.add_argument("--model-repository", default=str(paths.rendered_repository_dir()))
    parser.add_argument("--exit-timeout-secs", type=int, default=int(os.environ.get("OMNI_EXIT_TIMEOUT_SECS", "30")))
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for all models")
    parser.add_argument("--log-verbose", type=int, default=0)
    args = parser.parse_args(argv)

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop.set())

    server = TritonServer(
        args.model_repository, http_port=args.http_port, grpc_port=args.grpc_port,
        metrics_port=args.metrics_port, exit_timeout_s=args.exit_timeout_secs, log_verbose=args.log_verbose,
    )
    started: list = []  # everything started here, stopped in reverse order
    try:
        print(f"[serve] starting tritonserver (HTTP {args.http_port}, gRPC {args.grpc_port}, "
              f"metrics {args.metrics_port}) on {args.model_repository}", flush=True)
        server.start(ready_timeout_s=args.ready_timeout)
        started.append(server)
        if server.admin_key_generated:
            print(f"[serve] operator key for Triton's model-repository, logging, trace and shared-memory APIs "
                  f"(header {ADMIN_KEY_HEADER}; set OMNI_ADMIN_KEY to choose it): {server.admin_key}", flush=True)
        if args.openai_port:
            front_door = FrontDoorProcess(_front_door_config(args, server.admin_key))
            print(f"[serve] starting the OpenAI front door on port {args.openai_port}", flush=True)
            front_door.start()
            started.append(front_door)
        if args.openai_port:
            print(OPENAI_USAGE.format(openai=args.openai_port), flush=True)
        print(USAGE.format(http=args.http_port, grpc=args.grpc_port, metrics=args.metrics_port), flush=True)
        while not stop.is_set():
            if server.process is None or server.process.poll() is not None:
                print("[serve] tritonserver exited", file=sys.stderr)
                return 1
            if any(s.process is not None and s.process.poll() is not None for s in started[1:]):
                print("[serve] the OpenAI front door exited", file=sys.stderr)
                return 1
            stop.wait(1.0)
        print("[serve] stopping", flush=True)
        return 0
    except (TritonServerError, RuntimeError) as exc:
        print(f"[serve] {exc}", file=sys.stderr)
        return 1
    finally:
        for service in reversed(started):
            service.stop()
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
