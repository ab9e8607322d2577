#!/usr/bin/env python3
"""Benchmark structured outputs in the engine (omni_backend/engine/structured_output.py): output tokens per second
of a batch constrained to a nested JSON schema against the same prompts unconstrained, and what a cold schema
costs.

- Throughput, at each concurrency C (default 8 and 32): C chat prompts submitted at once to an LLMEngine
  (SmolLM2-135M-Instruct, float32, max_num_seqs C) and run to the end; output tok/s = completion tokens / wall
  time. Both runs are greedy with max_tokens --max-tokens; the unconstrained one ignores EOS, so both write about
  as many tokens per request (a constrained answer ends when its JSON does, after about 60 tokens). Rounds
  alternate which one goes first; medians over --rounds (at least 3).
- Cold schema: time from submitting one constrained request with a schema never seen (a fresh `title`) to its
  first token, against the same request once its grammar is cached (medians over the rounds); the difference is
  the grammar's compile time on the critical path. The compile times themselves come from the compiler's record.

Writes JSON (--output, default benchmarks/results/structured.json) with the machine's cores and load average;
other work may share the machine: say so with --note.

Usage:
  .venv/bin/python scripts/bench_structured.py [--rounds 3] [--concurrency 8 32] [--note "..."]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from omni_backend import paths  # noqa: E402
from omni_backend.engine.config import EngineConfig  # noqa: E402
from omni_backend.engine.llm_engine import LLMEngine  # noqa: E402
from omni_backend.engine.sampling_params import SamplingParams  # noqa: E402

SCHEMA = {  # nested: objects, an array, enums, required fields
    "type": "object",
    "properties": {
        "product": {"type": "string", "maxLength": 24},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "customer": {"type": "object", "required": ["name", "country"],
                     "properties": {"name": {"type": "string", "maxLength": 24},
                                    "country": {"enum": ["FR", "DE", "US", "JP"]}}},
        "notes": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 16}},
    },
    "required": ["product", "quantity", "status", "customer", "notes"],
}
TOPICS = ["a book", "two lamps", "a bicycle", "tea", "a phone", "shoes", "a desk", "paint"]


def prompts(engine: LLMEngine, count: int) -> list[list[int]]:
    return [engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write order {i} for {TOPICS[i % len(TOPICS)]} as JSON."}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"] for i in range(count)]


def run_batch(engine: LLMEngine, batch: list[list[int]], params: SamplingParams) -> float:
    """Output tok/s of one batch run to the end."""
    start = time.perf_counter()
    outputs = engine.generate(batch, params)
    return sum(o.completion_tokens for o in outputs) / (time.perf_counter() - start)


def first_token_s(engine: LLMEngine, prompt: list[int], schema: dict) -> float:
    """Seconds from submitting one constrained request (alone) to its first token."""
    params = SamplingParams(max_tokens=1, temperature=0.0, guide_type="json_schema", guide=json.dumps(schema))
    start = time.perf_counter()
    engine.generate([prompt], params)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "structured.json"))
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    rounds = max(3, args.rounds)
    model = str(paths.models_dir() / "SmolLM2-135M-Instruct")
    engine = LLMEngine(EngineConfig(model_path=model, dtype="float32", max_num_seqs=max(args.concurrency),
                                    max_num_batched_tokens=max(1024, max(args.concurrency)), max_model_len=512))
    load_at_start = os.getloadavg()
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, guide_type="json_schema",
                                 guide=json.dumps(SCHEMA))
    throughput = {}
    for concurrency in args.concurrency:
        batch = prompts(engine, concurrency)
        for params in (free, constrained):  # warm-up at this batch: the grammar compiled, kernels and shapes seen
            run_batch(engine, batch, params)
        rates: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
        for round_index in range(rounds):
            order = [("unconstrained", free), ("json_schema", constrained)]
            for name, params in order if round_index % 2 == 0 else order[::-1]:
                rates[name].append(run_batch(engine, batch, params))
        medians = {name: statistics.median(values) for name, values in rates.items()}
        throughput[str(concurrency)] = {"tok_s": rates, "median_tok_s": medians,
                                        "ratio": medians["json_schema"] / medians["unconstrained"]}
        print(f"concurrency {concurrency}: unconstrained {medians['unconstrained']:.1f} tok/s, json_schema "
              f"{medians['json_schema']:.1f} tok/s, ratio {throughput[str(concurrency)]['ratio']:.3f}")
    prompt = prompts(engine, 1)[0]
    engine.grammars.take_compile_seconds()
    cold, warm = [], []
    for round_index in range(rounds):
        fresh = {**SCHEMA, "title": f"order-{round_index}-{time.time_ns()}"}
        cold.append(first_token_s(engine, prompt, fresh))
        warm.append(first_token_s(engine, prompt, fresh))
    compile_s = engine.grammars.take_compile_seconds()
    added = statistics.median(cold) - statistics.median(warm)
    print(f"cold schema: first token {statistics.median(cold) * 1e3:.1f} ms, cached {statistics.median(warm) * 1e3:.1f}"
          f" ms (+{added * 1e3:.1f} ms); compile {statistics.median(compile_s) * 1e3:.1f} ms")
    result = {"model": "SmolLM2-135M-Instruct float32 (engine, no server)", "rounds": rounds,
              "max_tokens": args.max_tokens, "schema": SCHEMA, "throughput": throughput,
              "cold_schema": {"first_token_s": cold, "cached_first_token_s": warm, "compile_s": compile_s,
                              "median_added_ms": added * 1e3},
              "machine": {"cores": os.cpu_count(), "load_average_at_start": load_at_start,
                          "load_average_at_end": os.getloadavg()}, "note": args.note}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
