"""Start, wait for and stop a real tritonserver process (the binary laid out by `omni_backend.setup`).

Used by `scripts/serve.sh` (through `python -m omni_backend.launch`) and by the pytest fixture in
`tests/conftest.py`.

The server's administrative APIs are closed to anonymous clients: `--http-restricted-api` and
`--grpc-restricted-protocol` require the operator's key (HTTP header `omni-admin-key`; gRPC metadata
`triton-grpc-protocol-omni-admin-key`, the prefix Triton 2.51 adds) for the model repository (load, unload, index), logging, trace and shared-memory registration (Triton's
"Restricted APIs", docs/customization_guide/inference_protocols.md). Inference, metadata, model config, health
and statistics stay open. The key is `OMNI_ADMIN_KEY`, else one generated for this server.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from omni_backend import paths
from omni_backend.operator_key import restricted_api_flags
from omni_backend.ops.memory_env import memory_environment
from omni_backend.setup import runtime as runtime_layout


# Triton log lines: severity letter + MMDD, e.g. "E1130 12:20:40.581361 4748 model_lifecycle.cc:642] ...".
_ERROR_LINE = re.compile(r"^E\d{4} ")
_HARMLESS = re.compile(r"CudaDriverHelper has not been initialized|unable to create stream for .*CUDA driver")


def _terminate_with_parent() -> None:
    """In the child before exec: ask Linux to SIGTERM it when the thread that started it dies.

    Keeps a killed test run or launcher from leaving a server holding its ports. Best effort (Linux only).
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class TritonServerError(RuntimeError):
    """tritonserver exited or did not become ready; the message ends with the tail of its log."""


class TritonServer:
    """One tritonserver process serving a model repository.

    The server runs in its own session (process group) with the venv's `bin/` first on `PATH` (the Python
    backend stub takes `sys.path` from the first `python3` there) and the runtime's `lib/` on
    `LD_LIBRARY_PATH`. It gets SIGTERM if the thread that called `start` dies, so call `start` from a thread
    that outlives the server (the main thread in scripts and tests).

    Args:
        model_repository: rendered repository folder (see `omni_backend.repository`).
        http_port, grpc_port, metrics_port: ports to listen on (all interfaces).
        exit_timeout_s: `--exit-timeout-secs`, seconds the server waits for in-flight requests on shutdown.
        log_file: where stdout+stderr go; None inherits this process's (a terminal shows the log live).
        runtime: runtime folder, default `<cache>/tritonserver`.
        log_verbose: `--log-verbose` level (0 = off).
        extra_args: more tritonserver flags, e.g. `["--model-control-mode=explicit", "--load-model=preprocess"]`.
        env: environment changes for the server and its stubs (a None value removes the variable).
        admin_key: the operator's key for the restricted APIs (operator_key.RESTRICTED_APIS); None: `OMNI_ADMIN_KEY`,
            else a random one (`admin_key_generated` is then True; the caller shows it once).
    """

    def __init__(
        self,
        model_repository: Path | str,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        exit_timeout_s: int = 30,
        log_file: Path | str | None = None,
        runtime: Path | None = None,
        log_verbose: int = 0,
        extra_args: list[str] | tuple[str, ...] = (),
        env: dict[str, str | None] | None = None,
        admin_key: str | None = None,
    ):
        self.model_repository = Path(model_repository).absolute()
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.exit_timeout_s = exit_timeout_s
        self.log_file = Path(log_file).absolute() if log_file is not None else None
        self.runtime = (runtime or paths.runtime_dir()).absolute()
        self.log_verbose = log_verbose
        self.extra_args = list(extra_args)
        self.env_changes = dict(env or {})
        configured = admin_key or os.environ.get("OMNI_ADMIN_KEY")
        self.admin_key = configured or secrets.token_urlsafe(24)
        self.admin_key_generated = not configured
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        """`host:port` of the HTTP endpoint, as tritonclient.http wants it."""
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """`host:port` of the gRPC endpoint, as tritonclient.grpc wants it."""
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """Full URL of the Prometheus metrics page."""
        return f"http://localhost:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        """The tritonserver command line."""
        return [
            str(runtime_layout.tritonserver_binary(self.runtime)),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={self.runtime / 'backends'}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
            *restricted_api_flags(self.admin_key),
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        """Environment for the server: venv `bin/` first on PATH, runtime `lib/` first on LD_LIBRARY_PATH."""
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(paths.venv_bin()), env.get("PATH", "")]).rstrip(os.pathsep)
        library_path = runtime_layout.library_path(self.runtime)
        env["LD_LIBRARY_PATH"] = os.pathsep.join([library_path, env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
        env.setdefault("HF_HUB_OFFLINE", "1")  # stages load local checkpoints only
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        for name, value in memory_environment().items():  # see omni_backend/ops/memory_env.py
            env.setdefault(name, value)
        for name, value in self.env_changes.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        return env

    def start(self, ready_timeout_s: float = 300.0) -> "TritonServer":
        """Launch tritonserver and wait until `GET /v2/health/ready` answers 200.

        Raises:
            FileNotFoundError: no runtime folder (run scripts/setup.sh) or no model repository.
            TritonServerError: the server exited, or was not ready within `ready_timeout_s` seconds (then it
                is stopped); the message carries the end of the server log when `log_file` is set.
        """
        if self.process is not None:
            raise RuntimeError("this TritonServer is already started")
        binary = runtime_layout.tritonserver_binary(self.runtime)
        if not binary.is_file():
            raise FileNotFoundError(f"{binary} is missing: run scripts/setup.sh first")
        if not self.model_repository.is_dir():
            raise FileNotFoundError(f"model repository {self.model_repository} does not exist")
        output = None
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            output = open(self.log_file, "wb")
        try:
            self.process = subprocess.Popen(
                self.command(), env=self.environment(), stdin=subprocess.DEVNULL,
                stdout=output, stderr=subprocess.STDOUT if output else None, start_new_session=True,
                preexec_fn=_terminate_with_parent,
            )
        finally:
            if output is not None:
                output.close()
        self.wait_ready(ready_timeout_s)
        return self

    def is_ready(self) -> bool:
        """True when the server answers `GET /v2/health/ready` with 200 (all models loaded) and its metrics page
        answers too: tritonserver opens the metrics port after the HTTP one, and a caller reading the metrics right
        after a start was refused the connection."""
        try:
            for url in (f"http://{self.http_url}/v2/health/ready", self.metrics_url):
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status != 200:
                        return False
            return True
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        """Poll readiness every 0.25 s.

        Raises:
            TritonServerError: the process exited, or `timeout_s` passed (the server is then stopped).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise TritonServerError(f"tritonserver exited with code {code} before it was ready{self._log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.25)
        self.stop()
        raise TritonServerError(f"tritonserver was not ready within {timeout_s:.0f} s{self._log_tail()}")

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM, wait up to `grace_s` (default exit_timeout_s + 10 s), then SIGKILL the process group.

        Returns:
            The exit code, or None when no server was running.
        """
        process, self.process = self.process, None
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(self.exit_timeout_s + 10 if grace_s is None else grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # also ends stub processes left behind by a killed server
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return process.wait()

    def log_text(self) -> str:
        """The whole server log so far ("" when the log goes to the terminal)."""
        if self.log_file is None or not self.log_file.is_file():
            return ""
        return self.log_file.read_text(errors="replace")

    def _log_tail(self, lines: int = 25) -> str:
        """Error lines (model load failures, unavailable models) plus the last `lines` lines of the log."""
        text = self.log_text()
        if not text:
            return f" (log: {self.log_file})" if self.log_file else ""
        all_lines = text.splitlines()
        errors = [line[:1500] for line in all_lines if _ERROR_LINE.match(line) and not _HARMLESS.search(line)]
        parts = [f"; log: {self.log_file}"]
        if errors:
            parts.append("errors:\n" + "\n".join(errors[:20]))
        parts.append("last lines:\n" + "\n".join(all_lines[-lines:]))
        return "\n".join(parts)

    def __enter__(self) -> "TritonServer":
        return self if self.process is not None else self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
