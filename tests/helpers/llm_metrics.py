"""The llm stage's load gauges on Triton's metrics page (published about once a second), and polling until a
condition holds: for tests that check requests leave nothing behind."""

from __future__ import annotations

import re
import time
import urllib.request


def llm_metrics(metrics_url: str) -> dict[str, float]:
    """The llm stage's omni_kv_cache_blocks_used/_total and omni_requests_running/_waiting gauges."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    values = {}
    for name in ("omni_kv_cache_blocks_used", "omni_kv_cache_blocks_total", "omni_requests_running",
                 "omni_requests_waiting"):
        match = re.search(rf'^{name}{{[^}}]*model="llm"[^}}]*}} (\S+)$', text, re.MULTILINE)
        assert match, f"{name} for llm is missing from the metrics page"
        values[name] = float(match.group(1))
    return values


def wait_for(condition, timeout_s: float, interval_s: float = 0.2):
    """Poll `condition()` until it returns a truthy value or `timeout_s` passes; returns the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)
