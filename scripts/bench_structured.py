#!/usr/bin/env python3
"""Benchmark structured outputs: output tokens per second of requests constrained to a nested JSON schema, in our
engine against the same prompts unconstrained, and through our OpenAI front door against vLLM's CPU server with its
xgrammar backend; and what a cold schema costs.

- Engine (omni_backend/engine/structured_output.py, in this process, no server), at each concurrency C (default 8
  and 32): C chat prompts submitted at once to an LLMEngine (SmolLM2-135M-Instruct, `--dtype`, max_num_seqs the
  largest C) and run to the end; output tok/s = completion tokens / wall time. Both runs are greedy with max_tokens
  --max-tokens; the unconstrained one ignores EOS, so both write about as many tokens per request (a constrained
  answer ends when its JSON does, after about 60 tokens). Within a round the two alternate which goes first
  (`--skip engine` leaves this part out: on a crowded machine it takes the longest).
- Servers: the same C chat prompts (the same user messages) sent at once, streamed, to `/v1/chat/completions` with
  `response_format` {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA, "strict": true}},
  greedy, max_tokens --max-tokens, EOS not ignored (the JSON ends the answer): `front_door`, our OpenAI front door
  before tritonserver (scripts/bench_serving.py's OmniServers, `--dtype`; what the engine ran is read from
  omni_runtime_info), and `vllm`, vLLM's CPU build (bench_serving.py's VllmServer, installed into
  .cache/bench/vllm-venv on first use) at `--vllm-dtype` with `--structured-outputs-config {"backend":"xgrammar"}`.
  Output tok/s = completion tokens (usage) / wall time; every answer is parsed and validated against SCHEMA
  (`jsonschema`), the count kept. Each server runs every level once, untimed, before the first round (grammar
  compiled and cached, shapes seen).
- Rounds: every round runs every peer at every level, the peers' order rotating (round r starts with the r-th);
  the servers are left to go idle before each peer's turn. Medians over --rounds (at least 3), and the ratios of
  the medians and within each round: engine json_schema / unconstrained, front_door / vllm.
- Cold schema (engine): time from submitting one constrained request with a schema never seen (a fresh `title`) to
  its first token, against the same request once its grammar is cached (medians over the rounds); the difference
  is the grammar's compile time on the critical path. The compile times themselves come from the compiler's record.

Writes JSON (--output, default benchmarks/results/structured.json) and a plot beside it (.png) with the CPU, its
cores and the load average at the start, after every round and at the end: other work may share the machine (say
so with --note). In the JSON, `throughput` holds concurrency -> peer -> mode -> output tok/s per round,
`server_levels` concurrency -> server -> its level summary per round (bench_serving's, with the valid count), and
`summary` concurrency -> the medians and ratios.

Usage:
  PYTHONPATH=$PWD .venv/bin/python scripts/bench_structured.py [--rounds 3] [--concurrency 8 32] [--dtype auto]
      [--vllm-dtype bfloat16] [--skip engine front_door vllm] [--note "..."]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_serving as serving  # noqa: E402  (server launchers, OpenAI client, settling, CPU facts)

from omni_backend import paths  # noqa: E402
from omni_backend.engine.config import EngineConfig  # noqa: E402
from omni_backend.engine.llm_engine import LLMEngine  # noqa: E402
from omni_backend.engine.sampling_params import SamplingParams  # noqa: E402

PEERS = ("engine", "front_door", "vllm")
VLLM_FLAGS = ("--structured-outputs-config", json.dumps({"backend": "xgrammar"}))
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


def questions(count: int) -> list[str]:
    """The user messages of the workload, one per concurrent request."""
    return [f"Write order {i} for {TOPICS[i % len(TOPICS)]} as JSON." for i in range(count)]


def prompts(engine: LLMEngine, count: int) -> list[list[int]]:
    """`questions(count)` through the model's chat template, as token ids (what the servers do with them)."""
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"]
            for question in questions(count)]


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


def valid(text: str) -> bool:
    """Whether `text` is JSON that SCHEMA accepts."""
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def server_level(base_url: str, model: str, concurrency: int, max_tokens: int) -> dict:
    """`concurrency` constrained chat requests at once (bench_serving's client); its level summary (output tok/s,
    TTFT/ITL/e2e percentiles in s) plus "valid": how many answers SCHEMA accepts, "at_max_tokens": how many
    stopped at `max_tokens`, "sample": the first answer's text."""
    extra = {"ignore_eos": False, "response_format": {
        "type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA, "strict": True}}}
    answers: list[dict] = []

    def send(question: str) -> dict:
        record = serving.openai_chat(base_url, model, [{"role": "user", "content": question}], max_tokens, extra)
        answers.append(record)
        return record

    level = serving.run_level(send, questions(concurrency), concurrency)
    level["valid"] = sum(valid(a["text"]) for a in answers)
    level["at_max_tokens"] = sum(a["tokens"] >= max_tokens for a in answers)
    level["sample"] = answers[0]["text"] if answers else None
    return level


def engine_level(engine: LLMEngine, batch: list[list[int]], modes: dict, round_index: int) -> dict:
    """Output tok/s of `batch` in each of `modes` (name -> SamplingParams), the order alternating with the round."""
    order = list(modes.items())
    return {name: run_batch(engine, batch, params) for name, params in (order if round_index % 2 == 0 else order[::-1])}


def ratio_of(numerators: list[float], denominators: list[float]) -> dict:
    """{"median": ratio of the medians, "per_round": the ratio within each round}."""
    return {"median": statistics.median(numerators) / statistics.median(denominators),
            "per_round": [a / b for a, b in zip(numerators, denominators)]}


def plot(result: dict, path: Path) -> None:
    """Output tok/s per concurrency: the engine unconstrained and json_schema, front door and vLLM json_schema;
    bars at the medians, dots for the rounds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    series = [("engine, unconstrained", "engine", "unconstrained"), ("engine, json_schema", "engine", "json_schema"),
              ("front door, json_schema", "front_door", "json_schema"),
              ("vLLM CPU, json_schema", "vllm", "json_schema")]
    levels = sorted(result["throughput"], key=int)
    present = [(label, [result["throughput"][c].get(peer, {}).get(mode, []) for c in levels])
               for label, peer, mode in series]
    present = [(label, runs) for label, runs in present if any(runs)]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(present)
    for i, (label, runs) in enumerate(present):
        xs = [j + i * width for j in range(len(levels))]
        ax.bar(xs, [statistics.median(r) if r else 0 for r in runs], width, label=label)
        for x, r in zip(xs, runs):
            ax.plot([x] * len(r), r, "k.", alpha=0.5)
    ax.set_xticks([j + (len(present) - 1) * width / 2 for j in range(len(levels))],
                  [f"concurrency {c}" for c in levels])
    ax.set_ylabel("output tokens / s")
    ax.legend(fontsize=8)
    cpu = result["machine"]["cpu"]
    ax.set_title(f"JSON schema outputs, SmolLM2-135M, max {result['max_tokens']} tokens, median of "
                 f"{result['rounds']} rounds (dots: each round)\nours {result['ours_dtype']}, vLLM "
                 f"{result['vllm_dtype']}; {cpu['model']}, {cpu['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    bf16 = serving.cpu_info()["avx512_bf16"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="our engine's, in process and in tritonserver (auto: its own choice, recorded)")
    parser.add_argument("--vllm-dtype", default="bfloat16" if bf16 else "float32", choices=["float32", "bfloat16"],
                        help="vLLM's (default: bfloat16 where the CPU has avx512_bf16, its faster dtype there)")
    parser.add_argument("--skip", nargs="*", default=[], choices=PEERS,
                        help="peers not to run (engine: its throughput only; the cold-schema part always runs)")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "structured.json"))
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    rounds = max(3, args.rounds)
    serving.stop_on_sigterm()
    model = str(paths.models_dir() / "SmolLM2-135M-Instruct")
    engine = LLMEngine(EngineConfig(model_path=model, dtype=args.dtype, max_num_seqs=max(args.concurrency),
                                    max_num_batched_tokens=max(1024, max(args.concurrency)), max_model_len=512))
    result = {"model": "SmolLM2-135M-Instruct", "rounds": rounds, "max_tokens": args.max_tokens, "schema": SCHEMA,
              "dtype": args.dtype, "ours_dtype": str(engine.runner.dtype).removeprefix("torch."),
              "ours_dtype_reason": engine.runner.dtype_reason, "vllm_dtype": args.vllm_dtype,
              "vllm": serving.VLLM_CPU, "vllm_flags": list(VLLM_FLAGS),
              "machine": {"cpu": serving.cpu_info(), "load_average_at_start": os.getloadavg(),
                          "load_average_per_round": []},
              "note": args.note, "skipped": {name: "--skip" for name in args.skip}}
    print(f"engine: {result['ours_dtype']} ({result['ours_dtype_reason']})", flush=True)
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, guide_type="json_schema",
                                 guide=json.dumps(SCHEMA))
    modes = {"unconstrained": free, "json_schema": constrained}
    batches = {c: prompts(engine, c) for c in args.concurrency}
    if "engine" not in args.skip:
        for batch in batches.values():  # warm-up at each batch: the grammar compiled, kernels and shapes seen
            engine_level(engine, batch, modes, 0)

    services, senders = [], {}
    throughput: dict[str, dict] = {str(c): {} if "engine" in args.skip else
                                   {"engine": {"unconstrained": [], "json_schema": []}} for c in args.concurrency}
    server_levels: dict[str, dict] = {str(c): {} for c in args.concurrency}
    try:
        if "front_door" not in args.skip:
            print("starting tritonserver (omni_chat) and the front door ...", flush=True)
            omni = serving.OmniServers(args.dtype, 2048, name="structured").start()
            services.append(omni)
            result["front_door_runtime"] = omni.runtime_info()
            senders["front_door"] = (omni.base_url, "omni_chat")
        if "vllm" not in args.skip:
            print("starting vllm ...", flush=True)
            try:
                vllm = serving.VllmServer(args.vllm_dtype, 2048, extra_args=VLLM_FLAGS).start()
            except Exception as exc:  # recorded and reported: the engine's numbers still stand
                result["skipped"]["vllm"] = f"{type(exc).__name__}: {exc}"
                print(f"  skipped vllm: {exc}", flush=True)
            else:
                services.append(vllm)
                senders["vllm"] = (vllm.base_url, vllm.MODEL_NAME)
        for name, (url, served) in senders.items():  # grammar compiled and cached, every batch size seen
            for c in args.concurrency:
                server_level(url, served, c, args.max_tokens)
        pids = [pid for service in services for pid in service.pids()]
        peers = [name for name in ("engine", *senders) if name not in args.skip]
        for round_index in range(rounds):
            order = peers[round_index % len(peers):] + peers[:round_index % len(peers)]
            print(f"round {round_index + 1}/{rounds}: {', '.join(order)}", flush=True)
            for name in order:
                serving.settle(pids)
                for c in args.concurrency:
                    key = str(c)
                    if name == "engine":
                        for mode, rate in engine_level(engine, batches[c], modes, round_index).items():
                            throughput[key]["engine"][mode].append(rate)
                        rates = {mode: runs[-1] for mode, runs in throughput[key]["engine"].items()}
                        print(f"  engine     c={c:<3d} unconstrained {rates['unconstrained']:6.1f} json_schema "
                              f"{rates['json_schema']:6.1f} tok/s", flush=True)
                        continue
                    level = server_level(*senders[name], c, args.max_tokens)
                    throughput[key].setdefault(name, {"json_schema": []})["json_schema"].append(level["output_tok_s"])
                    server_levels[key].setdefault(name, []).append(level)
                    print(f"  {name:10s} c={c:<3d} json_schema {level['output_tok_s']:6.1f} tok/s, {level['valid']}/"
                          f"{level['requests']} valid, {level['at_max_tokens']} at max tokens, TTFT p50 "
                          f"{level['ttft_s'].get('p50', 0) * 1e3:.0f} ms"
                          + (f", errors {level['errors']}" if level["errors"] else ""), flush=True)
            result["machine"]["load_average_per_round"].append(os.getloadavg())
    finally:
        for service in reversed(services):
            service.stop()

    summary = {}
    for key, peers_at in throughput.items():
        medians = {f"{name} {mode}": statistics.median(rates) for name, modes_at in peers_at.items()
                   for mode, rates in modes_at.items()}
        ratios = {}
        if "engine" in peers_at:
            ratios["engine json_schema/unconstrained"] = ratio_of(peers_at["engine"]["json_schema"],
                                                                  peers_at["engine"]["unconstrained"])
        if "front_door" in peers_at and "vllm" in peers_at:
            ratios["front_door/vllm json_schema"] = ratio_of(peers_at["front_door"]["json_schema"],
                                                             peers_at["vllm"]["json_schema"])
        summary[key] = {"median_tok_s": medians, "ratios": ratios}
        print(f"concurrency {key}: " + ", ".join(f"{k} {v:.1f}" for k, v in medians.items()) + "; " +
              ", ".join(f"{k} {v['median']:.2f}x" for k, v in ratios.items()), flush=True)
    result["throughput"], result["server_levels"], result["summary"] = throughput, server_levels, summary

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
    result["cold_schema"] = {"first_token_s": cold, "cached_first_token_s": warm, "compile_s": compile_s,
                             "median_added_ms": added * 1e3}
    result["machine"]["load_average_at_end"] = os.getloadavg()
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, output.with_suffix(".png"))
    print(f"wrote {output} and {output.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
