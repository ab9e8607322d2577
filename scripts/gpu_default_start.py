#!/usr/bin/env python3
"""One LLM engine start on a GPU the way the llm stage starts it, for scripts/gpu_first_contact.sh.

scripts/gpu_check_engine.py fixes the KV cache size; this start does not, so the production path runs: the process
capped at `gpu_memory_utilization` of the device (ops/gpu_budget.py, as stages/llm/build.py does), the memory
profile (one prefill of max_num_batched_tokens, one eager decode at the largest graph batch), the KV plan
(engine/memory.py), the Triton warm-up and the CUDA-graph capture. Settings: 64 sequences, 2048 tokens per step,
8192 tokens of context, every other engine setting at its default (dtype auto, no kv_cache_bytes). The model is
gpu_check_engine.py's random-weight Llama with SmolLM2-135M's shapes.

Recorded (JSON to --output, a summary line to stdout): seconds to start; the attention backend and any fallback;
the memory profile, the KV plan (blocks, bytes, tokens, reason) and the graph pool in bytes; peak reserved device
memory after start and after the decode; decode tok/s of --seqs requests generating --new-tokens tokens each
(prompts of --prompt-tokens tokens each, all prefilled in the first step; greedy, ignore_eos), counted over the steps
after that first one, and end to end. Versions of torch, CUDA, the driver and Triton are in the JSON.

`--device cpu` runs the same code on a tiny model (the test suite's smoke test of this script).
Exit status: 0 ok; 1 the start or the decode raised (the error is in the JSON); 2 torch sees no CUDA device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gpu_check_engine  # noqa: E402  (the random SmolLM2-shaped model)

from omni_backend.engine.config import EngineConfig  # noqa: E402
from omni_backend.engine.llm_engine import LLMEngine  # noqa: E402
from omni_backend.engine.sampling_params import SamplingParams  # noqa: E402
from omni_backend.ops.gpu_budget import apply_gpu_memory_budget  # noqa: E402
from omni_backend.ops.hardware import runtime_versions  # noqa: E402

SETTINGS = dict(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=8192)


def start(path: str, device: str) -> tuple[LLMEngine, dict]:
    """Build the engine as the llm stage does; returns it and what its start-up decided and measured."""
    config = EngineConfig(model_path=path, device=device, **SETTINGS)
    cuda = config.torch_device.type == "cuda"
    apply_gpu_memory_budget(str(config.torch_device), config.gpu_memory_utilization, "llm")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    engine = LLMEngine(config)
    runner = engine.runner
    plan = runner.kv_plan
    found = {
        "settings": {**SETTINGS, "gpu_memory_utilization": config.gpu_memory_utilization,
                     "block_size": config.block_size, "kv_cache_bytes": config.kv_cache_bytes},
        "seconds": round(time.perf_counter() - began, 1), "dtype": str(runner.dtype),
        "attention_backend": runner.attention_backend, "attention_reason": runner.attention_reason,
        "fallback_reason": runner.fallback_reason,
        "memory_profile_bytes": dataclasses.asdict(runner.memory_profile) if runner.memory_profile else None,
        "kv_plan": {"num_blocks": plan.num_blocks, "block_bytes": plan.block_bytes, "bytes": plan.bytes,
                    "tokens": plan.num_blocks * config.block_size, "reason": plan.reason},
        "graph_batch_sizes": runner.graph_runner.batch_sizes if runner.graph_runner else [],
        "graph_pool_bytes": runner.graph_pool_bytes,
        "peak_reserved_bytes_after_start": torch.cuda.max_memory_reserved() if cuda else None,
    }
    return engine, found


def decode(engine: LLMEngine, seqs: int, prompt_tokens: int, new_tokens: int) -> dict:
    """Tokens per second of `seqs` greedy requests of `new_tokens` tokens each (see the module docstring)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    # prompts of equal length (gpu_check_engine.prompts grows them by 3 tokens a row): all fit the first step
    batch = [engine.make_sequence(f"r{i}", [1] + [(97 * i + 13 * j) % 49000 + 100 for j in range(prompt_tokens - 1)],
                                  params) for i in range(seqs)]
    for seq in batch:
        engine.add_sequence(seq)
    sync = torch.cuda.synchronize if engine.runner.device.is_cuda else (lambda: None)
    sync()
    began = time.perf_counter()
    engine.step()
    sync()
    first_step_s = time.perf_counter() - began
    if any(seq.num_output_tokens != 1 for seq in batch):
        raise RuntimeError(f"the first step did not prefill all {seqs} prompts: raise max_num_batched_tokens or "
                           "shorten --prompt-tokens")
    steps = 0
    decode_began = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    sync()
    ended = time.perf_counter()
    generated = sum(seq.num_output_tokens for seq in batch)
    return {"seqs": seqs, "prompt_tokens": sum(seq.num_prompt_tokens for seq in batch), "new_tokens": new_tokens,
            "generated": generated,
            "first_step_s": round(first_step_s, 3), "decode_steps": steps,
            "decode_tok_per_s": round((generated - seqs) / (ended - decode_began), 1),
            "end_to_end_tok_per_s": round(generated / (ended - began), 1),
            "ok": generated == seqs * new_tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (the check) or cpu (smoke test of this script)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than SmolLM2's 30 (smoke test)")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--output", required=True, help="JSON path")
    args = ap.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        print("gpu_default_start.py: torch sees no CUDA device", file=sys.stderr)
        return 2
    report: dict = {"device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
                    "versions": runtime_versions(), "model": "random weights, SmolLM2-135M shapes"
                    + (f", {args.layers} layers" if args.layers else "")}
    with tempfile.TemporaryDirectory() as folder:
        path = gpu_check_engine.build_model(folder, args.layers)
        try:
            engine, report["startup"] = start(path, args.device)
            print(f"startup: {json.dumps(report['startup'])}", flush=True)
            report["decode"] = decode(engine, args.seqs, args.prompt_tokens, args.new_tokens)
            if args.device != "cpu":
                report["peak_reserved_bytes_after_decode"] = torch.cuda.max_memory_reserved()
            report["ok"] = report["decode"]["ok"]
        except Exception as exc:  # record it: the JSON is the result either way
            report.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
    print(json.dumps({key: value for key, value in report.items() if key != "startup"}), flush=True)
    return gpu_check_engine.write_report(report, args.output)


if __name__ == "__main__":
    sys.exit(main())
