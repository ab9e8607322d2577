#!/usr/bin/env python3
"""Benchmark the Triton paged decode attention kernel at the served models' head shapes on one GPU.

Default run: both production shapes, SmolLM2-135M ("135m": 9 query heads, 3 KV heads, head_dim 64) and an
8B Llama-3-class model ("8b": 32, 8, 128); batch 64, every sequence at 4096 tokens of context, block size 16,
bf16, in a block table as wide as the engine's (``max_model_len / block_size`` = 512 columns at the default
8192, the columns past the context 0 like the engine's padding, and block 0 all NaN, so a read past the
context shows in the check).

Measured, all with CUDA events (median over repetitions of back-to-back calls, after warm-up):
  * the device's memory bandwidth: a device-to-device ``copy_`` of ``--copy-mib`` MiB, counting the bytes read
    plus the bytes written;
  * per shape: the kernel's time per call eager (Python launch in the queue) and replayed from a CUDA graph
    (kernel 1 + reduce), with ``num_splits`` from ``kernels.paged_decode.default_num_splits`` (the per-bucket
    rule for the engine) unless ``--num-splits``; its effective KV-read bandwidth, bytes = 2 (K and V) * B * context *
    kv_heads * head_dim * element size, as % of the measured copy bandwidth (target >= 60 %); eager time for
    each ``--sweep-splits`` value; the torch reference's time.
Every kernel result (default splits eager and replayed, each swept split count) is compared with the torch
reference: max |kernel - reference| / max |reference| within ``TOLERANCE`` and no NaN.

Writes one JSON (``--output``; default $OUT/decode_kernel.json when OUT is set, else
benchmarks/results/decode_kernel.json; scripts/gpu_check.sh folds it into gpu_check.json) with the copy
bandwidth and a ``shapes`` dict keyed by shape name.
Exit status: 0 all agree; 1 a kernel output disagrees with the reference beyond tolerance (or holds NaN), a
CUDA-graph capture failed, or a shape's measurement raised (the traceback is in the JSON and on stderr; the
other shapes still run); 2 CUDA is unavailable.

The measurement is ``run()``, which takes the device, the timer and the graph capture as arguments:
``tests/kernels/test_bench_decode_kernel.py`` runs it at tiny sizes (on CPU through the Triton interpreter with
a wall-clock timer and eager "replay", on a GPU with this file's CUDA timer and graphs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# (num_q_heads, num_kv_heads, head_dim) of the served models.
SHAPES = {"135m": (9, 3, 64), "8b": (32, 8, 128)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Largest max |kernel - reference| allowed, relative to max |reference|. Relative, because random K/V make each
# output an average of thousands of random V rows, so its scale is small (max |out| ~ 0.1 at context 4096) and an
# absolute bound that covers bf16 rounding at |out| ~ 1 would also pass a kernel that skipped part of the
# context. Expected differences: one rounding of the output (bf16: up to 2^-8 relative) and the kernel's P rounded
# to the input dtype for P @ V; a CPU emulation of the kernel's bf16 arithmetic at both shapes (batch 4, context
# 4096) differed from the reference by 0.004 of max |reference|; skipping the last 64 tokens (one KV tile) of the
# context differed by 0.15 at the 135m shape (0.015 absolute: within the absolute 3e-2 this script used before).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
TARGET_PCT_OF_COPY = 60.0

TimePerCall = Callable[[Callable[[], object], int, int], list[float]]
Capture = Callable[[Callable[[], object]], Callable[[], object]]


def parse_shapes(text: str) -> dict[str, tuple[int, int, int]]:
    """``"135m,8b"`` or ``"HQ/HKV/D"`` items (keyed by the text itself) -> {name: (q_heads, kv_heads, head_dim)}.

    Raises:
        ValueError: unknown name, malformed triple, or q_heads not a multiple of kv_heads.
    """
    shapes = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if item in SHAPES:
            shapes[item] = SHAPES[item]
            continue
        parts = item.split("/")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"shape {item!r}: expected one of {sorted(SHAPES)} or HQ/HKV/D")
        hq, hkv, d = (int(p) for p in parts)
        if hq % hkv:
            raise ValueError(f"shape {item!r}: {hq} query heads is not a multiple of {hkv} KV heads")
        shapes[item] = (hq, hkv, d)
    if not shapes:
        raise ValueError("no shape given")
    return shapes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="135m,8b",
                    help=f"comma-separated names {sorted(SHAPES)} or HQ/HKV/D triples (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096, help="tokens of context of every sequence")
    ap.add_argument("--max-model-len", type=int, default=8192,
                    help="block-table capacity in tokens, as the engine sizes it (columns = ceil(this / block size))")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--num-splits", type=int, default=None, help="default: kernels.paged_decode.default_num_splits")
    ap.add_argument("--sweep-splits", default="1,2,4,8", help="num_splits values to time eagerly; '' to skip")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--inner", type=int, default=10, help="calls per timed repetition")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth-measuring copy, MiB")
    ap.add_argument("--output", default=None, help="JSON path (default: $OUT/decode_kernel.json or benchmarks/results/)")
    args = ap.parse_args(argv)
    try:
        args.shape_dict = parse_shapes(args.shapes)
        args.sweep = [int(x) for x in args.sweep_splits.split(",") if x.strip()]
    except ValueError as e:
        ap.error(str(e))
    for name in ("batch", "context", "max_model_len", "block_size", "reps", "inner", "copy_mib"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.context > args.max_model_len:
        ap.error(f"--context {args.context} does not fit in --max-model-len {args.max_model_len}")
    if args.warmup < 0 or any(s < 1 for s in args.sweep) or (args.num_splits is not None and args.num_splits < 1):
        ap.error("--warmup must be >= 0 and split counts >= 1")
    return args


def cuda_time_per_call(fn: Callable[[], object], reps: int, inner: int) -> list[float]:
    """Milliseconds per call for each of ``reps`` repetitions of ``inner`` back-to-back calls (CUDA events)."""
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


def cuda_graph(fn: Callable[[], object]) -> Callable[[], object]:
    """Capture one call of ``fn`` (already compiled and run once) in a CUDA graph; return its replay."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def _error() -> str:
    """The exception being handled, with its traceback (last 4000 characters), also printed to stderr."""
    text = traceback.format_exc()
    print(text, file=sys.stderr)
    return text[-4000:]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` (just the numerator when ``want`` is all zeros); NaN if ``got`` has a NaN."""
    if torch.isnan(got).any().item():
        return float("nan")
    scale = want.float().abs().max().item()
    return (got.float() - want.float()).abs().max().item() / (scale if scale > 0 else 1.0)


def _agrees(diff: float, tol: float) -> bool:
    return math.isfinite(diff) and diff <= tol


def _json_float(x: float | None, digits: int = 4) -> float | None:
    """Round for the JSON; NaN/inf become None (strict JSON has no NaN)."""
    return round(x, digits) if x is not None and math.isfinite(x) else None


def copy_bandwidth(device: torch.device, nbytes: int, time_per_call: TimePerCall, warmup: int, reps: int) -> dict:
    """The device's memory bandwidth from a device-to-device copy: ``2 * nbytes`` (read + written) per call."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)

    for _ in range(warmup):
        copy()
    ms = statistics.median(time_per_call(copy, reps, 1))
    if not torch.equal(dst[-16:], src[-16:]):
        raise RuntimeError("the bandwidth copy did not copy")
    del src, dst
    return {"bytes_per_copy": nbytes, "bytes_moved_per_copy": 2 * nbytes, "ms": _json_float(ms),
            "GBps": round(2 * nbytes / (ms * 1e-3) / 1e9, 1)}


def build_inputs(batch: int, context: int, max_model_len: int, block_size: int, heads: tuple[int, int, int],
                 dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict:
    """Random query and paged cache for ``batch`` sequences of ``context`` tokens in an engine-wide table.

    Each sequence's ``ceil(context / block_size)`` blocks come from a random permutation of blocks
    ``1..num_blocks-1``; the table's other columns (``ceil(max_model_len / block_size)`` in all) are 0, and block 0
    is NaN.
    """
    num_q_heads, num_kv_heads, head_dim = heads
    blocks_per_seq = -(-context // block_size)
    columns = -(-max_model_len // block_size)
    num_blocks = batch * blocks_per_seq + 1
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    k_cache[0] = float("nan")
    v_cache[0] = float("nan")
    block_tables = torch.zeros(batch, columns, dtype=torch.int32, device=device)
    perm = torch.randperm(num_blocks - 1, generator=gen, device=device) + 1
    block_tables[:, :blocks_per_seq] = perm.to(torch.int32).view(batch, blocks_per_seq)
    return {
        "query": torch.randn(batch, num_q_heads, head_dim, generator=gen, device=device, dtype=dtype),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "context_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
        "scale": head_dim ** -0.5,
    }


def bench_shape(heads: tuple[int, int, int], args: argparse.Namespace, device: torch.device,
                time_per_call: TimePerCall, capture: Capture, copy_gbps: float | None) -> dict:
    """Check and time one head shape (see the module docstring); returns its JSON entry (percentages None
    without ``copy_gbps``)."""
    from kernels.paged_decode import (
        alloc_decode_workspace,
        default_num_splits,
        paged_decode_attention,
        paged_decode_attention_reference,
    )

    num_q_heads, num_kv_heads, head_dim = heads
    dtype = DTYPES[args.dtype]
    tol = TOLERANCE[dtype]
    inputs = build_inputs(args.batch, args.context, args.max_model_len, args.block_size, heads, dtype, device)
    call_args = (inputs["query"], inputs["k_cache"], inputs["v_cache"], inputs["block_tables"],
                 inputs["context_lens"], inputs["scale"])
    capacity = inputs["block_tables"].shape[1] * args.block_size
    splits = args.num_splits or default_num_splits(args.batch, num_kv_heads, capacity)
    out = torch.empty_like(inputs["query"])
    ws = alloc_decode_workspace(args.batch, num_q_heads, head_dim, splits, device)

    def kernel():
        paged_decode_attention(*call_args, num_splits=splits, out=out, workspace=ws)

    ref = paged_decode_attention_reference(*call_args)
    t0 = time.perf_counter()
    kernel()  # compiles
    _sync(device)
    compile_s = time.perf_counter() - t0
    diffs = {"eager": _rel_diff(out, ref)}

    for _ in range(args.warmup):
        kernel()
    eager_ms = statistics.median(time_per_call(kernel, args.reps, args.inner))

    graph_ms, graph_error = None, None
    try:
        replay = capture(kernel)
        out.fill_(float("nan"))
        replay()
        _sync(device)
        diffs["graph"] = _rel_diff(out, ref)
        for _ in range(args.warmup):
            replay()
        graph_ms = statistics.median(time_per_call(replay, args.reps, args.inner))
    except Exception:  # report and go on: the eager numbers still stand
        graph_error = _error()

    sweep_ms = {}
    for s in args.sweep:
        ws_s = alloc_decode_workspace(args.batch, num_q_heads, head_dim, s, device)

        def swept(s=s, ws_s=ws_s):
            paged_decode_attention(*call_args, num_splits=s, out=out, workspace=ws_s)

        swept()
        _sync(device)
        diffs[f"num_splits={s}"] = _rel_diff(out, ref)
        for _ in range(args.warmup):
            swept()
        sweep_ms[str(s)] = _json_float(statistics.median(time_per_call(swept, max(1, args.reps // 2), args.inner)))

    def reference():
        paged_decode_attention_reference(*call_args)

    reference()
    reference_ms = statistics.median(time_per_call(reference, max(1, args.reps // 4), 1))

    kv_bytes = 2 * args.batch * args.context * num_kv_heads * head_dim * (torch.finfo(dtype).bits // 8)

    def gbps(ms):
        return None if ms is None else kv_bytes / (ms * 1e-3) / 1e9

    def pct(ms):
        return None if ms is None or not copy_gbps else 100 * gbps(ms) / copy_gbps

    best_ms = min(x for x in (eager_ms, graph_ms) if x is not None)
    agree = {name: _agrees(d, tol) for name, d in diffs.items()}
    timed_splits = {int(k): v for k, v in sweep_ms.items()}
    timed_splits[splits] = _json_float(eager_ms)
    timed_splits = {k: v for k, v in timed_splits.items() if v is not None}
    return {
        "heads": {"q": num_q_heads, "kv": num_kv_heads, "head_dim": head_dim},
        "num_splits": splits,
        "num_splits_from": "--num-splits" if args.num_splits else
                           f"default_num_splits({args.batch}, {num_kv_heads}, {capacity})",
        "programs": args.batch * num_kv_heads * splits,
        "kv_bytes": kv_bytes,
        "kernel_ms_eager": _json_float(eager_ms),
        "kernel_ms_graph": _json_float(graph_ms),
        "graph_error": graph_error,
        "kv_GBps_eager": _json_float(gbps(eager_ms), 1),
        "kv_GBps_graph": _json_float(gbps(graph_ms), 1),
        "pct_of_copy_bw_eager": _json_float(pct(eager_ms), 1),
        "pct_of_copy_bw_graph": _json_float(pct(graph_ms), 1),
        "meets_target": None if not copy_gbps else pct(best_ms) >= TARGET_PCT_OF_COPY,
        "eager_ms_by_num_splits": sweep_ms,
        "fastest_num_splits_eager": min(timed_splits, key=timed_splits.get) if timed_splits else None,
        "reference_ms": _json_float(reference_ms),
        "reference_over_kernel": _json_float(reference_ms / best_ms, 2),
        "reference_max_abs": _json_float(ref.float().abs().max().item(), 6),
        "rel_diff_vs_reference": {name: _json_float(d, 6) for name, d in diffs.items()},
        "tolerance_rel": tol,
        "agrees": agree,
        "ok": all(agree.values()) and graph_error is None,
        "compile_s": round(compile_s, 2),
    }


def run(args: argparse.Namespace, device: torch.device, time_per_call: TimePerCall, capture: Capture) -> dict:
    """The whole benchmark on ``device``; returns the JSON document (``ok`` False on any disagreement)."""
    import triton

    t0 = time.perf_counter()
    # A failure is recorded and the rest still runs: the JSON says as much as one run can.
    try:
        copy = copy_bandwidth(device, args.copy_mib * 2**20, time_per_call, args.warmup, args.reps)
    except Exception:
        copy = {"error": _error(), "GBps": None}
    shapes = {}
    for name, heads in args.shape_dict.items():
        try:
            shapes[name] = bench_shape(heads, args, device, time_per_call, capture, copy["GBps"])
        except Exception:
            shapes[name] = {"error": _error(), "ok": False}
    return {
        "check": "paged_decode_attention",
        "ok": all(s["ok"] for s in shapes.values()),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "config": {"batch": args.batch, "context": args.context, "max_model_len": args.max_model_len,
                   "block_size": args.block_size, "table_columns": -(-args.max_model_len // args.block_size),
                   "dtype": args.dtype},
        "copy_bandwidth": copy,
        "target_pct_of_copy_bw": TARGET_PCT_OF_COPY,
        "shapes": shapes,
        "timing": f"median of {args.reps} reps x {args.inner} back-to-back calls ({args.reps // 2 or 1} reps for the "
                  f"sweep, {args.reps // 4 or 1} x 1 for the reference), {args.warmup} warm-up calls",
        "total_s": round(time.perf_counter() - t0, 1),
        "unix_time": int(time.time()),
    }


def output_path(args: argparse.Namespace) -> str:
    out_dir = os.environ.get("OUT")
    return args.output or (os.path.join(out_dir, "decode_kernel.json") if out_dir
                           else os.path.join(ROOT, "benchmarks", "results", "decode_kernel.json"))


def write_result(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, allow_nan=False)


def summary(result: dict) -> str:
    """One line per shape for the log."""
    lines = [f"copy bandwidth {result['copy_bandwidth']['GBps']} GB/s (read + written)"]
    for name, s in result["shapes"].items():
        if "error" in s:
            lines.append(f"{name}: FAIL, raised (see its error in the JSON)")
            continue
        lines.append(
            f"{name} {s['heads']['q']}/{s['heads']['kv']}/{s['heads']['head_dim']} splits={s['num_splits']}: "
            f"eager {s['kernel_ms_eager']} ms ({s['pct_of_copy_bw_eager']}%), graph {s['kernel_ms_graph']} ms "
            f"({s['pct_of_copy_bw_graph']}% of copy bw; target {TARGET_PCT_OF_COPY:g}%), "
            f"sweep {s['eager_ms_by_num_splits']}, max|diff|/max|ref| {s['rel_diff_vs_reference']} -> "
            f"{'OK' if s['ok'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_kernel.py: CUDA is not available (no NVIDIA GPU visible to torch); "
              "this benchmark only runs on a GPU machine.", file=sys.stderr)
        return 2
    os.environ.pop("TRITON_INTERPRET", None)  # before kernels (and triton) are first imported
    result = run(args, torch.device("cuda"), cuda_time_per_call, cuda_graph)
    path = output_path(args)
    write_result(result, path)
    print(json.dumps(result, indent=2))
    print(summary(result))
    print(f"wrote {path}; {'OK' if result['ok'] else 'FAIL: a kernel output disagrees with the reference'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
