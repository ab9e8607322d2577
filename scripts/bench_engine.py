#!/usr/bin/env python3
"""Engine throughput benchmark: HF transformers peers vs our engine offline and through Triton, in one run.

Workload (issue 3): 64 requests, prompts of 32-256 random tokens (seeded), 128 new tokens each (EOS ignored
so every peer does the same work), SmolLM2-135M-Instruct. Peers:
  (a) HF `generate`, one request at a time (measured on the first --hf-single-requests requests: its rate
      does not depend on how many are run, and all 64 would take minutes),
  (b) HF `generate` in static batches of 8 (left-padded),
  (c) our engine offline (`LLMEngine.generate`, all requests at once),
  (d) our engine through tritonserver: the `llm` model over gRPC streaming at concurrency 32.
All peers use the same dtype (--dtype, default: what the engine picks for this device). Output tok/s =
generated tokens / wall seconds including prefill. This machine's speed drifts by 10-20 % over minutes, so every
peer runs --rounds times (default 3), interleaved (a, b, c, d, a, b, ...); each peer reports its median run, the
ratios are ratios of medians, and the JSON keeps every run and the ratios within each round. Writes
benchmarks/results/engine.json and engine.png.

Usage: .venv/bin/python scripts/bench_engine.py [--requests 64] [--new-tokens 128] [--concurrency 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import time
from pathlib import Path

import numpy as np
import torch

from omni_backend import tensor_names as T
from omni_backend import paths, repository
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.ops.hardware import select_dtype
from omni_backend.ops.memory_env import memory_environment, reexec_with_memory_environment
from omni_backend.launch.tritonserver import TritonServer

MODEL = paths.models_dir() / "SmolLM2-135M-Instruct"
RESULTS = paths.PROJECT_ROOT / "benchmarks" / "results"


def make_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 257, (count,), generator=g).tolist()
    return [torch.randint(100, vocab, (n,), generator=g).tolist() for n in lengths]


def bench_hf(prompts, new_tokens, batch_size, dtype) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=dtype).eval()
    pad = model.generation_config.pad_token_id or 0
    generated = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i:i + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
            generated += (out.shape[1] - width) * len(chunk)
    seconds = time.perf_counter() - start
    return {"requests": len(prompts), "generated_tokens": generated, "seconds": seconds,
            "output_tok_s": generated / seconds}


def bench_engine_offline(prompts, new_tokens, dtype_name) -> dict:
    engine = LLMEngine(EngineConfig(model_path=str(MODEL), dtype=dtype_name, max_num_seqs=32,
                                    kv_cache_bytes=512 << 20))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    generated = sum(o.completion_tokens for o in outputs)
    return {"requests": len(prompts), "generated_tokens": generated, "seconds": seconds,
            "output_tok_s": generated / seconds, "steps": engine.num_steps,
            "preemptions": engine.scheduler.num_preemptions}


def _free_ports(n):
    import socket
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _llm_inputs(client_module, prompt, params_json):
    ids = client_module.InferInput(T.INPUT_IDS, [len(prompt)], "INT32")
    ids.set_data_from_numpy(np.array(prompt, dtype=np.int32))
    sp = client_module.InferInput(T.SAMPLING_PARAMS, [1], "BYTES")
    sp.set_data_from_numpy(np.array([params_json.encode()], dtype=np.object_))
    return [ids, sp]


def _stream_all(client_module, url, prompts, params_json, concurrency) -> dict:
    """Run `prompts` through `llm` on one gRPC stream, at most `concurrency` in flight (a new one starts when
    one finishes), as perf_analyzer does with few client threads rather than a thread per request.

    Returns generated tokens, errors, and TTFT / end-to-end latency per request (s).
    """
    events: queue.SimpleQueue = queue.SimpleQueue()
    started: dict[str, float] = {}
    first: dict[str, float] = {}

    def callback(result, error):
        now = time.perf_counter()
        if error is not None:
            events.put(("error", None, str(error), now))
            return
        request_id = result.get_response().id
        first.setdefault(request_id, now)
        if result.as_numpy(T.FINISH_REASON).reshape(-1)[0]:
            events.put(("done", request_id, int(result.as_numpy(T.COMPLETION_TOKENS).reshape(-1)[0]), now))

    client = client_module.InferenceServerClient(url)
    client.start_stream(callback=callback)
    pending = list(enumerate(prompts))[::-1]
    result = {"generated": 0, "completed": 0, "errors": [], "ttft_s": [], "e2e_s": []}

    def send_next():
        index, prompt = pending.pop()
        request_id = str(index)
        started[request_id] = time.perf_counter()
        client.async_stream_infer("llm", _llm_inputs(client_module, prompt, params_json), request_id=request_id)

    for _ in range(min(concurrency, len(pending))):
        send_next()
    for _ in range(len(prompts)):
        kind, request_id, value, now = events.get(timeout=900)
        if kind == "error":
            result["errors"].append(value)
        else:
            result["completed"] += 1
            result["generated"] += value
            result["ttft_s"].append(first[request_id] - started[request_id])
            result["e2e_s"].append(now - started[request_id])
        if pending:
            send_next()
    client.stop_stream()
    client.close()
    return result


def bench_triton(prompts, new_tokens, concurrency, dtype_name) -> dict:
    import tritonclient.grpc as grpcclient
    root = paths.cache_dir() / "bench_engine"
    repo = root / "model_repository"
    repository.render_repository(repo, models=["llm"], dtype=dtype_name, max_num_seqs=concurrency,
                                 kv_cache_bytes=512 << 20)
    http, grpc, metrics = _free_ports(3)
    params_json = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, stream=True).to_json()
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, exit_timeout_s=5,
                      log_file=root / "tritonserver.log") as server:
        url = f"127.0.0.1:{grpc}"
        _stream_all(grpcclient, url, [prompts[0][:8]], SamplingParams(max_tokens=4).to_json(), 1)  # warm-up
        start = time.perf_counter()
        run = _stream_all(grpcclient, url, prompts, params_json, concurrency)
        seconds = time.perf_counter() - start
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    return {"requests": len(prompts), "completed": run["completed"], "errors": run["errors"],
            "generated_tokens": run["generated"], "seconds": seconds, "output_tok_s": run["generated"] / seconds,
            "concurrency": concurrency, "ttft_p50_s": pct(run["ttft_s"], 50), "ttft_p95_s": pct(run["ttft_s"], 95),
            "e2e_p50_s": pct(run["e2e_s"], 50)}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = {"hf_single": "(a) HF one at a time", "hf_batch8": "(b) HF static batch 8",
              "engine_offline": "(c) engine offline", "engine_triton": "(d) engine via Triton c=32"}
    names = [k for k in labels if k in results["peers"]]
    values = [results["peers"][k]["output_tok_s"] for k in names]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([labels[k] for k in names], values, color=["#999", "#999", "#2a7", "#27a"][:len(names)])
    top = max(max(results["peers"][k]["output_tok_s_runs"]) for k in names)
    for row, name in enumerate(names):  # every round's run as a tick, the median as the bar and the label
        runs = results["peers"][name]["output_tok_s_runs"]
        ax.plot(runs, [row] * len(runs), "k|", markersize=12)
        ax.text(max(runs) + 0.02 * top, row, f"{values[row]:.0f} tok/s", va="center")
    ax.set_xlim(0, 1.25 * top)
    ax.set_xlabel("output tokens / s (higher is better; bar: median round, ticks: every round)")
    ax.set_title(f"SmolLM2-135M, {results['workload']['requests']} req x {results['workload']['new_tokens']} "
                 f"tokens, {results['dtype']}, {results['machine']}")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    reexec_with_memory_environment()  # (c) and (d) then run under the same settings as the server
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--hf-single-requests", type=int, default=8)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3,
                        help="run every peer this many times, interleaved; report each peer's median run "
                             "(the upper one of the middle two for an even count)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["hf_single", "hf_batch8", "engine_offline",
                                                                  "engine_triton"])
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    dtype = select_dtype(args.dtype, torch.device("cpu"))
    dtype_name = str(dtype).removeprefix("torch.")
    from transformers import AutoConfig
    prompts = make_prompts(args.requests, AutoConfig.from_pretrained(MODEL).vocab_size)
    results = {"workload": {"requests": args.requests, "new_tokens": args.new_tokens,
                            "prompt_tokens": sum(map(len, prompts))},
               "dtype": dtype_name, "machine": f"{platform.machine()} {os.cpu_count()} cores",
               "torch_threads": torch.get_num_threads(),
               "memory_environment": {name: os.environ[name] for name in memory_environment()}, "peers": {}}
    peers = {
        "hf_single": lambda: bench_hf(prompts[:args.hf_single_requests], args.new_tokens, 1, dtype),
        "hf_batch8": lambda: bench_hf(prompts, args.new_tokens, 8, dtype),
        "engine_offline": lambda: bench_engine_offline(prompts, args.new_tokens, dtype_name),
        "engine_triton": lambda: bench_triton(prompts, args.new_tokens, args.concurrency, dtype_name),
    }
    runs: dict[str, list[dict]] = {name: [] for name in peers if name not in args.skip}
    for round_index in range(args.rounds):  # peers interleaved, so each round sees one phase of the machine
        for name in runs:
            print(f"round {round_index + 1}/{args.rounds}: running {name} ...", flush=True)
            runs[name].append(peers[name]())
            print(f"  {name}: {runs[name][-1]['output_tok_s']:.1f} tok/s ({runs[name][-1]['seconds']:.1f} s)",
                  flush=True)
    for name, peer_runs in runs.items():  # the median run of each peer (by tok/s), with every run's rate
        median = sorted(peer_runs, key=lambda r: r["output_tok_s"])[len(peer_runs) // 2]
        results["peers"][name] = {**median, "output_tok_s_runs": [r["output_tok_s"] for r in peer_runs]}
    p = results["peers"]
    ratios, per_round = {}, {}
    for num, den in (("engine_triton", "hf_single"), ("engine_triton", "hf_batch8"),
                     ("engine_triton", "engine_offline"), ("engine_offline", "hf_single")):
        if num in p and den in p:
            ratios[f"{num}/{den}"] = p[num]["output_tok_s"] / p[den]["output_tok_s"]
            per_round[f"{num}/{den}"] = [a / b for a, b in zip(p[num]["output_tok_s_runs"],
                                                               p[den]["output_tok_s_runs"])]
    results["ratios"] = ratios
    results["ratios_per_round"] = per_round
    for key, value in ratios.items():
        rounds = ", ".join(f"{r:.2f}" for r in per_round[key])
        print(f"{key}: {value:.2f}x (medians; per round: {rounds})")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS / "engine.png")
    print(f"wrote {RESULTS / 'engine.json'} and engine.png")


if __name__ == "__main__":
    main()
