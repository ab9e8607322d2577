#!/usr/bin/env python3
"""Acceptance of structured outputs and tool calls (issue 28) with the real SmolLM2-135M-Instruct, in the engine.

- JSON schema: --count chat prompts (distinct cities) x a nested schema (objects, an array of objects, enums,
  required fields; maxLength, maxItems and an integer range, so an answer always closes within max_tokens), greedy
  and sampled (temperature 0.8, top_p 0.95, seed i), all in one batch: every answer must end "stop", parse and
  validate (jsonschema).
- Tool calls: the same count of questions with two tools, `tool_choice: "required"` (one call:
  parallel_tool_calls false; the guide and the parsing are the front door's, serving/tools.py), greedy and sampled,
  in one batch, the tools shown in the default Hermes rendering (stages/tool_prompt.py): every answer must be a
  call of a given tool whose arguments validate against its parameters.

One engine (float32, every sequence of a batch in one step). Writes JSON (--output, default
benchmarks/results/structured_acceptance.json): counts, failures (with their text), wall times, the machine's cores
and load average (other work may share the machine: say so with --note). Exit status 1 when anything failed.
tests/engine/test_structured_acceptance.py runs `run` with fewer prompts.

Usage:
  .venv/bin/python scripts/structured_acceptance.py [--count 50] [--note "..."]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from omni_backend import paths  # noqa: E402
from omni_backend.engine.config import EngineConfig  # noqa: E402
from omni_backend.engine.llm_engine import LLMEngine  # noqa: E402
from omni_backend.engine.sampling_params import SamplingParams  # noqa: E402
from omni_backend.serving.tools import requested_tools  # noqa: E402
from omni_backend.stages.tool_prompt import default_rendering  # noqa: E402

SCHEMA = {  # nested: objects, an array of objects, enums, required fields
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["city", "town", "village"]},
        "location": {"type": "object",
                     "properties": {"country": {"type": "string", "maxLength": 16},
                                    "continent": {"enum": ["Africa", "America", "Asia", "Europe", "Oceania"]}},
                     "required": ["country", "continent"]},
        "landmarks": {"type": "array", "minItems": 1, "maxItems": 2,
                      "items": {"type": "object",
                                "properties": {"name": {"type": "string", "maxLength": 16},
                                               "type": {"enum": ["museum", "park", "monument", "church"]}},
                                "required": ["name", "type"]}},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    },
    "required": ["name", "kind", "location", "landmarks", "population"],
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                        "format": {"enum": ["12h", "24h"]}},
                       "required": ["city", "format"]}}},
]
CITIES = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Rome", "Berlin", "Madrid", "Lisbon", "Dublin", "Vienna",
          "Prague", "Warsaw", "Athens", "Helsinki", "Stockholm", "Copenhagen", "Brussels", "Amsterdam", "Zurich",
          "Geneva", "Milan", "Naples", "Seville", "Porto", "Lyon", "Marseille", "Munich", "Hamburg", "Krakow",
          "Budapest", "Bucharest", "Sofia", "Istanbul", "Moscow", "Kyiv", "Riga", "Tallinn", "Vilnius", "Reykjavik",
          "Boston", "Chicago", "Denver", "Seattle", "Toronto", "Montreal", "Sydney", "Perth", "Nairobi", "Lagos"]
JSON_MAX_TOKENS = 160  # the schema's longest answer (every string at its bound, one character a token) fits
TOOL_MAX_TOKENS = 80


def _ids(engine: LLMEngine, messages: list[dict]) -> list[int]:
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]


def _params(count: int, max_tokens: int, guide_type: str, guide: str) -> list[SamplingParams]:
    """`count` greedy then `count` sampled settings with the guide."""
    greedy = [SamplingParams(max_tokens=max_tokens, temperature=0.0, guide_type=guide_type, guide=guide)] * count
    return greedy + [SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=i,
                                    guide_type=guide_type, guide=guide) for i in range(count)]


def json_failures(text: str, finish_reason: str) -> str | None:
    """Why one schema answer fails, None when it ended, parsed and validated."""
    if finish_reason != "stop":
        return f"finish_reason {finish_reason}"
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


def tool_failures(tools, text: str, finish_reason: str) -> str | None:
    """Why one `required` answer fails, None when it is one call of a given tool with valid arguments."""
    content, calls = tools.calls(text)
    if finish_reason != "stop" or content is not None or len(calls) != 1:
        return f"finish_reason {finish_reason}, {len(calls)} calls"
    schema = tools.parameters.get(calls[0]["function"]["name"])
    try:
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


def run(engine: LLMEngine, count: int) -> dict:
    """Both workloads with `count` prompts each (greedy and sampled): per workload its answers, failures and wall
    time (s)."""
    result = {}
    prompts = [_ids(engine, [{"role": "user", "content": f"Describe {city} as JSON."}]) for city in CITIES[:count]]
    start = time.perf_counter()
    outputs = engine.generate(prompts * 2, _params(count, JSON_MAX_TOKENS, "json_schema", json.dumps(SCHEMA)))
    result["json_schema"] = _summary(outputs, [json_failures(o.text, o.finish_reason) for o in outputs],
                                     time.perf_counter() - start)
    tools = requested_tools(TOOLS, "required", False)
    guide = tools.guide()
    shown = [default_rendering([{"role": "user", "content": f"What is the weather in {city}, and the time there?"}],
                               TOOLS, str) for city in CITIES[:count]]
    start = time.perf_counter()
    outputs = engine.generate([_ids(engine, m) for m in shown] * 2,
                              _params(count, TOOL_MAX_TOKENS, guide.guide_type, guide.guide))
    result["tool_calls_required"] = _summary(outputs, [tool_failures(tools, o.text, o.finish_reason)
                                                       for o in outputs], time.perf_counter() - start)
    return result


def _summary(outputs, failures: list[str | None], seconds: float) -> dict:
    half = len(outputs) // 2
    return {"answers": len(outputs), "valid": failures.count(None), "seconds": seconds,
            "completion_tokens": sum(o.completion_tokens for o in outputs),
            "failures": [{"index": i, "sampled": i >= half, "why": why, "text": outputs[i].text}
                         for i, why in enumerate(failures) if why is not None],
            "examples": {"greedy": outputs[0].text, "sampled": outputs[half].text}}


def engine_for(count: int) -> LLMEngine:
    """SmolLM2-135M-Instruct in float32 with room for 2 x `count` sequences in one step."""
    model = str(paths.models_dir() / "SmolLM2-135M-Instruct")
    return LLMEngine(EngineConfig(model_path=model, dtype="float32", max_num_seqs=2 * count,
                                  max_num_batched_tokens=max(1024, 2 * count), max_model_len=1024))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=50, choices=range(1, len(CITIES) + 1), metavar="1..50")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "structured_acceptance.json"))
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    engine = engine_for(args.count)
    load_at_start = os.getloadavg()
    result = run(engine, args.count)
    for name, part in result.items():
        print(f"{name}: {part['valid']}/{part['answers']} valid in {part['seconds']:.1f} s")
    report = {"model": "SmolLM2-135M-Instruct float32 (engine, no server)", "count": args.count,
              "schema": SCHEMA, "tools": TOOLS, "results": result,
              "machine": {"cores": os.cpu_count(), "load_average_at_start": load_at_start,
                          "load_average_at_end": os.getloadavg()}, "note": args.note}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.output}")
    sys.exit(0 if all(part["valid"] == part["answers"] for part in result.values()) else 1)


if __name__ == "__main__":
    main()
