"""The operator's key: the header that opens Triton's restricted APIs and the prefix cache reset, and how a
tritonserver command line carries it.

tritonserver starts with `--http-restricted-api` / `--grpc-restricted-protocol` rules naming the header
`omni-admin-key` and the key (omni_backend/launch/tritonserver.py builds them, docker/entrypoint.sh too); the llm
stage reads the key back from its parent tritonserver's command line (stages/llm/server_probe.py); the front door
forwards the header. Over gRPC, Triton 2.51 checks the metadata key with its `triton-grpc-protocol-` prefix.
"""

from __future__ import annotations

ADMIN_KEY_HEADER = "omni-admin-key"
GRPC_ADMIN_KEY_HEADER = "triton-grpc-protocol-" + ADMIN_KEY_HEADER  # the gRPC metadata key 2.51 checks
RESTRICTED_APIS = ("model-repository", "logging", "trace", "shared-memory")


def restricted_api_flags(admin_key: str) -> list[str]:
    """tritonserver flags that close RESTRICTED_APIS over HTTP and gRPC to all but holders of `admin_key`
    (Triton's `--http-restricted-api=<apis>:<header>=<value>`)."""
    apis = ",".join(RESTRICTED_APIS)
    return [f"--http-restricted-api={apis}:{ADMIN_KEY_HEADER}={admin_key}",
            f"--grpc-restricted-protocol={apis}:{ADMIN_KEY_HEADER}={admin_key}"]


def tritonserver_flags(cmdline: list[str]) -> dict[str, str]:
    """`--name=value` and `--name value` flags of a tritonserver command line, by name without dashes."""
    flags, i = {}, 1
    while i < len(cmdline):
        arg = cmdline[i]
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if not eq and i + 1 < len(cmdline) and not cmdline[i + 1].startswith("--"):
                value, i = cmdline[i + 1], i + 1
            flags[name] = value
        i += 1
    return flags


def admin_key_of(flags: dict[str, str]) -> str | None:
    """The operator's key in a tritonserver's flags (`tritonserver_flags`): what `restricted_api_flags` gives the
    `omni-admin-key` header. None when no restricted-API flag names that header."""
    for name in ("grpc-restricted-protocol", "http-restricted-api"):
        _, _, rule = flags.get(name, "").partition(":")  # "<apis>:<header>=<key>"
        header, _, key = rule.partition("=")
        if header == ADMIN_KEY_HEADER and key:
            return key
    return None
