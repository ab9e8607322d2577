"""`dtype: auto` on a CPU with native bfloat16 (AVX512-BF16 or AMX): decided by measuring, once per CPU.

Why: which way is fastest depends on the CPU, not on its flags alone. On this project's AMD EPYC (AVX512-BF16, no
AMX) the float32 C++ step beat oneDNN's bfloat16 at concurrency 1 and 8 (issue 30), while on its AMX Xeon the
bfloat16 C++ step's AMX tiles run a batch-32 projection at about 3x the float32 tiles' rate. So the first engine
start on a CPU times the candidates and keeps the fastest.

What is timed: one decoder layer's four projections (fused qkv, o, fused gate/up, down; the model's sizes, random
weights), the matmuls that make up most of a decode step, at batch 1 and at the engine's max_num_seqs, for each
path this machine has (`PATHS`): the C++ float32 panels, the C++ bfloat16 panels (AMX, vdpbf16ps or FMA;
kernels/linear_cpu.py) and oneDNN's packed bfloat16 weights (engine/cpu_linear.py). A path's score is the
geometric mean of its two times, so both ends of the served batch range count equally; the lowest wins. The paths
take turns over ROUNDS rounds and each keeps its fastest round, so a burst of load from another process on a shared
machine slows one round of every path rather than one path. About a hundred calls in all: a second or two for
SmolLM2-135M on one core.

The choice is cached in ``<cache>/cpu_dtype.json`` under a key of the CPU model name, its feature flags, the torch
version, the C++ kernels' build (their library's file name, whose hash covers the sources, compiler and flags, and
the bfloat16 kernel the library chose at load: a kernel change is measured again), the layer sizes, the batch and the thread count, so later starts read it; `choose`
logs it either way.
An explicit dtype never comes here (`ModelRunner`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kernels.cpu_library import CpuKernelUnavailable, cpu_features
from kernels.linear_cpu import CpuLinearKernels
from omni_backend import checkpoints
from omni_backend.engine import cpu_linear

logger = logging.getLogger(__name__)

PATHS = ("float32", "bfloat16", "bfloat16-onednn")
"""The candidates: (C++ float32 panels, C++ bfloat16 panels, oneDNN-packed bfloat16 weights)."""
CACHE_FILE = "cpu_dtype.json"
MIN_SECONDS = 0.02  # per path and batch: calls repeat until this much time has passed (at least MIN_CALLS)
MIN_CALLS = 3
ROUNDS = 3  # interleaved rounds over the paths; each path's time is its fastest round's


@dataclass(frozen=True)
class LayerShape:
    """The projection sizes of one decoder layer: hidden, q + 2 kv width, q width, intermediate."""

    hidden: int
    qkv: int
    q: int
    intermediate: int

    @classmethod
    def of(cls, hf_config) -> "LayerShape":
        """From a transformers Llama/Qwen2 config."""
        heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
        head_dim = checkpoints.head_dim(hf_config)
        return cls(hf_config.hidden_size, (heads + 2 * kv_heads) * head_dim, heads * head_dim,
                   hf_config.intermediate_size)

    def weights(self) -> list[tuple[int, int]]:
        """The four projections' [out, in] sizes: qkv, o, gate/up, down."""
        return [(self.qkv, self.hidden), (self.hidden, self.q), (2 * self.intermediate, self.hidden),
                (self.hidden, self.intermediate)]


@dataclass(frozen=True)
class CpuDtypeChoice:
    """What `choose` decided.

    Attributes:
        path: one of PATHS.
        seconds: {path: {batch: seconds of one layer's four projections}} for the paths timed.
        cached: read from the cache file rather than measured now.
    """

    path: str
    seconds: dict[str, dict[int, float]]
    cached: bool

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.path == "float32" else torch.bfloat16

    @property
    def reason(self) -> str:
        """One line for the log and omni_runtime_info: the choice and every path's times in ms."""
        times = "; ".join(f"{path} " + "/".join(f"b{b} {s * 1e3:.2f}" for b, s in sorted(by_batch.items()))
                          for path, by_batch in self.seconds.items())
        return f"auto: measured {'(cached) ' if self.cached else ''}fastest {self.path} ({times} ms per layer)"


def pick(seconds: dict[str, dict[int, float]]) -> str:
    """The path with the lowest geometric mean over its batches' times (ties: the earlier in PATHS).

    Raises:
        ValueError: no path timed.
    """
    if not seconds:
        raise ValueError("no path was timed")
    score = {path: math.exp(sum(math.log(s) for s in by_batch.values()) / len(by_batch))
             for path, by_batch in seconds.items()}
    return min(sorted(score, key=PATHS.index), key=score.__getitem__)


def _time(call) -> float:
    """Median seconds of `call()` after one warm-up, over at least MIN_CALLS calls and MIN_SECONDS."""
    call()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < MIN_CALLS or time.perf_counter() - start < MIN_SECONDS:
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def measure(shape: LayerShape, batches: tuple[int, ...], build_dir: Path) -> dict:
    """{path: {batch: seconds}} of one layer's four projections for every path available here (the C++ kernels
    built in `build_dir`; where they cannot be built only oneDNN is timed, a WARNING says why; a path the build or
    the CPU lacks is left out)."""
    try:
        linear = CpuLinearKernels(build_dir)
    except CpuKernelUnavailable as exc:
        logger.warning("dtype auto: the C++ kernels cannot be built (%s); timing oneDNN alone", exc)
        linear = None
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shape.weights()]
    runs = {}
    if linear is not None:
        for fmt in ("float32", "bfloat16"):
            try:
                packed = [linear.pack(w, fmt) for w in weights]
            except CpuKernelUnavailable:  # no AVX512-BF16 in this build
                continue
            runs[fmt] = lambda x, packed=packed: [linear.linear(x[:, : p.in_features], p) for p in packed]
    if cpu_linear.packing_available(torch.bfloat16):  # its activations are bfloat16 already in a bfloat16 model
        onednn = [cpu_linear.PackedLinear(w.bfloat16(), None, max(batches)) for w in weights]
        runs["bfloat16-onednn"] = lambda x: [m(x[:, : m.in_features]) for m in onednn]
    widest = max(k for _, k in shape.weights())
    seconds: dict[str, dict[int, float]] = {path: {} for path in runs}
    with torch.inference_mode():
        for _ in range(ROUNDS):
            for batch in batches:
                x = torch.randn(batch, widest, generator=gen)
                inputs = {path: x.bfloat16() if path == "bfloat16-onednn" else x for path in runs}
                for path, run in runs.items():
                    t = _time(lambda: run(inputs[path]))  # noqa: B023 (called here, before the loop moves on)
                    seconds[path][batch] = min(t, seconds[path].get(batch, math.inf))
    return seconds


def kernels_build(build_dir: Path) -> str:
    """The C++ linear kernels' build in `build_dir`: their library's file name (built if missing; its hash covers the
    sources, headers, compiler, flags and CPU) and the bfloat16 kernel it runs here (AMX, vdpbf16ps or FMA: chosen by
    the library at load, `CpuLinearKernels.bf16_kernel`), or "unavailable" where they cannot be built."""
    try:
        linear = CpuLinearKernels(build_dir)
    except CpuKernelUnavailable:
        return "unavailable"
    return f"{linear.path.name} {linear.bf16_kernel}"


def cache_key(shape: LayerShape, batches: tuple[int, ...], kernels: str) -> str:
    """What a cached choice depends on: the CPU (model name and flags), torch, the C++ kernels' build (`kernels`,
    from `kernels_build`), the layer, the batches, threads."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    flags = " ".join(sorted(cpu_features().split(":", 1)[-1].split()))
    return json.dumps([model, flags, torch.__version__, kernels, asdict(shape), list(batches), torch.get_num_threads()])


def choose(shape: LayerShape, max_batch: int, build_dir: Path, cache_dir: Path) -> CpuDtypeChoice:
    """The fastest path for `shape` at batch 1 and `max_batch` here, from the cache or measured (then cached).

    A cache file that cannot be read or written is ignored (measured again, a WARNING); the choice still holds.
    """
    batches = tuple(sorted({1, max_batch}))
    key = cache_key(shape, batches, kernels_build(build_dir))
    path = cache_dir / CACHE_FILE
    try:
        entries = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as exc:
        logger.warning("dtype auto: cannot read %s (%s); measuring again", path, exc)
        entries = {}
    if key in entries:
        seconds = {p: {int(b): s for b, s in by_batch.items()} for p, by_batch in entries[key]["seconds"].items()}
        choice = CpuDtypeChoice(entries[key]["path"], seconds, cached=True)
    else:
        seconds = measure(shape, batches, build_dir)
        choice = CpuDtypeChoice(pick(seconds), seconds, cached=False)
        entries[key] = {"path": choice.path, "seconds": seconds, "measured_at": time.time()}
        _write(path, entries)
    logger.info("dtype %s", choice.reason)
    return choice


def _write(path: Path, entries: dict) -> None:
    """Write the cache atomically (engines starting together each write a whole file)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("dtype auto: cannot write %s (%s); the next start measures again", path, exc)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
