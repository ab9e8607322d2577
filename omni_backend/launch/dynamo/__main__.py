"""`python -m omni_backend.launch.dynamo --model FOLDER`: serve our LLM engine as an NVIDIA Dynamo worker until
Ctrl-C/SIGTERM (launch/dynamo/worker.py).

Engine settings are the llm stage's: `OMNI_<NAME>` variables (README "Settings"), or `--setting NAME=VALUE`
(operator names, e.g. `--setting max_model_len=4096`). Dynamo's own come from its environment: `ETCD_ENDPOINTS`,
`NATS_SERVER`, `DYN_SYSTEM_ENABLED` / `DYN_SYSTEM_PORT` (health), `DYN_LOG`. `scripts/serve_dynamo.sh` starts
etcd, NATS, Dynamo's frontend and N of these workers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from omni_backend.launch.dynamo.worker import WorkerOptions, serve


def parse_setting(text: str) -> tuple[str, str]:
    """`NAME=VALUE` of `--setting` (argparse type). Raises argparse.ArgumentTypeError without `=`."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and serve. Returns the exit code (1 when the worker could not start)."""
    parser = argparse.ArgumentParser(prog="python -m omni_backend.launch.dynamo",
                                     description="Serve our LLM engine as an NVIDIA Dynamo worker.")
    parser.add_argument("--model", required=True, help="served Hugging Face folder (weights, tokenizer, template)")
    parser.add_argument("--served-model-name", help="the model name clients ask for (default: --model)")
    parser.add_argument("--namespace", default="dynamo")
    parser.add_argument("--component", default="backend")
    parser.add_argument("--endpoint", default="generate")
    parser.add_argument("--discovery-backend", default="etcd", choices=("etcd", "file", "kubernetes", "mem"))
    parser.add_argument("--request-plane", default="tcp", choices=("tcp", "nats"))
    parser.add_argument("--setting", type=parse_setting, action="append", default=[], metavar="NAME=VALUE",
                        help="an engine or llm-stage setting by operator name (over OMNI_<NAME>); repeatable")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = WorkerOptions(args.model, args.served_model_name, args.namespace, args.component, args.endpoint,
                            args.discovery_backend, args.request_plane, dict(args.setting))
    try:
        asyncio.run(serve(options))
    except (ValueError, OSError) as exc:
        print(f"[dynamo worker] {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
