"""`python -m omni_backend.ops.ready`: exit 0 when the server can take new requests, else 1 with the reason.

Ready means Triton's `/v2/health/ready` answers 200, no stage's governor refuses new requests (critical GPU
temperature, `omni_governor_state` 3 on the metrics port) and no stage's heartbeat
(`omni_stage_heartbeat_timestamp_seconds`, published about once a second) is older than 3 s: Triton 2.51 keeps a
model READY after its stub process died and never restarts a decoupled model's stub. Triton gives a Python model no
way to flip the server's readiness, so this is the readiness probe of a deployment (docker/k8s/): while the GPU is
too hot or a stage is dead the pod leaves its Service's endpoints and new traffic goes elsewhere.
Flags: --http (default localhost:8000), --metrics (default http://localhost:8002/metrics), --live: the liveness
check instead (Triton's `/v2/health/live` and no stale stage heartbeat; a hot GPU is not a reason to restart), for
a liveness probe that restarts a server whose stage died, since Triton 2.51 does not restart it.
"""

from __future__ import annotations

import argparse
import sys
import urllib.request

from omni_backend.ops.metrics import admitting, stale_stages


def check(http: str, metrics_url: str, timeout_s: float = 2.0) -> tuple[bool, str]:
    """(ready, reason)."""
    try:
        with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=timeout_s) as response:
            if response.status != 200:
                return False, f"triton not ready (HTTP {response.status})"
        return admitting(metrics_url, timeout_s)
    except OSError as exc:  # connection refused, HTTP error status, timeout
        return False, f"triton not ready ({exc})"


def check_live(http: str, metrics_url: str, timeout_s: float = 2.0) -> tuple[bool, str]:
    """(live, reason): Triton answers `/v2/health/live` with 200 and every stage that publishes a heartbeat
    published one within the last STALE_AFTER_S seconds (omni_backend/ops/metrics.py)."""
    try:
        with urllib.request.urlopen(f"http://{http}/v2/health/live", timeout=timeout_s) as response:
            if response.status != 200:
                return False, f"triton not live (HTTP {response.status})"
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
            dead = stale_stages(response.read().decode("utf-8", "replace"))
    except OSError as exc:  # connection refused, HTTP error status, timeout
        return False, f"triton not live ({exc})"
    if dead:
        return False, "stage process dead or hung: " + ", ".join(
            f"{model}/{version} silent for {age:.1f} s" for (model, version), age in sorted(dead.items()))
    return True, "ok"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_backend.ops.ready", description=__doc__)
    parser.add_argument("--http", default="localhost:8000")
    parser.add_argument("--metrics", default="http://localhost:8002/metrics")
    parser.add_argument("--live", action="store_true", help="the liveness check instead of readiness")
    args = parser.parse_args(argv)
    ready, reason = (check_live if args.live else check)(args.http, args.metrics)
    print(reason)
    return 0 if ready else 1


if __name__ == "__main__":
    sys.exit(main())
