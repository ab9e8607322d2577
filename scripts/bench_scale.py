#!/usr/bin/env python3
"""Scale-out benchmark: our engine as NVIDIA Dynamo workers behind Dynamo's frontend, KV-aware routing against
round-robin over the same two workers and against one worker; and the Dynamo frontend's overhead against our own
OpenAI front door, in interleaved rounds.

Processes, all on this machine and started once (workers and servers stay up for every round):
  etcd, nats-server  Dynamo's discovery and event servers (Debian's etcd-server and nats-server), on free ports;
  pair_0, pair_1     two of our workers (`python -m omni_backend.launch.dynamo`) in the Dynamo namespace `pair`;
  single             one more worker, alone in the namespace `single`;
  kv, round_robin    two Dynamo frontends (`python -m dynamo.frontend`) over `pair`: --router-mode kv and
                     --router-mode round-robin, so both route to the very same two workers;
  dynamo_single      a Dynamo frontend over `single` (--router-mode kv; with one worker the mode picks nothing);
  front_door         tritonserver (omni_chat) with our OpenAI front door (`scripts/serve.sh`'s stack).
Every engine has the same settings (SmolLM2-135M-Instruct, `--dtype`, `--max-model-len`, 32 sequences per step,
512 MiB of KV cache (about 11,600 tokens), the default one CPU thread on a 2-core machine, prefix caching on).

Workloads (streamed chat completions, greedy, EOS ignored, `--new-tokens` tokens per request):
  prefix     `--prompts` distinct system prompts of about `--system-tokens` tokens each (the store manual of
             scripts/bench_prefix.py, each from another section, opened by its own store name), `--requests`
             requests spread evenly over them with differing user questions, in a seeded random order, from
             `--concurrency` client threads; run through kv, round_robin and dynamo_single. Every (route, round)
             run starts cold: a fresh salt sentence opens each system prompt, so nothing cached before matches.
  overhead   bench_serving.py's short chat questions, `--overhead-requests` requests at concurrency 8 and
             `--overhead-new-tokens` tokens each, through dynamo_single and front_door (the same engine settings).
Per run: TTFT p50/p95/p99 (send -> first text), output tok/s (generated tokens / wall time), and prompt and cached
tokens summed from each response's `usage` (`prompt_tokens_details.cached_tokens`: the prompt tokens the serving
engine's prefix cache supplied, as our worker reports them to Dynamo). Prefix hit rate = cached / prompt tokens.
Per route the report is the median over the rounds of each number; the JSON keeps every round. Ratios (targets of
issue 29): hit rate kv / dynamo_single (>= 0.9), TTFT p50 round_robin / kv (>= 2), output tok/s dynamo_single /
front_door (>= 0.9: the frontend costs at most 10 %). The routes' order rotates from round to round.
Each overhead run also records where the CPU went (`cpu_cores`: CPU seconds per wall second of the frontend's and
the engine process's trees, of the client's threads and of the whole machine from /proc/stat; `cpu_ms_per_token`:
the frontend's and the engine process's CPU milliseconds per generated token, which do not depend on the share of
the cores a loaded machine leaves the run; `runqueue_wait_cores`: how long their threads were ready but waited for
a core, that share's other side). `--overhead-only` starts only what that workload needs (one worker,
its frontend, our front door) and writes scale_overhead.json instead, leaving scale.json as it is.

On a 2-core machine the two workers of a pair share the two cores with each other, the frontends and the client:
routing can only move prefill work between workers that compete for the same cores, so the TTFT ratio here says
more about how much prefill each route avoids than about a cluster where each worker has its own GPU.
Writes scale.json and scale.png into --results-dir (default benchmarks/results).

Usage (after scripts/setup.sh --dynamo: etcd, NATS, the worker runtime in .venv, the frontend's venv):
       PYTHONPATH=$PWD .venv/bin/python scripts/bench_scale.py [--rounds 2] [--requests 64] [--prompts 8]
           [--system-tokens 1000] [--new-tokens 16] [--concurrency 8] [--skip-overhead | --overhead-only]
           [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_prefix as prefix  # noqa: E402  (the manual the system prompts are cut from, salts)
import bench_serving as serving  # noqa: E402  (client, percentiles, CPU facts, process handling, our servers)

from omni_backend.launch.dynamo.control_plane import (  # noqa: E402
    etcd_command,
    nats_command,
    wait_etcd_and_nats,
)
from omni_backend.launch.dynamo.local import find_binary, frontend_python, system_ports  # noqa: E402
from omni_backend.launch.ports import free_ports  # noqa: E402

ROUTES = ("kv", "round_robin", "dynamo_single")
OVERHEAD = ("dynamo_single", "front_door")
SCALE_CACHE = serving.BENCH_CACHE / "scale"
MAX_NUM_SEQS = serving.MAX_NUM_SEQS
KV_CACHE_BYTES = 512 << 20  # every engine's, the workers' as bench_serving.OmniServers gives tritonserver's
TARGETS = {"hit rate kv/dynamo_single": (">=", 0.9), "TTFT p50 round_robin/kv": (">=", 2.0),
           "output tok/s dynamo_single/front_door c8": (">=", 0.9)}


# --- processes -----------------------------------------------------------------------------------------------------


class Process:
    """One started program: its log under .cache/bench/scale/, its process group stopped by `stop`."""

    def __init__(self, name: str, command: list[str], env: dict[str, str] | None = None):
        self.name, self.command = name, command
        self.log = SCALE_CACHE / f"{name}.log"
        with open(self.log, "w") as handle:
            self.process = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=serving.die_with_parent)

    def wait_http(self, url: str, timeout_s: float) -> None:
        """Until `url` answers 200; RuntimeError (naming the log) when the program exits or time runs out."""
        serving.wait_http(url, self.process, timeout_s, self.name, self.log)

    def check_running(self) -> None:
        """RuntimeError (naming the log) when the program has exited."""
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with code {self.process.returncode} (log: {self.log})")

    def stop(self) -> None:
        serving.stop_process(self.process)


def wait_model(base_url: str, process: Process, timeout_s: float) -> str:
    """The first model id a Dynamo frontend lists once its workers are discovered (`/v1/models` non-empty)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/v1/models", timeout=2) as response:
                models = json.loads(response.read())["data"]
            if models:
                return models[0]["id"]
        except OSError:
            pass
        if process.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{process.name} listed no model within {timeout_s:.0f} s (log: {process.log})")
        time.sleep(0.5)


class DynamoStack:
    """etcd, NATS, the three workers and the three Dynamo frontends of the module docstring.

    `routes[name]` is (base_url, model id) of frontend `name`; `pids()` the root processes (for idle waits and
    CPU accounting). `args.worker_python` runs the workers (it imports omni_backend and ai-dynamo-runtime),
    `args.frontend_python` the frontends (ai-dynamo).
    """

    def __init__(self, args):
        self.args = args
        self.processes: list[Process] = []
        self.routes: dict[str, tuple[str, str]] = {}

    def start(self) -> DynamoStack:
        """Start everything and warm every route up; stops what it started when something fails."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> DynamoStack:
        etcd_client, etcd_peer, nats = free_ports(3)
        data = SCALE_CACHE / "etcd-data"
        shutil.rmtree(data, ignore_errors=True)  # no registration of an earlier run survives
        control = [self._spawn("etcd", etcd_command(find_binary("etcd"), data, etcd_client, etcd_peer, "bench")),
                   self._spawn("nats", nats_command(find_binary("nats-server"), SCALE_CACHE / "nats-data", nats))]
        wait_etcd_and_nats(etcd_client, nats, 60, lambda: [process.check_running() for process in control])
        dynamo_env = {**os.environ, "ETCD_ENDPOINTS": f"http://127.0.0.1:{etcd_client}",
                      "NATS_SERVER": f"nats://127.0.0.1:{nats}", "HF_HUB_OFFLINE": "1", "DYN_LOG": "warn"}
        workers = []
        names = (("single", "single"),) if self.args.overhead_only else \
            (("pair_0", "pair"), ("pair_1", "pair"), ("single", "single"))
        for (name, namespace), system_port in zip(names, system_ports(len(names))):
            env = {**dynamo_env, "DYN_SYSTEM_ENABLED": "true", "DYN_SYSTEM_PORT": str(system_port)}
            command = [self.args.worker_python, "-m", "omni_backend.launch.dynamo", "--model", str(serving.MODEL),
                       "--served-model-name", "smollm2", "--namespace", namespace]
            for setting, value in self.engine_settings().items():
                command += ["--setting", f"{setting}={value}"]
            workers.append((self._spawn(f"worker_{name}", command, env), system_port))
        for worker, system_port in workers:  # one at a time: each builds its engine (and C++ kernels) first
            worker.wait_http(f"http://127.0.0.1:{system_port}/health", 600)
        frontends = (("kv", "pair", "kv"), ("round_robin", "pair", "round-robin"), ("dynamo_single", "single", "kv"))
        for route, namespace, mode in frontends[2:] if self.args.overhead_only else frontends:
            (port,) = free_ports(1)
            frontend = self._spawn(f"frontend_{route}", [
                self.args.frontend_python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                "--http-port", str(port), "--router-mode", mode, "--namespace", namespace], dynamo_env)
            base_url = f"http://127.0.0.1:{port}"
            model = wait_model(base_url, frontend, 180)
            serving.openai_chat_request(base_url, model, "Hi", 4)  # warm-up
            self.routes[route] = (base_url, model)
        return self

    def engine_settings(self) -> dict[str, object]:
        """The engine settings every worker gets (operator names, as the llm stage's)."""
        return {"dtype": self.args.dtype, "max_num_seqs": MAX_NUM_SEQS, "max_model_len": self.args.max_model_len,
                "kv_cache_bytes": KV_CACHE_BYTES, "enable_prefix_caching": "true"}

    def _spawn(self, name: str, command: list[str], env: dict[str, str] | None = None) -> Process:
        process = Process(name, command, env)
        self.processes.append(process)
        return process

    def pids(self) -> list[int]:
        return [p.process.pid for p in self.processes]

    def pid(self, name: str) -> int:
        """The process id of the started program `name` (e.g. "frontend_dynamo_single", "worker_single")."""
        return next(p.process.pid for p in self.processes if p.name == name)

    def stop(self) -> None:
        """Frontends first, then the workers, then NATS and etcd."""
        for process in reversed(self.processes):
            process.stop()


# --- the workload --------------------------------------------------------------------------------------------------


def system_prompts(tokenizer, args) -> list[str]:
    """`args.prompts` distinct system prompts of about `args.system_tokens` tokens (unsalted)."""
    return [prefix.system_prompt(tokenizer, args.system_tokens, first_section=i,
                                 opening=f"You work at store number {101 + i} of the chain.")
            for i in range(args.prompts)]


def prefix_requests(prompts: list[str], args, seed: int) -> list[list[dict]]:
    """One run's requests (chat messages): every prompt salted afresh, `args.requests` requests spread evenly
    over the prompts, each with another question, shuffled with `seed` (users do not arrive in prompt order; a
    fixed order would let round-robin's alternation line up with the prompts)."""
    salted = [prefix.with_salt(prefix.salt(), text) for text in prompts]
    requests = [[{"role": "system", "content": salted[i % len(salted)]},
                 {"role": "user", "content": prefix.QUESTIONS[(i // len(salted)) % len(prefix.QUESTIONS)]}]
                for i in range(args.requests)]
    random.Random(seed).shuffle(requests)
    return requests


def run_prefix(base_url: str, model: str, requests: list[list[dict]], args) -> dict:
    """Send `requests` from `args.concurrency` threads; bench_serving.summarize's summary plus the prompt and
    cached tokens summed over the answers' usage, and the hit rate (cached / prompt tokens)."""
    records: list[dict] = []
    errors: list[str] = []

    def send(messages):
        try:
            result = serving.openai_chat(base_url, model, messages, args.new_tokens)
        except Exception as exc:  # recorded and reported
            errors.append(f"{type(exc).__name__}: {exc}")
            return
        usage = result["usage"]
        records.append({**result, "prompt_tokens": int(usage.get("prompt_tokens") or 0),
                        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")})

    seconds = serving.run_workers(requests, args.concurrency, send)
    summary = serving.summarize(records, seconds, args.concurrency, errors)
    reported = [r["cached_tokens"] for r in records if r["cached_tokens"] is not None]
    prompt = sum(r["prompt_tokens"] for r in records)
    summary.update({"prompt_tokens_total": prompt, "cached_tokens_total": sum(reported) if reported else None,
                    "cached_tokens_reported": len(reported),
                    "hit_rate": sum(reported) / prompt if reported and prompt else None})
    return summary


def run_overhead(send, questions: list[str], sides: dict[str, list[int]]) -> dict:
    """bench_serving.run_level at concurrency 8, plus where the CPU went during the run: `cpu_cores[side]` = CPU
    seconds of the process trees under `sides[side]` / wall seconds (1.0 = one core busy), the same for the
    benchmark's own client threads (`client`) and for the whole machine (`machine`, from /proc/stat: every
    process, other sessions' included); `cpu_ms_per_token[side]` = CPU milliseconds per generated token;
    `runqueue_wait_cores[side]` = seconds its threads were ready to run but waited for a core, per wall second."""
    before = {side: serving.cpu_seconds(roots) for side, roots in sides.items()}
    waited = {side: runqueue_wait_seconds(roots) for side, roots in sides.items()}
    client, machine = time.process_time(), busy_cpu_seconds()
    run = serving.run_level(send, questions, 8)
    used = {side: serving.cpu_seconds(roots) - before[side] for side, roots in sides.items()}
    run["runqueue_wait_cores"] = {side: (runqueue_wait_seconds(roots) - waited[side]) / run["seconds"]
                                  for side, roots in sides.items()}
    run["cpu_cores"] = {**{side: cpu / run["seconds"] for side, cpu in used.items()},
                        "client": (time.process_time() - client) / run["seconds"],
                        "machine": (busy_cpu_seconds() - machine) / run["seconds"]}
    run["cpu_ms_per_token"] = {side: 1000 * cpu / max(1, run["generated_tokens"]) for side, cpu in used.items()}
    return run


def runqueue_wait_seconds(roots: list[int]) -> float:
    """Seconds the live threads of the process trees under `roots` spent runnable but waiting for a core (the
    second field of /proc/PID/task/TID/schedstat, in ns)."""
    total = 0
    for pid in serving.process_tree(roots):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as handle:
                    total += int(handle.read().split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return total / 1e9


def busy_cpu_seconds() -> float:
    """CPU seconds all cores spent not idle since boot (/proc/stat's first line: all but idle and iowait)."""
    with open("/proc/stat") as handle:
        ticks = [int(x) for x in handle.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def median_run(rounds: list[dict]) -> dict:
    """bench_serving.median_level plus the medians of the token totals and the hit rate."""
    out = serving.median_level(rounds)
    for key in ("prompt_tokens_total", "cached_tokens_total", "hit_rate"):
        values = [r[key] for r in rounds if r.get(key) is not None]
        out[key] = float(statistics.median(values)) if values else None
    return out


# --- the report ----------------------------------------------------------------------------------------------------


def ratio(num: dict | None, den: dict | None, get) -> tuple[float | None, list]:
    """get(num) / get(den) of the medians and of each round (None where either side is missing or had errors)."""
    if not num or not den or num["errors"] or den["errors"]:
        return None, []

    def divide(a, b):
        x, y = get(a), get(b)
        return x / y if x is not None and y else None
    return divide(num, den), [divide(a, b) for a, b in zip(num["rounds"], den["rounds"])]


def ratios(results: dict) -> tuple[dict, dict]:
    """The three ratios of TARGETS, of the medians and per round."""
    routes, overhead = results["prefix"], results["overhead"]
    found = {
        "hit rate kv/dynamo_single": ratio(routes.get("kv"), routes.get("dynamo_single"), lambda r: r["hit_rate"]),
        "TTFT p50 round_robin/kv": ratio(routes.get("round_robin"), routes.get("kv"),
                                         lambda r: r["ttft_s"].get("p50")),
        "hit rate round_robin/dynamo_single": ratio(routes.get("round_robin"), routes.get("dynamo_single"),
                                                    lambda r: r["hit_rate"]),
        "output tok/s dynamo_single/front_door c8": ratio(overhead.get("dynamo_single"), overhead.get("front_door"),
                                                          lambda r: r["output_tok_s"]),
    }
    return ({k: v for k, (v, _) in found.items() if v is not None},
            {k: each for k, (v, each) in found.items() if v is not None})


def line(name: str, run: dict) -> str:
    """One run (or median) as a text line."""
    def num(value, fmt):
        return "-" if value is None else format(value, fmt)
    ttft = run["ttft_s"]
    return (f"  {name:14s} {run['completed']:4d} req  TTFT p50/p99 {num(ttft.get('p50'), '.3f')}/"
            f"{num(ttft.get('p99'), '.3f')} s  {run['output_tok_s']:6.1f} tok/s"
            + (f"  prompt {run['prompt_tokens_total']:.0f} tok, cached {num(run['cached_tokens_total'], '.0f')},"
               f" hit rate {num(run['hit_rate'], '.3f')}" if "hit_rate" in run else "")
            + (" CPU cores " + ", ".join(f"{side} {cores:.2f}" for side, cores in run["cpu_cores"].items())
               + ", waiting for a core " + ", ".join(f"{side} {cores:.2f}"
                                                     for side, cores in run["runqueue_wait_cores"].items())
               if "cpu_cores" in run else "")
            + (f"  errors: {run['errors']}" if run["errors"] else ""))


LABELS = {"kv": "Dynamo, KV routing, 2 workers", "round_robin": "Dynamo, round-robin, 2 workers",
          "dynamo_single": "Dynamo, 1 worker", "front_door": "our front door (tritonserver)"}
COLORS = {"kv": "#2a7", "round_robin": "#c73", "dynamo_single": "#27a", "front_door": "#999"}


def plot(results: dict, path: Path) -> None:
    """Three panels of bars, medians with a dot per round: the prefix workload's hit rate and TTFT p50 per route,
    and the overhead workload's output tok/s per server."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    panels = ((axes[0], results["prefix"], "hit_rate", "prefix hit rate (cached / prompt tokens)"),
              (axes[1], results["prefix"], "ttft_p50", "TTFT p50, s (lower is better)"),
              (axes[2], results["overhead"], "output_tok_s", "overhead workload: output tok/s at c=8"))
    for ax, runs, key, title in panels:
        get = (lambda r: r["ttft_s"].get("p50")) if key == "ttft_p50" else (lambda r, k=key: r.get(k))
        names = list(runs)
        values = [get(runs[n]) for n in names]
        ax.bar(range(len(names)), [v if v is not None else float("nan") for v in values],
               color=[COLORS[n] for n in names])
        for i, name in enumerate(names):
            each = [get(r) for r in runs[name]["rounds"]]
            ax.plot([i] * len(each), [v if v is not None else float("nan") for v in each], ".", color="black")
        ax.set_xticks(range(len(names)), [LABELS[n].replace(", ", ",\n") for n in names], fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    cpu, load = results["cpu"], results["workload"]
    fig.suptitle(f"SmolLM2-135M, {results['dtype']}; prefix: {load['prompts']} system prompts of ~"
                 f"{load['system_tokens']} tokens x {load['requests']} requests, concurrency {load['concurrency']},"
                 f" {load['new_tokens']} new tokens\nmedian of {results['rounds']} rounds (dots: each round); "
                 f"{cpu['model']}, {cpu['cores']} cores, shared machine (load {results['load_average_at_start'][0]:.1f}"
                 f" at start)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- main ----------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every route (median)")
    parser.add_argument("--prompts", type=int, default=8, help="distinct long system prompts")
    parser.add_argument("--system-tokens", type=int, default=1000, help="tokens of each system prompt")
    parser.add_argument("--requests", type=int, default=64, help="prefix workload: requests per run")
    parser.add_argument("--concurrency", type=int, default=8, help="prefix workload: client threads")
    parser.add_argument("--new-tokens", type=int, default=16, help="prefix workload: tokens per request")
    parser.add_argument("--overhead-requests", type=int, default=32, help="overhead workload: requests per run")
    parser.add_argument("--overhead-new-tokens", type=int, default=64, help="overhead workload: tokens per request")
    parser.add_argument("--skip-overhead", action="store_true", help="no front door, no overhead workload")
    parser.add_argument("--overhead-only", action="store_true",
                        help="only the overhead workload: one worker, its frontend and our front door")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="every engine's dtype")
    parser.add_argument("--max-model-len", type=int, default=2048, help="tokens, every engine")
    parser.add_argument("--worker-python", default=sys.executable,
                        help="the Python that runs our workers (imports omni_backend and ai-dynamo-runtime)")
    parser.add_argument("--frontend-python", default=str(frontend_python()),
                        help="the Python that runs Dynamo's frontend (imports ai-dynamo; default: the venv "
                             "scripts/setup.sh --dynamo makes)")
    parser.add_argument("--results-dir", type=Path, default=serving.RESULTS,
                        help="where scale.json and scale.png go (smoke runs: somewhere under /tmp)")
    args = parser.parse_args(argv)
    if min(args.rounds, args.prompts, args.requests, args.concurrency, args.overhead_requests) < 1:
        parser.error("--rounds, --prompts, --requests, --concurrency and --overhead-requests must be at least 1")
    if args.overhead_only and args.skip_overhead:
        parser.error("--overhead-only and --skip-overhead exclude each other")
    try:
        for program in ("etcd", "nats-server"):
            find_binary(program)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    serving.stop_on_sigterm()
    cpu = serving.cpu_info()
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, avx2: {cpu['avx2']}, avx512_bf16: {cpu['avx512_bf16']}, "
          f"amx_bf16: {cpu['amx_bf16']}; load average {os.getloadavg()}", flush=True)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(serving.MODEL)
    prompts = system_prompts(tokenizer, args)
    measured = [len(tokenizer(prefix.with_salt(prefix.salt(), text)).input_ids) for text in prompts]
    print(f"system prompts (tokens, with a salt): {min(measured)}-{max(measured)}", flush=True)
    SCALE_CACHE.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = {"workload": {"prompts": args.prompts, "system_tokens": args.system_tokens,
                            "system_prompt_tokens_measured": measured, "requests": args.requests,
                            "concurrency": args.concurrency, "new_tokens": args.new_tokens,
                            "overhead_requests": args.overhead_requests, "overhead_concurrency": 8,
                            "overhead_new_tokens": args.overhead_new_tokens, "ignore_eos": True, "temperature": 0.0,
                            "order": "requests spread evenly over the prompts, shuffled per run (seed = round)",
                            "cached_tokens_source": "usage.prompt_tokens_details.cached_tokens of each answer"},
               "dtype": args.dtype, "max_model_len": args.max_model_len, "max_num_seqs": MAX_NUM_SEQS,
               "kv_cache_bytes": KV_CACHE_BYTES, "cpu": cpu, "machine": f"{platform.machine()} {os.cpu_count()} cores",
               "shared_machine": "up to 5 helpers' tests and benchmarks ran beside this one", "rounds": args.rounds,
               "load_average_at_start": os.getloadavg(), "prefix": {}, "overhead": {}}
    stack, ours = DynamoStack(args), None
    prefix_runs: dict[str, list] = {}
    overhead_runs: dict[str, list] = {}
    loads = []
    try:
        started_here = "1 Dynamo worker and 1 Dynamo frontend" if args.overhead_only else \
            "3 Dynamo workers and 3 Dynamo frontends"
        print(f"starting etcd, NATS, {started_here} ...", flush=True)
        stack.start()
        if not args.skip_overhead:
            print("starting tritonserver (omni_chat) and our front door ...", flush=True)
            ours = serving.OmniServers(args.dtype, args.max_model_len, name="scale_front_door").start()
        pids = stack.pids() + (ours.pids() if ours else [])
        questions = [serving.QUESTIONS[i % len(serving.QUESTIONS)] for i in range(args.overhead_requests)]
        senders = {"dynamo_single": lambda q: serving.openai_chat_request(*stack.routes["dynamo_single"], q,
                                                                          args.overhead_new_tokens)}
        sides = {"dynamo_single": {"frontend": [stack.pid("frontend_dynamo_single")],
                                   "engine_process": [stack.pid("worker_single")]}}
        if ours:
            senders["front_door"] = lambda q: serving.openai_chat_request(ours.base_url, "omni_chat", q,
                                                                          args.overhead_new_tokens)
            sides["front_door"] = {"frontend": [ours.front_door.process.pid],
                                   "engine_process": [ours.triton.process.pid]}
        results["round_orders"] = []
        for r in range(args.rounds):
            order = [] if args.overhead_only else list(ROUTES[r % len(ROUTES):] + ROUTES[:r % len(ROUTES)])
            results["round_orders"].append(order)
            print(f"round {r + 1}/{args.rounds}: prefix workload through {', '.join(order) or 'no route'}",
                  flush=True)
            for route in order:
                serving.settle(pids)
                run = run_prefix(*stack.routes[route], prefix_requests(prompts, args, seed=r), args)
                prefix_runs.setdefault(route, []).append(run)
                print(line(route, run), flush=True)
            for name in (list(senders) if r % 2 == 0 else list(reversed(senders))):
                serving.settle(pids)
                run = run_overhead(senders[name], questions, sides[name])
                overhead_runs.setdefault(name, []).append(run)
                print(line(name, run), flush=True)
            loads.append(os.getloadavg())
    finally:
        if ours:
            ours.stop()
        stack.stop()
    results["load_average_per_round"] = loads
    results["load_average_at_end"] = os.getloadavg()
    results["prefix"] = {route: median_run(runs) for route, runs in prefix_runs.items()}
    results["overhead"] = {name: {**serving.median_level(runs), **{key: {
        side: statistics.median(run[key][side] for run in runs) for side in runs[0][key]}
        for key in ("cpu_cores", "cpu_ms_per_token", "runqueue_wait_cores")}} for name, runs in overhead_runs.items()}
    results["ratios"], results["ratios_per_round"] = ratios(results)
    results["targets"] = prefix.targets(results["ratios"], TARGETS)
    results["seconds"] = time.perf_counter() - started
    print(f"medians over {args.rounds} round(s); CPU: {cpu['model']}, {cpu['cores']} cores; load average at start "
          f"{results['load_average_at_start'][0]:.1f}, at end {results['load_average_at_end'][0]:.1f}")
    for name, run in {**results["prefix"], **{f"{k} (c8)": v for k, v in results["overhead"].items()}}.items():
        print(line(name, run))
    for key, value in results["ratios"].items():
        each = ", ".join("-" if v is None else f"{v:.2f}" for v in results["ratios_per_round"][key])
        target = results["targets"].get(key)
        print(f"{key}: {value:.2f} (per round: {each})"
              + (f"  target {target['target']}: {'met' if target['met'] else 'not met'}" if target else ""))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    if args.overhead_only:  # beside scale.json, which keeps the full run's numbers
        (args.results_dir / "scale_overhead.json").write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.results_dir / 'scale_overhead.json'} in {results['seconds']:.0f} s")
        return
    (args.results_dir / "scale.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.results_dir / "scale.png")
    print(f"wrote {args.results_dir / 'scale.json'} and scale.png in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
