#!/usr/bin/env python3
"""Scheduler benchmark: a burst of long prompts that overfills the KV cache, with short requests sent during it.

Workload (issue 15): --long-prompts concurrent prompts of --long-tokens random tokens (seeded), --new-tokens new
tokens each with EOS ignored, on SmolLM2-135M-Instruct through `LLMEngine` offline (this script drives `step`),
in a KV cache of --kv-cache-mib (default 512 MiB, float32: 728 blocks of 16 tokens, where 5 of the default long
sequences fit at full length). From step --first-short-step on, every --short-every steps a short request
(--short-tokens prompt tokens, --short-new-tokens new tokens) is added. Reports:

- preemptions, the sequences preempted and the most times one was;
- sequences that could not fit: running sequences that come, in admission order, after the ones whose blocks at
  full length (prompt + max_tokens) already fill the cache (checked after every step); the scheduler's goal is
  no more preemptions than these;
- time to first token of the short requests, p50 and p99, in seconds and in engine steps (from the step after
  they were added), and of the long ones;
- steps, seconds, generated tokens per second; the CPU (lscpu model name, avx512_bf16 yes/no) and its load.

Writes --output (default benchmarks/results/scheduler.json). Speed drifts with load: run it on a quiet machine.

Usage:
  .venv/bin/python scripts/bench_scheduler.py                     # the full burst (minutes on a few cores)
  .venv/bin/python scripts/bench_scheduler.py --long-prompts 4 --long-tokens 300 --new-tokens 20 \\
      --kv-cache-mib 42 --shorts 3 --first-short-step 2 --short-every 4 --output /tmp/scheduler_smoke.json
      # a smoke run (about a minute): 59 blocks, 3 long prompts admitted where 2 fit at full length
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from omni_backend import paths
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.sequence import Sequence

MODEL = paths.models_dir() / "SmolLM2-135M-Instruct"
RESULTS = paths.PROJECT_ROOT / "benchmarks" / "results"


def cpu_info() -> dict:
    """lscpu's model name and whether the CPU has avx512_bf16 (/proc/cpuinfo flags when lscpu is missing),
    cores, torch threads and the load average."""
    model, flags = None, []
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
        fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in lines)}
        model, flags = fields.get("Model name"), fields.get("Flags", "").split()
    except (OSError, subprocess.CalledProcessError):
        pass
    if not flags:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        except OSError:
            cpuinfo = []
        model = model or next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
                              None)
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    return {"cpu_model": model, "avx512_bf16": "yes" if "avx512_bf16" in flags else "no", "cores": os.cpu_count(),
            "torch": torch.__version__, "platform": platform.platform(),
            "loadavg": os.getloadavg()}


def random_prompt(generator: torch.Generator, tokens: int, vocab: int) -> list[int]:
    return torch.randint(100, vocab, (tokens,), generator=generator).tolist()


def percentiles(values: list[float]) -> dict:
    """p50 and p99 as observed values (the next one up: with 10 values p99 is the largest), None for none."""
    if not values:
        return {"p50": None, "p99": None}
    return {f"p{q}": float(np.percentile(values, q, method="higher")) for q in (50, 99)}


def sequences_that_cannot_fit(engine: LLMEngine) -> set[str]:
    """Ids of running sequences after the ones (in admission order) whose blocks at full length fill the cache."""
    manager = engine.scheduler.block_manager
    used, over = 0, set()
    for seq in engine.scheduler.running:
        used += -(-(seq.num_prompt_tokens + seq.params.max_tokens) // manager.block_size)
        if used > manager.num_blocks:
            over.add(seq.request_id)
    return over


def run(args: argparse.Namespace) -> dict:
    engine = LLMEngine(EngineConfig(model_path=str(MODEL), dtype=args.dtype, kv_cache_bytes=args.kv_cache_mib << 20,
                                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                    max_model_len=args.max_model_len))
    vocab = engine.runner.model.embed_tokens.num_embeddings
    generator = torch.Generator().manual_seed(0)
    engine.generate([random_prompt(generator, 16, vocab)], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    steps_before, preemptions_before = engine.num_steps, engine.scheduler.num_preemptions

    long_params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    short_params = SamplingParams(max_tokens=args.short_new_tokens, temperature=0.0, ignore_eos=True)
    short_steps = {args.first_short_step + i * args.short_every: f"short-{i}" for i in range(args.shorts)}
    added: dict[str, tuple[float, int]] = {}  # id -> (time.monotonic() when added, steps run before it)
    seqs: dict[str, Sequence] = {}

    def add(request_id: str, prompt: list[int], params: SamplingParams) -> None:
        engine.add_request(request_id, prompt, params)
        seqs[request_id] = engine.requests[request_id].seq
        added[request_id] = (time.monotonic(), engine.num_steps - steps_before)

    start = time.perf_counter()
    for i in range(args.long_prompts):
        add(f"long-{i}", random_prompt(generator, args.long_tokens, vocab), long_params)
    first_token: dict[str, tuple[float, int]] = {}  # id -> (seconds, steps) from being added to its first token
    could_not_fit: set[str] = set()
    max_running = 0
    pending_shorts = sorted(short_steps)
    while engine.has_unfinished() or pending_shorts:
        step = engine.num_steps - steps_before
        if pending_shorts and (pending_shorts[0] <= step or not engine.has_unfinished()):  # an idle engine: now
            add(short_steps[pending_shorts.pop(0)], random_prompt(generator, args.short_tokens, vocab), short_params)
        engine.step()
        max_running = max(max_running, len(engine.scheduler.running))
        could_not_fit |= sequences_that_cannot_fit(engine)
        for request_id, seq in seqs.items():
            if request_id not in first_token and seq.first_token_time is not None:
                added_at, added_step = added[request_id]
                first_token[request_id] = (seq.first_token_time - added_at, step + 1 - added_step)
        if step % 50 == 0:
            print(f"  step {step}: {len(engine.scheduler.running)} running, {len(engine.scheduler.waiting)} waiting, "
                  f"{engine.scheduler.num_preemptions - preemptions_before} preemptions, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    seconds = time.perf_counter() - start

    manager = engine.scheduler.block_manager
    long_blocks = -(-(args.long_tokens + args.new_tokens) // manager.block_size)
    preempted = {r: s.num_preemptions for r, s in seqs.items() if s.num_preemptions}
    generated = sum(s.num_output_tokens for s in seqs.values())
    shorts = [r for r in seqs if r.startswith("short")]
    longs = [r for r in seqs if r.startswith("long")]
    return {
        "kv_blocks": manager.num_blocks, "block_size": manager.block_size,
        "watermark_blocks": engine.scheduler.watermark_blocks,
        "long_sequences_that_fit_at_full_length": (manager.num_blocks - engine.scheduler.watermark_blocks)
        // long_blocks,
        "steps": engine.num_steps - steps_before, "seconds": seconds, "generated_tokens": generated,
        "output_tok_s": generated / seconds, "max_running": max_running,
        "preemptions": engine.scheduler.num_preemptions - preemptions_before,
        "preempted_sequences": len(preempted), "most_preemptions_of_one_sequence": max(preempted.values(), default=0),
        "sequences_that_could_not_fit": len(could_not_fit),
        "short_ttft_s": percentiles([first_token[r][0] for r in shorts]),
        "short_ttft_steps": percentiles([first_token[r][1] for r in shorts]),
        "long_ttft_s": percentiles([first_token[r][0] for r in longs]),
        "long_ttft_steps": percentiles([first_token[r][1] for r in longs]),
        "short_ttft_each": {r: {"s": first_token[r][0], "steps": first_token[r][1]} for r in shorts},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long-prompts", type=int, default=32)
    parser.add_argument("--long-tokens", type=int, default=1900, help="prompt tokens of each long request")
    parser.add_argument("--new-tokens", type=int, default=100, help="new tokens of each long request")
    parser.add_argument("--shorts", type=int, default=10, help="short requests sent during the burst")
    parser.add_argument("--short-tokens", type=int, default=20)
    parser.add_argument("--short-new-tokens", type=int, default=10)
    parser.add_argument("--first-short-step", type=int, default=5, help="engine step before which the first "
                        "short request is added")
    parser.add_argument("--short-every", type=int, default=20, help="steps between short requests")
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--dtype", default="float32", help="model and KV dtype (float32: 728 blocks in 512 MiB)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--output", type=Path, default=RESULTS / "scheduler.json")
    args = parser.parse_args()
    if args.short_every < 1:
        parser.error("--short-every must be at least 1")
    machine = cpu_info()
    print(f"CPU: {machine['cpu_model']} ({machine['cores']} cores, avx512_bf16: {machine['avx512_bf16']}), "
          f"torch {machine['torch']}, load {machine['loadavg']}", flush=True)
    result = run(args)
    machine["engine_torch_threads"] = torch.get_num_threads()  # what the engine set (EngineConfig.cpu_threads)
    machine["loadavg_after"] = os.getloadavg()
    report = {"workload": {key: value for key, value in vars(args).items() if key != "output"},
              "machine": machine, **result}
    print(f"{result['steps']} steps in {result['seconds']:.1f} s, {result['output_tok_s']:.1f} generated tok/s; "
          f"KV cache {result['kv_blocks']} blocks (watermark {result['watermark_blocks']}), "
          f"{result['long_sequences_that_fit_at_full_length']} long sequences fit at full length, "
          f"up to {result['max_running']} ran")
    print(f"preemptions: {result['preemptions']} of {result['preempted_sequences']} sequences (at most "
          f"{result['most_preemptions_of_one_sequence']} of one); sequences that could not fit: "
          f"{result['sequences_that_could_not_fit']}")
    for kind in ("short", "long"):
        seconds, steps = result[f"{kind}_ttft_s"], result[f"{kind}_ttft_steps"]
        if seconds["p50"] is not None:
            print(f"{kind} requests' time to first token: p50 {seconds['p50']:.2f} s / {steps['p50']:.0f} steps, "
                  f"p99 {seconds['p99']:.2f} s / {steps['p99']:.0f} steps")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
