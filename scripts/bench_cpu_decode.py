#!/usr/bin/env python3
"""Benchmark the CPU decode attention: the C++ kernel (kernels/paged_decode_cpu.py) against the torch reference
(gather K/V out of the blocks, then torch's fused attention), one decode layer at a time.

Shape: the engine's bf16 decode step on SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64, block size 16),
batch 32, context lengths drawn from 150-380 tokens (seeded). Each "step" runs all 30 layers' worth of caches
(1,456 blocks each, as the engine sizes 512 MiB) one after the other, so a layer's K/V is not in the CPU cache
when it is read, as in the engine. Both implementations run --rounds times, interleaved; reported: median
microseconds per layer call of each, and the ratio. Writes benchmarks/results/cpu_decode.json.

Usage: .venv/bin/python scripts/bench_cpu_decode.py [--rounds 7] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels.paged_decode import paged_decode_attention_reference  # noqa: E402
from kernels.paged_decode_cpu import CpuPagedDecode  # noqa: E402
from omni_backend.ops.memory_env import reexec_with_memory_environment  # noqa: E402

LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, GROUP, HEAD_DIM, BATCH = 30, 1456, 16, 3, 3, 64, 32


def main() -> None:
    reexec_with_memory_environment()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
               torch.randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype))
              for _ in range(LAYERS)]
    lens = torch.randint(150, 381, (BATCH,), generator=gen, dtype=torch.int32)
    width = -(-380 // BLOCK_SIZE)
    tables = torch.randperm(NUM_BLOCKS, generator=gen)[:BATCH * width].to(torch.int32).view(BATCH, width)
    query = torch.randn(BATCH, KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM ** -0.5
    kernel = CpuPagedDecode(Path(tempfile.gettempdir()) / "omni_bench_kernels")
    peers = {"cpp_kernel": kernel, "torch_reference": paged_decode_attention_reference}
    worst = max((peers["cpp_kernel"](query, k, v, tables, lens, scale).float()
                 - paged_decode_attention_reference(query, k, v, tables, lens, scale).float()).abs().max().item()
                for k, v in caches[:2])

    def step(fn) -> float:
        start = time.perf_counter()
        for k, v in caches:
            fn(query, k, v, tables, lens, scale)
        return (time.perf_counter() - start) / LAYERS * 1e6

    for fn in peers.values():  # warm-up
        step(fn)
    runs: dict[str, list[float]] = {name: [] for name in peers}
    for _ in range(args.rounds):
        for name, fn in peers.items():
            runs[name].append(step(fn))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    ratio = medians["torch_reference"] / medians["cpp_kernel"]
    for name in peers:
        print(f"{name}: {medians[name]:.0f} us per layer (median of {args.rounds}; "
              f"runs {', '.join(f'{x:.0f}' for x in runs[name])})")
    print(f"torch_reference / cpp_kernel: {ratio:.2f}x; max |difference| {worst:.2e}")
    result = {"shape": {"batch": BATCH, "context_lens": "150-380", "q_heads": KV_HEADS * GROUP, "kv_heads": KV_HEADS,
                        "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE, "layers_cycled": LAYERS},
              "dtype": args.dtype, "machine": f"{platform.machine()} {os.cpu_count()} cores",
              "torch_threads": torch.get_num_threads(), "us_per_layer_median": medians, "us_per_layer_runs": runs,
              "torch_reference_over_cpp_kernel": ratio, "max_abs_difference": worst}
    out = ROOT / "benchmarks" / "results" / "cpu_decode.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
