"""The load metrics under vLLM's names, beside the llm stage's own `omni_*` (ops/metrics.py).

The Kubernetes Gateway API Inference Extension's endpoint picker (and llm-d's, KServe's, built on it) reads a
model server's queue and KV-cache load from these names on its Prometheus page; dashboards built for vLLM read
the latency histograms. Triton's custom metrics take the colon in a family name (checked on tritonserver 2.51:
the names below appear on its metrics port as they are), so they are published by the llm stage itself, on the
metrics port (8002), per engine. Labels as vLLM v1 sets them (`vllm/v1/metrics/loggers.py`): `model_name` (here the
Triton model's name, "llm": the name its clients address) and `engine` (the engine's index among the server's llm
engines, stages/llm/parameters.place_instance: "0" with one engine).

    vllm:num_requests_running          gauge      requests in the engine's running batch
    vllm:num_requests_waiting          gauge      requests waiting to be scheduled (the engine's queue)
    vllm:kv_cache_usage_perc           gauge      KV-cache blocks in use / all blocks, 0..1 (despite the name: a
                                                  fraction, as vLLM's; evictable cached blocks count as free)
    vllm:time_to_first_token_seconds   histogram  llm arrival -> first token sampled (s)
    vllm:inter_token_latency_seconds   histogram  per request with at least two tokens, its mean gap between
                                                  tokens (s)

One difference from vLLM: vLLM observes every gap between a request's tokens, this stage one mean per request
(each observation is an IPC call from the stub, and one per token would cost the metrics thread about 14 us each,
measured on tritonserver 2.51 here). So `_count` counts requests, and `_sum / _count` is the mean over requests of
their mean gap, not the mean over tokens. Buckets are vLLM's.
"""

from __future__ import annotations

# vLLM v1's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]


class StandardMetrics:
    """The vLLM-named families of one engine, created once; `LLMMetrics.publish` feeds them with its own.

    Args:
        pb_utils: `triton_python_backend_utils` (or a stand-in with its MetricFamily API).
        model_name: the `model_name` label (the Triton model's name).
        engine: the `engine` label (the engine's index among the server's llm instances).
    """

    def __init__(self, pb_utils, model_name: str, engine: str):
        family = pb_utils.MetricFamily
        labels = {"model_name": model_name, "engine": engine}
        self._families = []  # a MetricFamily must outlive its metrics

        def metric(name, description, kind, buckets=None):
            fam = family(name=name, description=description, kind=kind)
            self._families.append(fam)
            return fam.Metric(labels=labels) if buckets is None else fam.Metric(labels=labels, buckets=buckets)

        G, H = family.GAUGE, family.HISTOGRAM
        self.running = metric("vllm:num_requests_running", "Number of requests in model execution batches.", G)
        self.waiting = metric("vllm:num_requests_waiting", "Number of requests waiting to be processed.", G)
        self.kv_usage = metric("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", G)
        self.ttft = metric("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", H,
                           TTFT_BUCKETS)
        self.itl = metric("vllm:inter_token_latency_seconds",
                          "Histogram of inter-token latency in seconds (one mean per request).", H, ITL_BUCKETS)

    def gauges(self, stats) -> list[tuple[object, float]]:
        """Each gauge with its value in an `ops.metrics.LLMStats` snapshot (`LLMMetrics.publish` sets those that
        changed)."""
        usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        return [(self.running, stats.running), (self.waiting, stats.waiting), (self.kv_usage, usage)]

    def observe(self, request) -> None:
        """Observe one finished request (an `ops.metrics.FinishedRequest`) in the histograms."""
        if request.ttft_s is not None:
            self.ttft.observe(request.ttft_s)
        if request.mean_itl_s is not None:
            self.itl.observe(request.mean_itl_s)
