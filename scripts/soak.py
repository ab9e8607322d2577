"""Soak test: the whole stack under mixed traffic for N minutes; errors by kind and every process's RSS growth.

Started by `scripts/soak.sh` (after setup). It starts tritonserver on the rendered repository and the OpenAI front
door beside it, as `scripts/serve.sh` does, on free ports; runs a warm-up, takes an RSS snapshot of every process
(tritonserver, each triton_python_backend_stub labelled by its model, the front door), then runs `--minutes` of
traffic at `--concurrency` (8) of mixed requests:

    chat        non-streamed chat completion
    stream      streamed chat completion, read to [DONE]
    cancel      streamed chat completion whose connection is closed after a random number of events (0-8)
    completion  non-streamed text completion

and a second snapshot when the last request is done. It also checks that the llm stage's KV blocks go back to 0
once the traffic stops (a leak would keep them). Results go to benchmarks/results/soak.json.

Exit code: 0 when there were no errors (warm-up included) and no process grew its RSS by 5 % or more; 1
otherwise; 2 when the stack did not start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import aiohttp

from omni_backend import paths
from omni_backend.ops.metrics import parse_metrics
from omni_backend.serving.config import ServingConfig
from omni_backend.launch.front_door import FrontDoorProcess
from omni_backend.launch.tritonserver import TritonServer, TritonServerError
from omni_backend.launch.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent
MODEL = "omni_chat"
RSS_GROWTH_LIMIT_PCT = 5.0
REQUEST_TIMEOUT_S = 180.0
"""Seconds one request may take before it counts as a `timeout` error."""

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colours.",
           "Explain what a CPU does in one sentence.", "Tell me a short story about a cat.",
           "Translate 'good morning' into Spanish.", "What is 12 times 12?", "List two uses of copper."]
KINDS = {"chat": 3, "stream": 3, "cancel": 2, "completion": 2}
"""Request kinds and their relative weights."""


# ---------------------------------------------------------------------------------------------------------
# Processes and their memory


def rss_kib(pid: int) -> int | None:
    """VmRSS of a process in KiB (from /proc/<pid>/status), None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    """Direct children of `pid` (from the parent ids in /proc/*/stat)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def stub_label(pid: int) -> str | None:
    """`stub:<model>` for a triton_python_backend_stub (its first argument is <repo>/<model>/<version>/model.py)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            args = cmdline.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    if not args or not args[0].endswith("triton_python_backend_stub") or len(args) < 2:
        return None
    model_py = Path(args[1])
    return f"stub:{model_py.parent.parent.name}"


def processes(triton_pid: int, front_door_pid: int) -> dict[str, int]:
    """label -> pid for tritonserver, each of its stubs (a second instance of a model gets `#2`), the front door."""
    found = {"tritonserver": triton_pid, "front_door": front_door_pid}
    for pid in sorted(children(triton_pid)):
        label = stub_label(pid)
        if label is None:
            continue
        unique, n = label, 1
        while unique in found:
            n += 1
            unique = f"{label}#{n}"
        found[unique] = pid
    return found


def snapshot(pids: dict[str, int]) -> dict[str, int | None]:
    """label -> VmRSS in KiB now (None for a process that has exited)."""
    return {label: rss_kib(pid) for label, pid in pids.items()}


class QuietFrontDoor(FrontDoorProcess):
    """The front door without uvicorn's access log line per request (its errors still show)."""

    def command(self) -> list[str]:
        return super().command() + ["--log-level", "warning"]


# ---------------------------------------------------------------------------------------------------------
# Traffic


class Tally:
    """Requests sent and errors by kind ("<request kind>:<what went wrong>"), with a few examples of each."""

    def __init__(self):
        self.sent: Counter = Counter()
        self.errors: Counter = Counter()
        self.examples: dict[str, str] = {}

    def error(self, kind: str, what: str, detail: str) -> None:
        key = f"{kind}:{what}"
        self.errors[key] += 1
        self.examples.setdefault(key, detail[:300])


def request_body(kind: str, rng: random.Random) -> tuple[str, dict]:
    """(path, JSON body) of one request of `kind`."""
    prompt = rng.choice(PROMPTS)
    sampling = {"temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randrange(2**31),
                "max_tokens": rng.randint(8, 48)}
    if kind == "completion":
        return "/v1/completions", {"model": MODEL, "prompt": prompt, **sampling}
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], **sampling}
    if kind in ("stream", "cancel"):
        body["stream"] = True
        if kind == "cancel":
            body["max_tokens"] = 128
    return "/v1/chat/completions", body


async def one_request(session: aiohttp.ClientSession, url: str, kind: str, rng: random.Random, tally: Tally) -> None:
    """Send one request of `kind` and record what went wrong, if anything."""
    path, body = request_body(kind, rng)
    tally.sent[kind] += 1
    try:
        async with session.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as response:
            if response.status != 200:
                tally.error(kind, f"status_{response.status}", await response.text())
                return
            if kind in ("chat", "completion"):
                answer = await response.json()
                choice = answer["choices"][0]
                text = choice["message"]["content"] if kind == "chat" else choice["text"]
                if choice["finish_reason"] not in ("stop", "length") or not isinstance(text, str):
                    tally.error(kind, "bad_answer", json.dumps(answer))
                return
            stop_after = rng.randint(0, 8) if kind == "cancel" else None
            events = 0
            async for raw in response.content:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return
                if "error" in json.loads(data):
                    tally.error(kind, "stream_error_event", data)
                    return
                events += 1
                if stop_after is not None and events > stop_after:
                    response.close()  # the client goes away mid-stream
                    return
            if kind == "stream":
                tally.error(kind, "no_done", f"stream ended after {events} events without [DONE]")
    except asyncio.TimeoutError:
        tally.error(kind, "timeout", f"no complete answer within {REQUEST_TIMEOUT_S:.0f} s")
    except (aiohttp.ClientError, ValueError, KeyError) as exc:
        tally.error(kind, type(exc).__name__, repr(exc))


async def traffic(url: str, seconds: float, concurrency: int, seed: int, tally: Tally,
                  mix: dict[str, int] = KINDS) -> None:
    """`concurrency` workers, each sending one request after another until `seconds` have passed; each request's
    kind drawn with the relative weights of `mix`."""
    deadline = time.monotonic() + seconds
    kinds, weights = list(mix), list(mix.values())

    async def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                await one_request(session, url, rng.choices(kinds, weights)[0], rng, tally)

    await asyncio.gather(*(worker(i) for i in range(concurrency)))


def kv_blocks_used(metrics_url: str) -> float | None:
    """The llm stage's omni_kv_cache_blocks_used gauge (None when the page or the gauge is missing)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            samples = parse_metrics(response.read().decode())
    except OSError:
        return None
    values = [v for labels, v in samples.get("omni_kv_cache_blocks_used", []) if labels.get("model") == "llm"]
    return values[0] if values else None


def wait_kv_free(metrics_url: str, timeout_s: float = 15.0) -> float | None:
    """Poll until the KV blocks in use are 0 (the gauge is published about once a second); the last value."""
    deadline = time.monotonic() + timeout_s
    value = kv_blocks_used(metrics_url)
    while value != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        value = kv_blocks_used(metrics_url)
    return value


# ---------------------------------------------------------------------------------------------------------
# The run


def growth_report(start: dict, end: dict) -> dict:
    """label -> {start_kib, end_kib, growth_pct} (growth None for a process missing at either end)."""
    report = {}
    for label, before in start.items():
        after = end.get(label)
        growth = None if not before or after is None else round(100.0 * (after - before) / before, 2)
        report[label] = {"start_kib": before, "end_kib": after, "growth_pct": growth}
    return report


def run(args) -> int:
    http, grpc, metrics, openai = free_ports(4)
    repository = Path(args.model_repository)
    log_file = ROOT / ".cache" / "soak" / "tritonserver.log"
    server = TritonServer(repository, http_port=http, grpc_port=grpc, metrics_port=metrics, exit_timeout_s=10,
                          log_file=log_file)
    config = ServingConfig.from_env()
    config.port, config.host = openai, "127.0.0.1"
    config.triton_grpc, config.triton_http = f"localhost:{grpc}", f"localhost:{http}"
    config.triton_metrics_url = server.metrics_url
    front_door = QuietFrontDoor(config)
    url = f"http://127.0.0.1:{openai}"
    tally = Tally()
    started = time.time()
    try:
        print(f"[soak] starting tritonserver on {repository} (log {log_file})", flush=True)
        try:
            server.start(ready_timeout_s=600)
            front_door.start()
        except (TritonServerError, RuntimeError, FileNotFoundError) as exc:
            print(f"[soak] the stack did not start: {exc}", file=sys.stderr)
            return 2
        pids = processes(server.process.pid, front_door.process.pid)
        print(f"[soak] up: {len(pids)} processes; warm-up {args.warmup_minutes} min at concurrency "
              f"{args.concurrency}", flush=True)
        warmup = Tally()
        asyncio.run(traffic(url, args.warmup_minutes * 60, args.concurrency, args.seed + 1, warmup, args.mix))
        wait_kv_free(server.metrics_url)
        start_rss = snapshot(pids)
        timeline = [{"t_s": 0.0, "rss_kib": start_rss}]
        print(f"[soak] warm-up done ({sum(warmup.sent.values())} requests, errors {dict(warmup.errors)}); "
              f"running {args.minutes} min", flush=True)

        async def measured() -> None:
            began = time.monotonic()
            load = asyncio.ensure_future(traffic(url, args.minutes * 60, args.concurrency, args.seed, tally,
                                                 args.mix))
            while not load.done():
                await asyncio.wait({load}, timeout=args.sample_s)
                if not load.done():
                    timeline.append({"t_s": round(time.monotonic() - began, 1), "rss_kib": snapshot(pids)})
                    done = sum(tally.sent.values())
                    print(f"[soak] {timeline[-1]['t_s']:.0f} s: {done} requests, {sum(tally.errors.values())} "
                          f"errors", flush=True)
            await load

        began = time.monotonic()
        asyncio.run(measured())
        elapsed = time.monotonic() - began
        kv_after = wait_kv_free(server.metrics_url)
        if kv_after != 0:
            tally.error("after", "kv_blocks_not_freed", f"omni_kv_cache_blocks_used = {kv_after} once idle")
        if server.process is None or server.process.poll() is not None:
            tally.error("after", "tritonserver_exited", "tritonserver is not running")
        end_rss = snapshot(pids)
        timeline.append({"t_s": round(elapsed, 1), "rss_kib": end_rss})
    finally:
        front_door.stop()
        server.stop()

    rss = growth_report(start_rss, end_rss)
    grown = {label: r["growth_pct"] for label, r in rss.items()
             if r["growth_pct"] is None or r["growth_pct"] >= RSS_GROWTH_LIMIT_PCT}
    for key, count in warmup.errors.items():  # an error is an error, warm-up or not
        tally.errors[f"warmup:{key}"] += count
        tally.examples.setdefault(f"warmup:{key}", warmup.examples[key])
    errors = sum(tally.errors.values())
    result = {
        "started_unix": int(started), "kinds": args.mix, "minutes": args.minutes, "warmup_minutes": args.warmup_minutes,
        "measured_s": round(elapsed, 1), "concurrency": args.concurrency, "seed": args.seed,
        "requests": dict(tally.sent), "requests_total": sum(tally.sent.values()),
        "requests_per_s": round(sum(tally.sent.values()) / elapsed, 2),
        "errors": dict(tally.errors), "errors_total": errors, "error_examples": tally.examples,
        "kv_blocks_used_after": kv_after, "rss": rss, "rss_growth_limit_pct": RSS_GROWTH_LIMIT_PCT,
        "rss_over_limit": grown, "timeline": timeline, "passed": errors == 0 and not grown,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"\n[soak] {result['requests_total']} requests in {elapsed:.0f} s ({result['requests_per_s']}/s): "
          f"{dict(tally.sent)}")
    print(f"[soak] errors: {errors}" + "".join(f"\n  {k}: {v}  e.g. {tally.examples[k]}" for k, v in
                                             sorted(tally.errors.items())))
    print(f"[soak] KV blocks in use once idle: {kv_after}")
    print(f"[soak] RSS (KiB) after warm-up -> end, growth (limit {RSS_GROWTH_LIMIT_PCT} %):")
    for label, r in rss.items():
        print(f"  {label:24s} {r['start_kib']!s:>9} -> {r['end_kib']!s:>9}  {r['growth_pct']!s:>6} %")
    print(f"[soak] {'PASSED' if result['passed'] else 'FAILED'}; results in {out}")
    return 0 if result["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/soak.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="measured traffic, after the warm-up")
    parser.add_argument("--warmup-minutes", type=float, default=1.0,
                        help="traffic before the first RSS snapshot (caches, allocator arenas, lazy imports)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sample-s", type=float, default=30.0, help="seconds between RSS samples in the timeline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated request kinds to send (of {', '.join(KINDS)}), e.g. to find which "
                             "one makes a process grow")
    parser.add_argument("--model-repository", default=str(paths.rendered_repository_dir()))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    args = parser.parse_args(argv)
    unknown = set(args.kinds.split(",")) - set(KINDS)
    if unknown:
        parser.error(f"unknown request kinds: {', '.join(sorted(unknown))}")
    args.mix = {kind: KINDS[kind] for kind in args.kinds.split(",")}
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
