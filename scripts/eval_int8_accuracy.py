"""Accuracy of the weight-only int8 mode (quantization "int8", kernels/linear_cpu.py) against float32, on SmolLM2-135M.

Measured over 50 chat prompts (the model's chat template over the questions below), greedy:
- agreement: the int8 engine's and the float32 engine's completions (--new-tokens each, EOS ends one), the share of
  prompts whose completions are identical and the mean number of leading tokens they share;
- logit error: transformers' model with the engine's dequantized int8 weights (q * s, what the int8 kernels
  multiply by; tests/engine/test_cpu_kernel_step.py shows the engine's int8 tokens equal it) against the float32
  model, over every position of each prompt followed by the float32 completion (teacher forcing): max and mean
  absolute logit difference, and how often the argmax differs.
Writes benchmarks/results/int8_accuracy.json; names the CPU.

    PYTHONPATH=$PWD .venv/bin/python scripts/eval_int8_accuracy.py        # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from omni_backend import paths
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving as serving  # noqa: E402  (its cpu_info)

MODEL = paths.models_dir() / "SmolLM2-135M-Instruct"
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
    "Explain photosynthesis in one sentence.", "What is 12 times 7?", "Name a famous physicist.",
    "Translate 'good morning' to Spanish.", "What does a CPU do?", "Give me a synonym for happy.",
    "Why is the sky blue?", "Write one line of Python that prints hello.", "Who wrote Hamlet?",
    "What is the boiling point of water in Celsius?", "Describe a cat in five words.", "What is the largest planet?",
    "Suggest a name for a dog.", "How many days are in a leap year?", "What is an API?",
    "Tell me a fun fact about octopuses.", "Summarize the plot of Cinderella.", "What is the speed of light?",
    "How do plants drink water?", "What is a prime number?", "Name the four seasons.", "What is gravity?",
    "Why do we sleep?", "What is the tallest mountain on Earth?", "Give me a tip for learning a language.",
    "What is the difference between weather and climate?", "How does a rainbow form?", "What is DNA?",
    "Name three fruits that are red.", "What is the freezing point of water in Fahrenheit?",
    "Write a short greeting for a birthday card.", "What is the main ingredient of guacamole?",
    "How many legs does a spider have?", "What is the chemical symbol for gold?", "Who painted the Mona Lisa?",
    "What is the purpose of a seatbelt?", "Explain what a noun is.", "What is the capital of Japan?",
    "How does a compass work?", "Name a musical instrument with strings.", "What do bees make?",
    "What is the opposite of cold?", "How many continents are there?", "What is a volcano?",
    "Why is exercise healthy?", "What language is spoken in Brazil?", "What is the sum of 15 and 27?",
]


def chat_prompts(engine: LLMEngine) -> list[list[int]]:
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"] for q in QUESTIONS]


def dequantized_model(engine: LLMEngine):
    """transformers' float32 model with the int8 engine's projections and output head as its kernels see them."""
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untie from the input table
    missing, unexpected = model.load_state_dict(engine.runner.model.cpu_forward.dequantized_weights(), strict=False)
    if unexpected or not all("norm" in name or "embed_tokens" in name or "bias" in name for name in missing):
        raise RuntimeError(f"the engine's weights do not map onto transformers' model: unexpected {unexpected}, "
                           f"missing {[n for n in missing if 'norm' not in n and 'embed_tokens' not in n]}")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--results-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    config = dict(model_path=str(MODEL), dtype="float32", kv_cache_bytes=256 << 20, max_model_len=1024)
    fp32 = LLMEngine(EngineConfig(**config))
    int8 = LLMEngine(EngineConfig(**config, quantization="int8"))
    prompts = chat_prompts(fp32)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0)
    want = [o.token_ids for o in fp32.generate(prompts, params)]
    got = [o.token_ids for o in int8.generate(prompts, params)]
    same = sum(a == b for a, b in zip(want, got))
    shared = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in zip(want, got)]

    reference = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    quantized = dequantized_model(int8)
    max_error, total_error, positions, argmax_differs = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for prompt, completion in zip(prompts, want):
            ids = torch.tensor([prompt + completion])
            a, b = reference(ids).logits[0], quantized(ids).logits[0]
            error = (a - b).abs()
            max_error = max(max_error, error.max().item())
            total_error += error.mean(-1).sum().item()
            positions += ids.shape[1]
            argmax_differs += int((a.argmax(-1) != b.argmax(-1)).sum())
    result = {
        "cpu": serving.cpu_info(), "model": MODEL.name, "prompts": len(prompts), "new_tokens": args.new_tokens,
        "greedy_identical_completions": same, "greedy_agreement": same / len(prompts),
        "mean_shared_leading_tokens": sum(shared) / len(shared),
        "logit_max_abs_error": max_error, "logit_mean_abs_error": total_error / positions,
        "positions": positions, "argmax_differs_at_positions": argmax_differs,
        "weight_bytes": {"float32": fp32.runner.model.cpu_forward.weight_bytes,
                         "int8": int8.runner.model.cpu_forward.weight_bytes},
        "differing": [{"question": q, "float32": fp32.tokenizer.decode(a), "int8": fp32.tokenizer.decode(b)}
                      for q, a, b in zip(QUESTIONS, want, got) if a != b],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "differing"}, indent=2))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / "int8_accuracy.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
