"""scripts/bench_decode_kernel.py at tiny sizes, so that its first run on a GPU is not the first run of its code.

On CPU its measurement (``run``) goes through the Triton interpreter with a wall-clock timer and eager calls in
place of graph replays; on a GPU it uses the script's own CUDA-event timer and CUDA-graph capture.
"""

import importlib.util
import json
import math
import os
import time

import pytest
import torch
from kernel_testing import DEVICE

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts",
                      "bench_decode_kernel.py")
# One sequence of 40 tokens in an 8-column table: default_num_splits gives 1 (direct output), the sweep adds 3.
TINY = ["--batch", "1", "--context", "40", "--max-model-len", "128", "--dtype", "fp32", "--sweep-splits", "3",
        "--warmup", "0", "--reps", "1", "--inner", "1", "--copy-mib", "1"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decode_kernel", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wall_time_per_call(fn, reps, inner):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) * 1e3 / inner)
    return times


def _measure(bench, argv):
    args = bench.parse_args(argv)
    if DEVICE == "cuda":
        return args, bench.run(args, torch.device("cuda"), bench.cuda_time_per_call, bench.cuda_graph)
    return args, bench.run(args, torch.device("cpu"), _wall_time_per_call, lambda fn: fn)


def test_bench_cli(bench):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    if DEVICE == "cpu":
        assert bench.main(TINY) == 2, "no CUDA: exit status 2"
    for bad in (["--shapes", "7b"], ["--shapes", "9/2/64"], ["--shapes", ","], ["--context", "9000"],
                ["--sweep-splits", "0"], ["--batch", "0"]):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(bad)
        assert e.value.code == 2, bad
    assert bench.parse_shapes("8b,4/2/16") == {"8b": (32, 8, 128), "4/2/16": (4, 2, 16)}


def test_bench_measures_both_production_shapes(bench, tmp_path):
    args, result = _measure(bench, TINY + ["--output", str(tmp_path / "bench.json")])
    assert result["ok"], json.dumps(result, indent=2)
    assert result["copy_bandwidth"]["GBps"] > 0
    assert result["config"]["table_columns"] == 8
    assert set(result["shapes"]) == {"135m", "8b"}
    for name, (hq, hkv, d) in bench.SHAPES.items():
        s = result["shapes"][name]
        assert s["heads"] == {"q": hq, "kv": hkv, "head_dim": d}
        assert s["num_splits"] == 1 and s["programs"] == hkv
        assert s["kv_bytes"] == 2 * 40 * hkv * d * 4
        assert set(s["agrees"]) == {"eager", "graph", "num_splits=3"} and all(s["agrees"].values())
        assert s["graph_error"] is None
        assert set(s["eager_ms_by_num_splits"]) == {"3"} and s["fastest_num_splits_eager"] in (1, 3)
        for key in ("kernel_ms_eager", "kernel_ms_graph", "reference_ms", "compile_s"):
            assert math.isfinite(s[key]) and s[key] > 0, key
        for mode in ("eager", "graph"):  # bytes / time and % of the copy, to the JSON's rounding (0.1)
            gbps = s["kv_bytes"] / (s[f"kernel_ms_{mode}"] * 1e-3) / 1e9
            assert abs(s[f"kv_GBps_{mode}"] - gbps) <= 0.051 + 1e-3 * gbps, mode
            pct = 100 * gbps / result["copy_bandwidth"]["GBps"]
            assert abs(s[f"pct_of_copy_bw_{mode}"] - pct) <= 0.051 + 1e-3 * pct, mode
        assert isinstance(s["meets_target"], bool)
    path = bench.output_path(args)
    assert path == str(tmp_path / "bench.json")
    bench.write_result(result, path)
    with open(path) as f:
        assert json.load(f) == result
    assert "135m 9/3/64 splits=1" in bench.summary(result)


def test_bench_fails_on_disagreement(bench, monkeypatch):
    """With a tolerance nothing can meet, every comparison fails and the run says so (exit status 1 in main)."""
    monkeypatch.setitem(bench.TOLERANCE, torch.float32, -1.0)
    _, result = _measure(bench, TINY + ["--shapes", "135m"])
    shape = result["shapes"]["135m"]
    assert not result["ok"] and not shape["ok"]
    assert not any(shape["agrees"].values())
