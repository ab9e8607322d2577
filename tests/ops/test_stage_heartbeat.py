"""The stage heartbeat (omni_stage_heartbeat_timestamp_seconds): published with every llm metrics publication and
by every other stage's StageHeartbeat thread, and
read back by `stale_stages`/`stages_ready` (the front door's /health, ops/ready.py, serving.metrics.StageWatch).
The end-to-end check, a killed llm stub, is tests/reliability/test_stage_death.py."""

from __future__ import annotations

import asyncio
import time

from omni_backend.ops.metrics import (HEARTBEAT, STALE_AFTER_S, LLMMetrics, LLMStats, StageHeartbeat, stages_ready,
                                      stale_stages)
from omni_backend.serving.metrics import StageWatch

NOW = 1_800_000_000.0


def page(*samples: tuple[str, float], governor: int = 1) -> str:
    lines = [f"# TYPE {HEARTBEAT} gauge"]
    lines += [f'{HEARTBEAT}{{model="{model}",version="1"}} {value!r}' for model, value in samples]
    lines.append(f'omni_governor_state{{model="llm",version="1"}} {governor}')
    return "\n".join(lines) + "\n"


def test_stale_stages_lists_only_silent_stages_that_published_once():
    text = page(("llm", NOW - 0.5), ("other", NOW - STALE_AFTER_S - 0.5), ("starting", 0.0))
    assert stale_stages(text, NOW) == {("other", "1"): STALE_AFTER_S + 0.5}
    assert stale_stages(page(("llm", NOW - 0.5)), NOW) == {}
    assert stale_stages("", NOW) == {}  # a server without such stages is not judged


def test_stages_ready_reasons():
    assert stages_ready(page(("llm", NOW - 1.0)), NOW) == (True, "ok")
    ready, reason = stages_ready(page(("llm", NOW - 10.0)), NOW)
    assert not ready and reason == "stage not responding (stub process dead or hung): llm/1 silent for 10.0 s"
    ready, reason = stages_ready(page(("llm", NOW - 1.0), governor=3), NOW)
    assert not ready and reason == "not admitting (critical GPU temperature): llm/1"


class _FakeMetric:
    def __init__(self):
        self.value = 0.0

    def set(self, value):
        self.value = value

    def increment(self, value):
        self.value += value

    def observe(self, value):
        pass


class _FakeFamily:
    HISTOGRAM, COUNTER, GAUGE = "histogram", "counter", "gauge"
    made: dict = {}

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' spelling
        metric = _FakeMetric()
        _FakeFamily.made[(self.name, tuple(sorted(labels.items())))] = metric
        return metric


class _FakePbUtils:
    MetricFamily = _FakeFamily


def test_publish_sets_the_heartbeat_every_time():
    metrics = LLMMetrics(_FakePbUtils, "llm", "1", "torch")
    assert metrics.heartbeat.value == 0.0
    metrics.publish(LLMStats(), now=NOW)
    assert metrics.heartbeat.value == NOW
    metrics.publish(LLMStats(), now=NOW + 1.0)  # nothing else changed: the heartbeat still moves
    assert metrics.heartbeat.value == NOW + 1.0


def test_stage_heartbeat_beats_from_its_thread_until_stopped():
    """A unary stage's heartbeat: fresh within one interval of starting, moving while the stub lives, frozen once
    stopped (a killed stub's thread dies with it)."""
    beat = StageHeartbeat(_FakePbUtils, "preprocess", 1, interval_s=0.05)
    gauge = _FakeFamily.made[(HEARTBEAT, (("model", "preprocess"), ("version", "1")))]
    try:
        deadline = time.monotonic() + 5
        while gauge.value == 0.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        first = gauge.value
        assert abs(first - time.time()) < 1.0
        while gauge.value == first and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gauge.value > first, "the heartbeat did not move"
    finally:
        beat.stop()
    stopped = gauge.value
    time.sleep(0.2)
    assert gauge.value == stopped
    assert stale_stages(page(("preprocess", stopped)), now=stopped + STALE_AFTER_S + 1) == {
        ("preprocess", "1"): STALE_AFTER_S + 1}


def test_stage_watch_reports_the_silent_model_and_caches_one_scrape(monkeypatch):
    import omni_backend.serving.metrics as serving_metrics

    scrapes = []

    async def fake_scrape(session, url):
        scrapes.append(url)
        return page(("llm", 1.0))  # long silent (Unix time 1 s)

    monkeypatch.setattr(serving_metrics, "triton_metrics", fake_scrape)
    watch = StageWatch(lambda: None, "http://metrics", cache_s=60.0)

    async def ask():
        return await watch.silent("llm"), await watch.silent("preprocess")

    llm_silent, other = asyncio.run(ask())
    assert llm_silent > 1e9 and other is None
    assert scrapes == ["http://metrics"]
