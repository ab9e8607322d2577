"""Front door settings: flags of `python -m omni_backend.serving`, else environment variables, else defaults.

| setting | flag | environment | default |
| --- | --- | --- | --- |
| listen address | `--host`, `--port` | `OMNI_OPENAI_HOST`, `OMNI_OPENAI_PORT` | 0.0.0.0, 9000 |
| Triton gRPC | `--triton-grpc` | `OMNI_TRITON_GRPC` (else localhost:`OMNI_GRPC_PORT`) | localhost:8001 |
| Triton HTTP (for `/v2`) | `--triton-http` | `OMNI_TRITON_HTTP` (else localhost:`OMNI_HTTP_PORT`) | localhost:8000 |
| Triton metrics | `--triton-metrics` | `OMNI_TRITON_METRICS` (else localhost:`OMNI_METRICS_PORT`) | http://localhost:8002/metrics |
| served models | `--model` (repeatable) | `OMNI_OPENAI_MODELS` (comma-separated) | omni_chat |
| API key | `--api-key` | `OMNI_API_KEY` | none (no key needed) |
| body limit | `--max-body-bytes` | `OMNI_OPENAI_MAX_BODY_BYTES` | 33554432 (32 MiB) |
| requests in flight | `--max-concurrent-requests` | `OMNI_OPENAI_MAX_CONCURRENT_REQUESTS` | 256 (0: no limit) |
| shutdown grace | `--graceful-shutdown-s` | `OMNI_OPENAI_GRACEFUL_SHUTDOWN_S` | 30 s |
| browser origins (CORS) | `--allowed-origins` (comma-separated, `*` any) | `OMNI_OPENAI_ALLOWED_ORIGINS` | none: CORS off |
| operator key | (environment only) | `OMNI_ADMIN_KEY` | none: `/v2` admin APIs closed |
| API docs | `--docs`, `--no-docs` | `OMNI_OPENAI_DOCS` (`FrontDoorSettings`) | true: `/openapi.json`, `/docs`, `/redoc` |
| stages on other servers | `--stage-endpoints` | `OMNI_STAGE_ENDPOINTS` (`FrontDoorSettings`) | none: every stage on Triton gRPC |

On SIGTERM/SIGINT the front door stops accepting connections at once and lets requests in flight (streams
included) finish for up to the shutdown grace; whatever still runs then is cut.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

from omni_backend.settings import SettingGroup, from_environ, parse_field, setting

# The stages the front door can reach on a tritonserver of their own, and the models it calls there:
# tts: the `tts` stage (/v1/audio/speech and chat answers spoken with a voice); diffusion: the `text2image`
# ensemble (diffusion -> png_encode, so both are served there) and the `diffusion` model's config (its limits).
SEPARATE_STAGES = ("diffusion", "tts")
_ENDPOINT = r"[A-Za-z0-9_]+=[^,=\s]+:[0-9]+"


@dataclass(frozen=True)
class FrontDoorSettings(SettingGroup):
    """The front door's settings declared as settings (`OMNI_OPENAI_<FIELD>`, in docs/operations.md's table, and
    a flag each in `python -m omni_backend.serving`)."""

    docs: bool = setting(True, "the OpenAI front door publishes its API: /openapi.json (OpenAPI 3.1), /docs (Swagger "
                               "UI) and /redoc (docs/api.md); false: those paths are 404s")
    stage_endpoints: str = setting(
        "", "stages the front door reaches on a tritonserver of their own, as stage=host:port (its gRPC port), "
            "comma-separated: tts (speech) and diffusion (images; text2image, diffusion and png_encode served "
            "there); empty: every stage on the front door's Triton", name="stage_endpoints",
        pattern=rf"(|{_ENDPOINT}(\s*,\s*{_ENDPOINT})*)",
        forms="empty or comma-separated stage=host:port (e.g. tts=host:8001,diffusion=host2:8001)")

    PREFIX: ClassVar[str] = "openai_"  # the settings' names: openai_<field>, OMNI_OPENAI_<FIELD>


def stage_endpoints(text: str) -> dict[str, str]:
    """`stage=host:port` pairs, comma-separated (the `stage_endpoints` setting), as stage -> `host:port`.

    Raises:
        ValueError: text not of that form, or a stage given twice (ServingConfig refuses stages it does not
            know).
    """
    endpoints: dict[str, str] = {}
    for pair in filter(None, parse_field(FrontDoorSettings, "stage_endpoints", text.strip()).split(",")):
        stage, _, where = pair.strip().partition("=")
        if stage in endpoints:
            raise ValueError(f"setting stage_endpoints: stage {stage!r} is given twice")
        endpoints[stage] = where
    return endpoints


def _env_int(environ, name: str, default: int) -> int:
    value = environ.get(name)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


@dataclass
class ServingConfig:
    """Everything the front door needs to know (see the module docstring for flags and variables).

    Attributes:
        triton_grpc: Triton's gRPC endpoint `host:port` (generation goes here).
        triton_http: Triton's HTTP endpoint `host:port` (the `/v2` pass-through goes here).
        triton_metrics_url: Triton's Prometheus page, prepended to `/metrics`.
        models: served model names; each is a chat entry point of preprocess -> llm -> postprocess.
        api_key: when set, `/v1/*` and `/v2/*` (except `/v2/health/*`) need `Authorization: Bearer <key>`.
        max_body_bytes: larger request bodies get 413.
        max_concurrent_requests: generation requests served at once; more get 429 (0: no limit).
        graceful_shutdown_s: seconds requests in flight may run on after SIGTERM/SIGINT (0: cut at once).
        host, port: where the front door listens.
        allowed_origins: browser origins allowed by CORS ("*": any); empty: CORS off (preflights get 400).
        admin_key: the operator's key; `/v2` APIs beyond inference, metadata and health are forwarded only with
            it in the `omni-admin-key` header (tritonserver checks the same key). None: never forwarded.
        docs: publish the API: `/openapi.json` (OpenAPI 3.1), `/docs` (Swagger UI) and `/redoc`, open like
            `/health` (serving/openapi.py); False: they are 404s.
        stage_endpoints: stage (one of SEPARATE_STAGES) -> the gRPC `host:port` of the tritonserver serving it,
            for stages not on `triton_grpc` (`stage_endpoints()` parses the setting's text).
    """

    triton_grpc: str = "localhost:8001"
    triton_http: str = "localhost:8000"
    triton_metrics_url: str = "http://localhost:8002/metrics"
    models: tuple[str, ...] = field(default_factory=lambda: ("omni_chat",))
    api_key: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    max_concurrent_requests: int = 256
    graceful_shutdown_s: int = 30
    host: str = "0.0.0.0"
    port: int = 9000
    allowed_origins: tuple[str, ...] = ()
    admin_key: str | None = None
    docs: bool = FrontDoorSettings.docs
    stage_endpoints: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("at least one served model is needed")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_concurrent_requests < 0:
            raise ValueError(f"max_concurrent_requests must be >= 0, got {self.max_concurrent_requests}")
        if self.graceful_shutdown_s < 0:
            raise ValueError(f"graceful_shutdown_s must be >= 0, got {self.graceful_shutdown_s}")
        self.models = tuple(self.models)
        self.allowed_origins = tuple(self.allowed_origins)
        unknown = sorted(set(self.stage_endpoints) - set(SEPARATE_STAGES))
        if unknown:
            raise ValueError(f"setting stage_endpoints: unknown stage {unknown[0]!r}; the stages that can run on a "
                             f"server of their own: {', '.join(SEPARATE_STAGES)}")

    def stage_grpc(self, stage: str) -> str:
        """The gRPC `host:port` serving `stage`: its own endpoint, else `triton_grpc`."""
        return self.stage_endpoints.get(stage, self.triton_grpc)

    @classmethod
    def from_env(cls, environ=None) -> "ServingConfig":
        """Defaults overridden by the environment variables in the module docstring."""
        env = os.environ if environ is None else environ
        grpc_port = env.get("OMNI_GRPC_PORT") or "8001"
        http_port = env.get("OMNI_HTTP_PORT") or "8000"
        metrics_port = env.get("OMNI_METRICS_PORT") or "8002"
        settings = from_environ(FrontDoorSettings, env, FrontDoorSettings.PREFIX)
        models = [m.strip() for m in (env.get("OMNI_OPENAI_MODELS") or "omni_chat").split(",") if m.strip()]
        return cls(
            triton_grpc=env.get("OMNI_TRITON_GRPC") or f"localhost:{grpc_port}",
            triton_http=env.get("OMNI_TRITON_HTTP") or f"localhost:{http_port}",
            triton_metrics_url=env.get("OMNI_TRITON_METRICS") or f"http://localhost:{metrics_port}/metrics",
            models=tuple(models),
            api_key=env.get("OMNI_API_KEY") or None,
            max_body_bytes=_env_int(env, "OMNI_OPENAI_MAX_BODY_BYTES", cls.max_body_bytes),
            max_concurrent_requests=_env_int(env, "OMNI_OPENAI_MAX_CONCURRENT_REQUESTS",
                                             cls.max_concurrent_requests),
            graceful_shutdown_s=_env_int(env, "OMNI_OPENAI_GRACEFUL_SHUTDOWN_S", cls.graceful_shutdown_s),
            host=env.get("OMNI_OPENAI_HOST") or cls.host,
            port=_env_int(env, "OMNI_OPENAI_PORT", cls.port),
            allowed_origins=origins(env.get("OMNI_OPENAI_ALLOWED_ORIGINS") or ""),
            admin_key=env.get("OMNI_ADMIN_KEY") or None,
            docs=settings.docs,
            stage_endpoints=stage_endpoints(settings.stage_endpoints),
        )


def origins(text: str) -> tuple[str, ...]:
    """Comma-separated origins ("https://a.example, https://b.example", or "*") as a tuple."""
    return tuple(origin.strip() for origin in text.split(",") if origin.strip())
