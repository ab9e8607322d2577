#!/usr/bin/env python3
"""NVIDIA aiperf against our OpenAI front door and against vLLM's CPU build, one server at a time.

Run through scripts/bench_aiperf.sh, which installs aiperf and passes `--aiperf`. For each server: start it (the
launchers of scripts/bench_serving.py: tritonserver with omni_chat plus the front door; vLLM's OpenAI server, built
on first use), run `aiperf profile --endpoint-type chat --streaming --concurrency 8 --request-count 16
--synthetic-input-tokens-mean 128 --output-tokens-mean 64 --extra-inputs ignore_eos:true --tokenizer <model
folder> --ui-type none`, stop it. Both servers run the same dtype and max_model_len. aiperf runs beside the server
on the same 2 cores (it keeps about one busy), as a client on the serving host would.

Writes aiperf.json into --results-dir (default benchmarks/results): per server output tok/s, request/s, TTFT p50,
ITL p50 (ms) and aiperf's whole summary, and the front door / vLLM ratios; aiperf's artifacts stay under
.cache/bench/aiperf/<server>/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving as serving  # noqa: E402  (the launchers and the CPU facts)

SERVERS = ("front_door", "vllm")


def aiperf_command(aiperf: Path, args, model: str, url: str, artifacts: Path) -> list[str]:
    """The aiperf profile command for one server (`url`: http://host:port)."""
    return [str(aiperf), "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", str(serving.MODEL), "--concurrency", str(args.concurrency),
            "--request-count", str(args.request_count),
            "--synthetic-input-tokens-mean", str(args.synthetic_input_tokens_mean),
            "--output-tokens-mean", str(args.output_tokens_mean), "--extra-inputs", "ignore_eos:true",
            "--ui-type", "none", "--artifact-dir", str(artifacts)]


def metric(summary: dict, name: str, stat: str) -> float | None:
    """`stat` (avg, p50, ...) of metric `name` in aiperf's profile_export_aiperf.json, in the metric's own unit
    (ms for latencies, tokens/sec for throughputs); None when absent."""
    entry = summary.get(name)
    if isinstance(entry, dict):
        value = entry.get(stat)
        return float(value) if value is not None else None
    return None


def summarize(summary: dict) -> dict:
    """The numbers the issue asks for from one aiperf summary: output tok/s, request/s, TTFT and ITL p50 (ms)."""
    return {"output_tok_s": metric(summary, "output_token_throughput", "avg"),
            "requests_per_s": metric(summary, "request_throughput", "avg"),
            "ttft_p50_ms": metric(summary, "time_to_first_token", "p50"),
            "itl_p50_ms": metric(summary, "inter_token_latency", "p50"),
            "request_latency_p50_ms": metric(summary, "request_latency", "p50"),
            "request_count": metric(summary, "request_count", "avg"),
            "completed_request_count": metric(summary, "completed_request_count", "avg"),
            "request_error_rate_pct": metric(summary, "request_error_rate", "avg") or 0.0,
            "errors": summary.get("error_summary") or [],
            # tokens the server says it generated: ignore_eos should make it the requested count
            "usage_completion_tokens_avg": metric(summary, "usage_completion_tokens", "avg"),
            "output_sequence_length_avg": metric(summary, "output_sequence_length", "avg"),
            "input_sequence_length_avg": metric(summary, "input_sequence_length", "avg")}


def run_aiperf(aiperf: Path, args, name: str, model: str, url: str) -> dict:
    """Run aiperf against one started server; its summary (`summarize`) plus the raw export. Raises RuntimeError
    when aiperf fails or writes no summary."""
    artifacts = serving.BENCH_CACHE / "aiperf" / name
    shutil.rmtree(artifacts, ignore_errors=True)
    artifacts.mkdir(parents=True)
    command = aiperf_command(aiperf, args, model, url, artifacts)
    log = artifacts.parent / f"{name}.log"
    print(f"  $ {' '.join(command)}", flush=True)
    start = time.perf_counter()
    # aiperf 0.13.0 in offline mode (HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE) looks a tokenizer up as a hub id even
    # when it is a folder, and fails (HFValidationError); online, an absolute folder path is loaded from disk
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    with open(log, "w") as handle:
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                              timeout=1800)
    found = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if done.returncode != 0 or not found:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"aiperf exited with {done.returncode} for {name} (log: {log}):\n{tail}")
    raw = json.loads(found[0].read_text())
    result = {**summarize(raw), "aiperf_seconds": time.perf_counter() - start, "artifacts": str(found[0].parent),
              "aiperf_summary": raw}
    print(f"  {name}: {result['output_tok_s'] or float('nan'):.1f} tok/s, TTFT p50 "
          f"{result['ttft_p50_ms'] or float('nan'):.0f} ms, ITL p50 {result['itl_p50_ms'] or float('nan'):.1f} ms, "
          f"{result['completed_request_count'] or 0:.0f} requests completed, "
          f"{result['usage_completion_tokens_avg'] or 0:.0f} tokens each, {result['request_error_rate_pct']:.0f} % "
          f"errors", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aiperf", type=Path, required=True, help="the aiperf executable (bench_aiperf.sh sets it)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--request-count", type=int, default=16)
    parser.add_argument("--synthetic-input-tokens-mean", type=int, default=128)
    parser.add_argument("--output-tokens-mean", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--vllm-omp-threads-bind", default="auto", help="as in bench_serving.py")
    parser.add_argument("--skip", nargs="*", default=[], choices=SERVERS)
    parser.add_argument("--results-dir", type=Path, default=serving.RESULTS,
                        help="where aiperf.json goes (smoke runs: somewhere under /tmp)")
    args = parser.parse_args(argv)
    serving.stop_on_sigterm()
    cpu = serving.cpu_info()
    if args.dtype == "bfloat16" and not cpu["avx512_bf16"]:
        parser.error("--dtype bfloat16 needs a CPU with avx512_bf16")
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, avx512_bf16: {'yes' if cpu['avx512_bf16'] else 'no'}; "
          f"dtype {args.dtype}, max_model_len {args.max_model_len}", flush=True)
    serving.BENCH_CACHE.mkdir(parents=True, exist_ok=True)
    results = {"setting": {"endpoint_type": "chat", "streaming": True, "concurrency": args.concurrency,
                           "request_count": args.request_count,
                           "synthetic_input_tokens_mean": args.synthetic_input_tokens_mean,
                           "output_tokens_mean": args.output_tokens_mean, "extra_inputs": {"ignore_eos": True},
                           "aiperf": "0.13.0"},
               "dtype": args.dtype, "max_model_len": args.max_model_len, "cpu": cpu,
               "machine": f"{platform.machine()} {os.cpu_count()} cores", "load_average_at_start": os.getloadavg(),
               "servers": {}, "skipped": {name: "--skip" for name in args.skip}}
    started = time.perf_counter()
    for name in SERVERS:
        if name in args.skip:
            continue
        print(f"starting {name} ...", flush=True)
        if name == "front_door":
            server = serving.OmniServers(args.dtype, args.max_model_len)
            model, url = "omni_chat", lambda: server.base_url
        else:
            server = serving.VllmServer(args.dtype, args.max_model_len, args.vllm_omp_threads_bind)
            model, url = serving.VllmServer.MODEL_NAME, lambda: server.base_url
        try:
            server.start()
            results["servers"][name] = run_aiperf(args.aiperf, args, name, model, url())
        except Exception as exc:
            if name == "front_door":
                raise
            results["skipped"][name] = f"{type(exc).__name__}: {exc}"
            print(f"  skipped {name}: {exc}", flush=True)
        finally:
            server.stop()
    ours, vllm = results["servers"].get("front_door"), results["servers"].get("vllm")
    results["ratios"] = {}
    if ours and vllm:
        for key, label in (("output_tok_s", "front_door/vllm output tok/s"),
                           ("ttft_p50_ms", "front_door/vllm TTFT p50"), ("itl_p50_ms", "front_door/vllm ITL p50")):
            if ours[key] and vllm[key]:
                results["ratios"][label] = ours[key] / vllm[key]
    for key, value in results["ratios"].items():
        print(f"{key}: {value:.2f}x")
    results["seconds"] = time.perf_counter() - started
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "aiperf.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.results_dir / 'aiperf.json'} in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
