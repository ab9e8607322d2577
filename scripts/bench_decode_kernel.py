#!/usr/bin/env python3
"""Benchmark the Triton paged decode attention kernel against its torch reference on one GPU.

Default shape: an 8B-class model's decode step (Llama-3-8B-like heads: 32 query heads, 8 KV heads,
head_dim 128), batch 64, every sequence at 4096 tokens of context, block size 16, bf16.

Reported per call (CUDA events; warm-up first; median over repetitions of back-to-back calls):
  * kernel time, eager (Python launch included in the queue) and replayed from a CUDA graph,
  * effective bandwidth of the KV read, bytes = 2 (K and V) * B * ctx * kv_heads * head_dim * 2 B,
  * that bandwidth as % of 4.3 TB/s (the team's planning figure) and of the 4.8 TB/s HBM3e
    bandwidth in NVIDIA's H200 Tensor Core GPU datasheet (H200 SXM and H200 NVL), see PEAK_TBPS,
  * the torch reference's time and the reference/kernel ratio, and their max abs difference.

Writes JSON to $OUT/gpu_check.json when OUT is set, else benchmarks/results/gpu_check.json.
Exits with status 2 and a message when CUDA is unavailable, 1 when the kernel disagrees with the
reference beyond tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# "% of peak" denominators (TB/s). 4.3 is the figure the project asked for; NVIDIA's H200 Tensor
# Core GPU datasheet (https://www.nvidia.com/en-us/data-center/h200/) lists 4.8 TB/s GPU memory
# bandwidth for H200 SXM and H200 NVL. Both percentages are reported.
PEAK_TBPS = 4.3
DATASHEET_TBPS = 4.8

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _time_per_call(fn, reps: int, inner: int) -> list[float]:
    """Milliseconds per call for each of `reps` repetitions of `inner` back-to-back calls."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--num-splits", type=int, default=None, help="default: kernels.paged_decode.default_num_splits")
    ap.add_argument("--sweep-splits", default="1,2,4,8", help="extra num_splits values to time (eager); '' to skip")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--inner", type=int, default=10, help="calls per timed repetition")
    ap.add_argument("--output", default=None, help="JSON path (default: $OUT/gpu_check.json or benchmarks/results/)")
    args = ap.parse_args()

    if not torch.cuda.is_available():
        print("bench_decode_kernel.py: CUDA is not available (no NVIDIA GPU visible to torch); "
              "this benchmark only runs on a GPU machine.", file=sys.stderr)
        return 2
    os.environ.pop("TRITON_INTERPRET", None)

    from kernels.paged_decode import (
        alloc_decode_workspace,
        default_num_splits,
        paged_decode_attention,
        paged_decode_attention_reference,
    )

    dtype = DTYPES[args.dtype]
    dev = torch.device("cuda")
    B, ctx, hq, hkv, d, bs = args.batch, args.context, args.q_heads, args.kv_heads, args.head_dim, args.block_size
    blocks_per_seq = -(-ctx // bs)
    num_blocks = B * blocks_per_seq
    gen = torch.Generator(device=dev).manual_seed(0)
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen, device=dev, dtype=dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen, device=dev, dtype=dtype)
    block_tables = torch.randperm(num_blocks, generator=gen, device=dev).to(torch.int32).view(B, blocks_per_seq)
    context_lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    query = torch.randn(B, hq, d, generator=gen, device=dev, dtype=dtype)
    scale = d ** -0.5
    splits = args.num_splits or default_num_splits(B, hkv, blocks_per_seq * bs)
    out = torch.empty_like(query)
    ws = alloc_decode_workspace(B, hq, d, splits, dev)
    call_args = (query, k_cache, v_cache, block_tables, context_lens, scale)

    def kernel():
        paged_decode_attention(*call_args, num_splits=splits, out=out, workspace=ws)

    def reference():
        return paged_decode_attention_reference(*call_args)

    t0 = time.time()
    kernel()  # compile
    torch.cuda.synchronize()
    compile_s = time.time() - t0
    ref = reference()
    max_abs_diff = (out.float() - ref.float()).abs().max().item()
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    ok = bool(max_abs_diff <= tol and not torch.isnan(out).any().item())

    for _ in range(args.warmup):
        kernel()
    kernel_ms = statistics.median(_time_per_call(kernel, args.reps, args.inner))

    graph_ms, graph_error = None, None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kernel()
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        graph_diff = (out.float() - ref.float()).abs().max().item()
        ok = ok and graph_diff <= tol
        for _ in range(args.warmup):
            graph.replay()
        graph_ms = statistics.median(_time_per_call(graph.replay, args.reps, args.inner))
    except Exception as e:  # report, keep going: the eager numbers are still useful
        graph_error = f"{type(e).__name__}: {e}"
        ok = False

    for _ in range(2):
        reference()
    reference_ms = statistics.median(_time_per_call(reference, max(3, args.reps // 4), 1))

    sweep = {}
    for s in [int(x) for x in args.sweep_splits.split(",") if x.strip()]:
        ws_s = alloc_decode_workspace(B, hq, d, s, dev)
        fn = lambda s=s, ws_s=ws_s: paged_decode_attention(*call_args, num_splits=s, out=out, workspace=ws_s)  # noqa: E731
        for _ in range(args.warmup):
            fn()
        sweep[str(s)] = round(statistics.median(_time_per_call(fn, args.reps // 2 or 1, args.inner)), 4)

    kv_bytes = 2 * B * ctx * hkv * d * torch.finfo(dtype).bits // 8
    best_ms = min(x for x in (kernel_ms, graph_ms) if x is not None)  # GB/s below use the faster
    gbps = kv_bytes / (best_ms * 1e-3) / 1e9
    result = {
        "check": "paged_decode_attention",
        "ok": ok,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "config": {"batch": B, "context": ctx, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
                   "block_size": bs, "dtype": args.dtype, "num_splits": splits},
        "kernel_ms_eager": round(kernel_ms, 4),
        "kernel_ms_graph": None if graph_ms is None else round(graph_ms, 4),
        "graph_error": graph_error,
        "reference_ms": round(reference_ms, 4),
        "reference_over_kernel": round(reference_ms / best_ms, 2),
        "kv_bytes": kv_bytes,
        "effective_GBps": round(gbps, 1),
        "effective_GBps_eager": round(kv_bytes / (kernel_ms * 1e-3) / 1e9, 1),
        "pct_of_4p3_TBps": round(100 * gbps / (PEAK_TBPS * 1e3), 1),
        "pct_of_datasheet_4p8_TBps": round(100 * gbps / (DATASHEET_TBPS * 1e3), 1),
        "max_abs_diff_vs_reference": max_abs_diff,
        "tolerance": tol,
        "compile_s": round(compile_s, 2),
        "eager_ms_by_num_splits": sweep,
        "timing": f"median of {args.reps} reps x {args.inner} back-to-back calls, CUDA events, {args.warmup} warm-up",
        "unix_time": int(time.time()),
    }
    out_dir = os.environ.get("OUT")
    path = args.output or (os.path.join(out_dir, "gpu_check.json") if out_dir
                           else os.path.join(ROOT, "benchmarks", "results", "gpu_check.json"))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    print(f"paged decode B={B} ctx={ctx} {args.dtype}: kernel {best_ms:.3f} ms/call "
          f"({gbps:.0f} GB/s = {result['pct_of_4p3_TBps']}% of {PEAK_TBPS} TB/s), "
          f"reference {reference_ms:.3f} ms ({result['reference_over_kernel']}x slower), "
          f"max|diff| {max_abs_diff:.2e} -> {'OK' if ok else 'FAIL'}; wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
