"""Benchmark the CPU engine's step: decode-step time at batch 1, 8 and 32 and prefill rate, for each way the CPU
step can run its matmuls, against the machine's limits (a benchmark, not a test; results in
benchmarks/results/cpu_step.json unless --output).

Variants (same model, same process, interleaved rounds, one engine at a time):
- ``onednn``: the torch modules with oneDNN-packed float32 weights (`engine/cpu_linear.py`), the CPU path before
  the C++ kernels, and what runs where they cannot be built;
- ``kernels-float32``: the C++ step (`models/llama_cpu.py`) with float32 panels, the float32 default;
- ``kernels-int8``: the same with weight-only int8 codes and group scales (quantization "int8"): integer dot
  products (vpdpbusd) where the CPU has VNNI, else the codes dequantized to float32 in registers and FMAs;
- ``kernels-int8-fma``: the same with the FMA int8 kernel forced (built without VNNI: what CPUs without it run);
- ``kernels-bfloat16``: the C++ step in bfloat16 (bf16 panels on AMX, else vdpbf16ps or FMAs on the widened pairs,
  whichever the kernel measures faster; bf16 KV cache; AVX512-BF16 CPUs only);
- ``kernels-bfloat16-vdpbf16ps``: the same with vdpbf16ps forced where there is no AMX (what such CPUs ran before
  the kernel chose by measuring; on an AMX CPU the same as ``kernels-bfloat16``);
- ``onednn-bfloat16``: the torch modules in bfloat16 on oneDNN-packed weights (what bfloat16 ran before).

Machine limits (`kernels/machine_limits.py`, measured before every round with the same threads, the best of the
rounds kept): read-only and STREAM-triad bandwidth, and the register-only peaks of float32 FMA, vdpbf16ps, AMX and
VNNI's vpdpbusd. Each variant's steps are then reported as fractions of their bounds: batch 1 against the bandwidth
bound (the bytes of its packed projections and head / the read bandwidth: a batch-1 step streams its weights once;
KV-cache reads at these contexts are under 1 % of that), batch 32 and prefill against the compute bound (2 x matmul
weights FLOP per token / the peak of the instruction the variant multiplies with: FMA for float32; for int8 half the
vpdpbusd rate where the CPU has VNNI (each multiply-add of a 15-bit activation takes two u8 x s8 ones, see
kernels/int8_vnni.h), else FMA; for bfloat16 AMX where the CPU has it, else the faster of vdpbf16ps and FMA, since
either can multiply bf16 panels). A prefill computes the LM head for its last token only, so its FLOP are 2 x the
layers' weights per token plus 2 x the head's once; its rate is also reported in GFLOP/s. Attention, norms and
sampling count as overhead, so 100 % is out of reach.

Each round builds each variant's engine (1 torch thread unless --threads), fills it with `batch` prompts of
--prompt-tokens tokens, and times --steps decode steps (the median step is reported) and one prefill of
--prefill-tokens tokens, each by the clock and by the calling thread's CPU time (``time.thread_time``): with one
thread the step runs on the caller, so on a machine that other processes share the CPU time leaves out the time
slices they took (not what their use of the caches and memory bus cost); fractions are reported for both.
Prints per-variant medians over rounds and the ratios to ``onednn``; names the CPU.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_cpu_step.py            # about 7 minutes on 2 cores
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_cpu_step.py --rounds 1 --steps 3 --results-dir /tmp/x
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kernels.cpu_library import CpuKernelUnavailable
from kernels.linear_cpu import CpuLinearKernels
from kernels.machine_limits import PEAKS, MachineLimits
from omni_backend import paths
from omni_backend.engine.cpu_dtype import LayerShape
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.models.llama_cpu import CpuLlamaForward
from omni_backend.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving as serving  # noqa: E402  (its cpu_info)

MODEL = paths.models_dir() / "SmolLM2-135M-Instruct"
VARIANTS = ("onednn", "kernels-float32", "kernels-int8", "kernels-int8-fma", "kernels-bfloat16",
            "kernels-bfloat16-vdpbf16ps", "onednn-bfloat16")
# bytes per weight read by a batch-1 step; int8: the code plus a float32 scale and minimum per 32 weights
WEIGHT_BYTES = {"onednn": 4, "kernels-float32": 4, "kernels-int8": 1.25, "kernels-int8-fma": 1.25,
                "kernels-bfloat16": 2, "kernels-bfloat16-vdpbf16ps": 2, "onednn-bfloat16": 2}


# the variants that force a kernel by building the linear kernels with these extra flags
FORCED_BUILDS = {"kernels-bfloat16-vdpbf16ps": ["-DOMNI_BF16_KERNEL=1"],
                 "kernels-int8-fma": ["-mno-avx512vnni", "-mno-avxvnni"]}


def _without_cpu_kernels(*_args, **_kwargs):
    raise CpuKernelUnavailable("benchmark variant onednn")


def build_engine(variant: str, threads: int) -> LLMEngine:
    config = EngineConfig(model_path=str(MODEL), dtype="bfloat16" if "bfloat16" in variant else "float32",
                          max_num_seqs=32, kv_cache_bytes=512 << 20, cpu_threads=threads, enable_prefix_caching=False,
                          quantization="int8" if variant.startswith("kernels-int8") else "none")
    if variant in FORCED_BUILDS:  # its own build of the linear kernels (the flags are hashed)
        flags = CpuLinearKernels.FLAGS
        CpuLinearKernels.FLAGS = flags + FORCED_BUILDS[variant]
        try:
            return LLMEngine(config)
        finally:
            CpuLinearKernels.FLAGS = flags
    if not variant.startswith("onednn"):
        return LLMEngine(config)
    original = CpuLlamaForward.__dict__["build"]
    CpuLlamaForward.build = _without_cpu_kernels  # the model registry's CPU step for SmolLM2 (Llama)
    try:
        return LLMEngine(config)
    finally:
        CpuLlamaForward.build = original


def decode_step_ms(engine: LLMEngine, batch: int, prompt_tokens: int, steps: int, seed: int) -> float:
    """Median ms of `steps` decode steps with `batch` sequences of about prompt_tokens tokens of context: by the
    clock and by the calling thread's CPU time (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.runner.hf_config.vocab_size
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{seed}-{i}", torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist(), params)
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    times, cpu_times = [], []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.thread_time()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
        cpu_times.append((time.thread_time() - cpu_start) * 1e3)
    for i in range(batch):
        engine.abort(f"d{seed}-{i}")
    return statistics.median(times), statistics.median(cpu_times)


def prefill_tok_s(engine: LLMEngine, tokens: int, seed: int) -> tuple[float, float]:
    """Tokens per second of one `tokens`-token prefill: by the clock and by the calling thread's CPU time."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, engine.runner.hf_config.vocab_size, (tokens,), generator=gen).tolist()
    engine.add_request(f"p{seed}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    start, cpu_start = time.perf_counter(), time.thread_time()
    while engine.has_unfinished():
        engine.step()
    return tokens / (time.perf_counter() - start), tokens / (time.thread_time() - cpu_start)


def machine_limits(threads: int) -> dict:
    """Bandwidths (bytes/s) and peaks (FLOP/s) with `threads` torch threads (see the module docstring)."""
    torch.set_num_threads(threads)
    limits = MachineLimits(paths.cache_dir() / "kernels")
    return {"read_bytes_per_s": limits.read_bytes_per_s(), "triad_bytes_per_s": limits.triad_bytes_per_s(),
            **{f"peak_{name}_flops": limits.peak_flops(name) for name in PEAKS}}


def fractions(variant: str, row: dict, limits: dict, hf_config, prefill_tokens: int, kernel: str | None,
              cpu: bool = False) -> dict:
    """The row's decode steps and prefill (of `prefill_tokens` tokens) as fractions of their bounds, and the prefill's
    GFLOP/s (see the module docstring); `kernel`: the C++ step's microkernel (`ModelRunner.matmul_kernel`, None for
    oneDNN); `cpu`: from the times in thread CPU time."""
    row = {k.replace("_cpu", ""): v for k, v in row.items() if ("_cpu" in k) == cpu}
    shape = LayerShape.of(hf_config)
    head = hf_config.vocab_size * hf_config.hidden_size
    layers = hf_config.num_hidden_layers * sum(n * k for n, k in shape.weights())
    weights = layers + head
    if "bfloat16" in variant:
        peak = limits["peak_amx_bf16_flops"] or max(limits["peak_dot_bf16_flops"], limits["peak_fma_f32_flops"])
    elif kernel in ("avx512_vnni", "avx_vnni"):  # the int8 kernel the engine ran
        peak = limits["peak_dot_int8_flops"] / 2
    else:
        peak = limits["peak_fma_f32_flops"]
    flop_per_token = 2 * weights
    out = {"weight_bytes": weights * WEIGHT_BYTES[variant], "flop_per_token": flop_per_token, "peak_flops": peak}
    if "decode_ms_b1" in row:
        out["b1_of_bandwidth_bound"] = weights * WEIGHT_BYTES[variant] / limits["read_bytes_per_s"] * 1e3 / \
            row["decode_ms_b1"]
    if "decode_ms_b32" in row and peak:
        out["b32_of_compute_bound"] = 32 * flop_per_token / peak * 1e3 / row["decode_ms_b32"]
    prefill_flop_s = row["prefill_tok_s"] * 2 * (layers + head / prefill_tokens)
    out["prefill_gflop_s"] = prefill_flop_s / 1e9
    if peak:
        out["prefill_of_compute_bound"] = prefill_flop_s / peak
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--prefill-tokens", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--results-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--output", default="cpu_step.json", help="file name in --results-dir")
    parser.add_argument("--note", default="", help="recorded with the results (e.g. what else ran on the machine)")
    args = parser.parse_args()
    cpu = serving.cpu_info()
    print(f"CPU: {cpu}; {args.threads} torch thread(s)", flush=True)
    hf_config = None
    measured_limits = []
    rounds = []
    for r in range(args.rounds):
        measured_limits.append(machine_limits(args.threads))  # each round: a shared machine's rates drift
        print("limits: " + " ".join(f"{k} {v / 1e9:.1f}G" for k, v in measured_limits[-1].items()), flush=True)
        order = args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]
        results = {}
        for variant in order:
            engine = build_engine(variant, args.threads)
            row = {}
            for b in args.batches:
                row[f"decode_ms_b{b}"], row[f"decode_cpu_ms_b{b}"] = decode_step_ms(
                    engine, b, args.prompt_tokens, args.steps, 100 * r + b)
            row["prefill_tok_s"], row["prefill_cpu_tok_s"] = prefill_tok_s(engine, args.prefill_tokens, r)
            row["matmuls"], row["kernel"] = engine.runner.matmuls, engine.runner.matmul_kernel or None
            hf_config = engine.runner.hf_config
            results[variant] = row
            print(f"round {r + 1} {variant:16s} " + " ".join(
                f"{k} {v:.1f}" for k, v in row.items() if isinstance(v, float)), flush=True)
            del engine
        rounds.append(results)
    keys = [f"decode{cpu}_ms_b{b}" for cpu in ("", "_cpu") for b in args.batches] + \
        ["prefill_tok_s", "prefill_cpu_tok_s"]
    medians = {v: {k: statistics.median(rd[v][k] for rd in rounds) for k in keys} for v in args.variants}
    print("\nmedians over rounds:")
    for variant, row in medians.items():
        ratios = ""
        if "onednn" in medians and variant != "onednn":
            base = medians["onednn"]
            ratios = "  speed-up vs onednn: " + " ".join(
                f"{k} {base[k] / row[k] if k.startswith('decode') else row[k] / base[k]:.2f}x" for k in keys)
        print(f"{variant:16s} " + " ".join(f"{k} {row[k]:.1f}" for k in keys) + ratios)
    limits = {k: max(rd[k] for rd in measured_limits) for k in measured_limits[0]}  # the best each round saw
    kernels = {variant: rounds[0][variant]["kernel"] for variant in medians}
    bounds = {variant: fractions(variant, row, limits, hf_config, args.prefill_tokens, kernels[variant])
              for variant, row in medians.items()}
    cpu_bounds = {variant: fractions(variant, row, limits, hf_config, args.prefill_tokens, kernels[variant], cpu=True)
                  for variant, row in medians.items()}
    for name, table in (("the clock", bounds), ("thread CPU time", cpu_bounds)):
        print(f"\nfractions of the bounds by {name} (batch 1: bandwidth; batch 32 and prefill: compute):")
        for variant, row in table.items():
            print(f"{variant:16s} " + " ".join(f"{k} {v:.0%}" for k, v in row.items() if k.endswith("bound"))
                  + f" prefill {row['prefill_gflop_s']:.1f} GFLOP/s")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / args.output
    out.write_text(json.dumps({"cpu": cpu, "threads": args.threads, "model": MODEL.name, "note": args.note,
                               "limits": limits, "limits_by_round": measured_limits,
                               "prompt_tokens": args.prompt_tokens, "steps": args.steps, "kernels": kernels,
                               "medians": medians, "bounds": bounds, "bounds_cpu_time": cpu_bounds, "rounds": rounds,
                               "argv": sys.argv[1:]},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
