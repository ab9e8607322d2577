#!/usr/bin/env python3
"""The LLM engine on a GPU, for scripts/gpu_check.sh: needs only this repository and torch/triton/transformers.

No checkpoint is carried: a random-weight Llama with SmolLM2-135M-Instruct's shapes (30 layers, hidden 576, 9
query and 3 KV heads of 64, vocabulary 49152; from its config.json, but with an untied lm_head) and a word-level
tokenizer over the same vocabulary are built in a temporary folder. The lm_head is scaled up (x LOGIT_SCALE: logits
of standard deviation about 4) so that greedy decisions have margins far above float32 rounding: random weights
otherwise give near-flat logits whose argmax flips on a last-bit difference.

Checks (each recorded, one failing does not stop the others):
1. start-up: attention backend (triton expected, no fallback: the self-test passed), KV cache, seconds to build;
2. CUDA graphs vs eager in float32 with TF32 off: greedy tokens of 11 prompts (padded to the batch-16 graph)
   equal, and their top-5 logprobs within FP32_LOGPROB_TOL;
3. the same in bfloat16: top-5 logprobs of every step both runs share (up to the first differing token) within
   BF16_LOGPROB_TOL (bf16 keeps 8 mantissa bits: steps of 0.03 at |logprob| ~ 10, over 30 layers);
4. decode tok/s at batch 1, graph vs eager, bfloat16 (target: graphs >= 2x).

`--device cpu` runs the same code without graphs on a tiny model (the test suite's smoke test of this script).
Writes JSON to --output. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from omni_backend.engine.config import EngineConfig  # noqa: E402
from omni_backend.engine.llm_engine import LLMEngine  # noqa: E402
from omni_backend.engine.sampling_params import SamplingParams  # noqa: E402

# HuggingFaceTB/SmolLM2-135M-Instruct config.json
SMOLLM2_SHAPES = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0,
                      max_position_embeddings=8192)
LOGIT_SCALE = 8.0
FP32_LOGPROB_TOL = 1e-3
BF16_LOGPROB_TOL = 0.25
GRAPH_SPEEDUP_TARGET = 2.0


def build_model(folder: str, layers: int | None = None) -> str:
    """Save a random Llama with SmolLM2-135M's shapes (or `layers` layers) and a word-level tokenizer
    ("w<id>" words) to `folder`; returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    shapes = dict(SMOLLM2_SHAPES)
    if layers is not None:
        shapes["num_hidden_layers"] = layers
    config = LlamaConfig(**shapes, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(LOGIT_SCALE)
    model.save_pretrained(folder)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(config.vocab_size)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", bos_token="w1",
                            eos_token="w2").save_pretrained(folder)
    return folder


def make_engine(path: str, device: str, dtype: str, eager: bool, max_num_seqs: int = 16) -> tuple[LLMEngine, float]:
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(model_path=path, device=device, dtype=dtype, enforce_eager=eager,
                                    kv_cache_bytes=(1 << 30) if device != "cpu" else (64 << 20),
                                    max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
                                    max_model_len=2048))
    return engine, time.perf_counter() - started


def prompts(count: int, length: int) -> list[list[int]]:
    return [[1] + [(97 * i + 13 * j) % 49000 + 100 for j in range(length + 3 * i)] for i in range(count)]


def greedy(engine: LLMEngine, batch: list[list[int]], max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    return engine.generate(batch, params)


def compare(eager_outputs, graph_outputs) -> dict:
    """Token agreement and the largest top-5 logprob difference over the steps both runs share."""
    equal, shared, worst = True, 0, 0.0
    for a, b in zip(eager_outputs, graph_outputs):
        for x, y in zip(a.logprobs, b.logprobs):
            top_x, top_y = dict(x.top), dict(y.top)
            common = set(top_x) & set(top_y)
            worst = max([worst, abs(x.logprob - y.logprob)] + [abs(top_x[t] - top_y[t]) for t in common])
            shared += 1
            if x.token_id != y.token_id:
                equal = False
                break
    return {"tokens_equal": equal, "steps_compared": shared, "max_logprob_diff": worst}


def check_startup(path: str, device: str) -> dict:
    engine, seconds = make_engine(path, device, "bfloat16" if device != "cpu" else "float32", eager=False)
    runner = engine.runner
    graphs = runner.graph_runner.batch_sizes if runner.graph_runner else []
    ok = runner.attention_backend == ("triton" if device != "cpu" else "cpu") and not runner.fallback_reason
    return {"ok": ok, "seconds": round(seconds, 1), "attention_backend": runner.attention_backend,
            "attention_reason": runner.attention_reason, "fallback_reason": runner.fallback_reason, "kv_blocks": runner.num_blocks, "graph_batch_sizes": graphs,
            "dtype": str(runner.dtype)}


def check_graphs_vs_eager(path: str, device: str, dtype: str, tolerance: float, need_equal_tokens: bool) -> dict:
    batch = prompts(11, 8)  # 11 rows: replayed in the batch-16 graph with 5 padding rows
    results = {}
    for eager in (True, False):
        engine, _ = make_engine(path, device, dtype, eager)
        results[eager] = greedy(engine, batch, 24)
        if not eager and engine.runner.graph_runner is not None:
            results["replays"] = engine.runner.graph_runner.num_replays
            results["padded_rows"] = engine.runner.graph_runner.num_padded_rows
        del engine
    found = compare(results[True], results[False])
    found.update(dtype=dtype, tolerance=tolerance, replays=results.get("replays", 0),
                 padded_rows=results.get("padded_rows", 0))
    found["ok"] = (found["max_logprob_diff"] <= tolerance and (found["tokens_equal"] or not need_equal_tokens)
                   and (device == "cpu" or found["replays"] > 0))
    return found


def decode_tokens_per_s(engine: LLMEngine, new_tokens: int) -> float:
    """Tokens per second of one request's decode steps (after its first token)."""
    engine.add_request("timed", prompts(1, 32)[0], SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                                   ignore_eos=True))
    engine.step()  # prefill and first token
    sync = torch.cuda.synchronize if engine.runner.device.is_cuda else (lambda: None)
    sync()
    started = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    sync()
    return steps / (time.perf_counter() - started)


def check_decode_speed(path: str, device: str, new_tokens: int) -> dict:
    dtype = "bfloat16" if device != "cpu" else "float32"
    speeds = {}
    for eager in (True, False):
        engine, _ = make_engine(path, device, dtype, eager, max_num_seqs=8)
        decode_tokens_per_s(engine, 16)  # warm: first steps, allocator
        speeds["eager" if eager else "graph"] = round(decode_tokens_per_s(engine, new_tokens), 1)
        del engine
    ratio = speeds["graph"] / speeds["eager"]
    return {"batch": 1, "dtype": dtype, "new_tokens": new_tokens, "tok_per_s": speeds,
            "graph_over_eager": round(ratio, 2), "target": GRAPH_SPEEDUP_TARGET,
            "ok": device == "cpu" or ratio >= GRAPH_SPEEDUP_TARGET}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (the check) or cpu (smoke test of this script)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than SmolLM2's 30 (smoke test)")
    ap.add_argument("--new-tokens", type=int, default=256, help="decode steps timed at batch 1")
    ap.add_argument("--output", required=True, help="JSON path")
    args = ap.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        print("gpu_check_engine.py: torch sees no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 GEMMs in float32: token equality needs it
    torch.backends.cudnn.allow_tf32 = False
    report: dict = {"device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
                    "torch": torch.__version__, "model": "random weights, SmolLM2-135M shapes"
                    + (f", {args.layers} layers" if args.layers else "")}
    with tempfile.TemporaryDirectory() as folder:
        path = build_model(folder, args.layers)
        checks = {
            "startup": lambda: check_startup(path, args.device),
            "graphs_vs_eager_fp32": lambda: check_graphs_vs_eager(path, args.device, "float32", FP32_LOGPROB_TOL,
                                                                  need_equal_tokens=True),
            "graphs_vs_eager_bf16": lambda: check_graphs_vs_eager(path, args.device, "bfloat16", BF16_LOGPROB_TOL,
                                                                  need_equal_tokens=False),
            "decode_batch1": lambda: check_decode_speed(path, args.device, args.new_tokens),
        }
        for name, run in checks.items():
            started = time.perf_counter()
            try:
                report[name] = run()
            except Exception as exc:  # record and go on: the other checks still tell something
                report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc()[-2000:]}
            report[name]["check_seconds"] = round(time.perf_counter() - started, 1)
            print(f"{name}: {json.dumps(report[name])}", flush=True)
    report["ok"] = all(report[name]["ok"] for name in checks)
    return write_report(report, args.output)


def write_report(report: dict, path: str) -> int:
    """Write `report` as JSON to `path` (folders made); the exit status it means: 0 when report["ok"], else 1."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(report, handle, indent=2)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
