"""Run the OpenAI front door as a child process (used by `python -m omni_backend.launch`, i.e. `scripts/serve.sh`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from omni_backend.serving.config import ServingConfig


class FrontDoorProcess:
    """`python -m omni_backend.serving` for `config`, started and stopped like `TritonServer`."""

    def __init__(self, config: ServingConfig):
        self.config = config
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        c = self.config
        command = [sys.executable, "-m", "omni_backend.serving", "--host", c.host, "--port", str(c.port),
                   "--triton-grpc", c.triton_grpc, "--triton-http", c.triton_http,
                   "--triton-metrics", c.triton_metrics_url, "--max-body-bytes", str(c.max_body_bytes),
                   "--max-concurrent-requests", str(c.max_concurrent_requests),
                   "--graceful-shutdown-s", str(c.graceful_shutdown_s), "--allowed-origins", ",".join(c.allowed_origins)]
        for model in c.models:
            command += ["--model", model]
        return command  # the keys travel in the environment (`environment`), not on the command line

    def environment(self) -> dict[str, str]:
        """This process's environment, with the operator's key (`OMNI_ADMIN_KEY`) when the config has one; the
        API key (`OMNI_API_KEY`) is inherited."""
        env = dict(os.environ)
        if self.config.admin_key:
            env["OMNI_ADMIN_KEY"] = self.config.admin_key
        return env

    def start(self, ready_timeout_s: float = 60.0) -> "FrontDoorProcess":
        """Start it and wait until `GET /health` answers (any status: the app is up).

        Raises:
            RuntimeError: it exited or did not answer within `ready_timeout_s`.
        """
        self.process = subprocess.Popen(self.command(), env=self.environment())
        url = f"http://127.0.0.1:{self.config.port}/health"
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the OpenAI front door exited with code {self.process.returncode}")
            try:
                urllib.request.urlopen(url, timeout=2).close()
                return self
            except urllib.error.HTTPError:
                return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the OpenAI front door did not answer on port {self.config.port} "
                           f"within {ready_timeout_s:.0f} s")

    def stop(self) -> None:
        """SIGTERM (requests in flight get up to `graceful_shutdown_s` to finish), then SIGKILL 10 s after that."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=self.config.graceful_shutdown_s + 10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
