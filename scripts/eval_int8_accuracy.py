"""Accuracy of the weight-only int8 mode (quantization "int8", kernels/linear_int8.cpp) against float32, on
SmolLM2-135M.

Measured over 50 chat prompts (the model's chat template over the questions below), greedy:
- agreement: the int8 engine's and the float32 engine's completions (--new-tokens each, EOS ends one), the share of
  prompts whose completions are identical and the mean number of leading tokens they share;
- logit error: transformers' model with the engine's dequantized int8 weights (q * s + m, what the int8 kernels
  multiply by; on CPUs with VNNI they also round each activation to 15 bits per group of 32, which this leaves out,
  the greedy agreement above has it) against the float32 model, over every position of each prompt followed by the
  float32 completion (teacher forcing): max and mean absolute logit difference, and how often the argmax differs;
- with --groups, instead: what other int8 grids give, simulated. transformers' float32 model with its projections
  and head quantized and dequantized in torch (`fake_quantize`: one grid per `group` consecutive inputs of an
  output row, as llama.cpp's Q8_0 / Q4_1 (32) and AWQ (128) group, 0 per channel; --schemes: symmetric,
  asymmetric, or "two-grid", the engine's, whose distance from the engine's weights is recorded) generates
  greedily (all prompts in one left-padded batch, ended at <|im_end|>), against the same model unquantized, padded
  alike: identical completions and mean shared leading tokens per scheme and group size. A group must divide every
  projection's input width (SmolLM2-135M: 576 and 1536, so 32 or 64, not 128).
Writes benchmarks/results/int8_accuracy.json (with --groups: int8_groups.json); names the CPU.

    PYTHONPATH=$PWD .venv/bin/python scripts/eval_int8_accuracy.py        # about 3 minutes on 2 cores
    PYTHONPATH=$PWD .venv/bin/python scripts/eval_int8_accuracy.py --groups 32 --schemes symmetric asymmetric two-grid
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


def fake_quantize(weight: torch.Tensor, group: int, scheme: str = "symmetric") -> torch.Tensor:
    """float32 [N, K] -> the float32 [N, K] that int8 with one grid per `group` consecutive inputs of each row
    gives back. "symmetric": s = max |W| over the group / 127, q = W / s rounded half to even, in [-127, 127],
    back as q * s (group 0: one scale per row, the engine's int8 before groups, bit for bit). "asymmetric": uint8
    q with a scale and a minimum per group (m = min W, s = (max W - m) / 255, q = (W - m) / s rounded, in
    [0, 255]), back as q * s + m; a Q4_1 block (w = d * q4 + m, q4 in 0..15, both ends used) comes back as q = 17 * q4. "two-grid":
    what kernels/linear_int8.cpp packs, per group the closer (largest error; asymmetric on a tie) of the asymmetric
    grid and the symmetric one in the same uint8 form (m = -128 s), which holds a Q8_0 block (SmolLM2's embedding
    table, its tied head) exactly. A constant group gets s = 0. Raises ValueError when `group` does not divide K."""
    n, k = weight.shape
    group = group or k
    if k % group:
        raise ValueError(f"group {group} does not divide the input width {k}")
    w = weight.reshape(n, k // group, group)

    def on_grid(scale: torch.Tensor, low: torch.Tensor, top: int) -> torch.Tensor:
        q = torch.where(scale > 0, torch.round((w - low) / torch.where(scale > 0, scale, 1.0)), 0.0).clamp(0, top)
        return q * scale + low

    symmetric = w.abs().amax(-1, keepdim=True) / 127.0
    if scheme == "symmetric":
        q = torch.where(symmetric > 0, torch.round(w / torch.where(symmetric > 0, symmetric, 1.0)), 0.0)
        return (q.clamp(-127, 127) * symmetric).reshape(n, k)
    low = w.amin(-1, keepdim=True)
    spread = on_grid((w.amax(-1, keepdim=True) - low) / 255.0, low, 255)
    if scheme == "asymmetric":
        return spread.reshape(n, k)
    centred = on_grid(symmetric, -128 * symmetric, 255)
    closer = (centred - w).abs().amax(-1, keepdim=True) < (spread - w).abs().amax(-1, keepdim=True)
    return torch.where(closer, centred, spread).reshape(n, k)


def greedy(model, prompts: list[list[int]], new_tokens: int, eos: int) -> list[list[int]]:
    """transformers' greedy completions, all prompts in one left-padded batch (the models compared get the same
    padding), each cut after its first `eos`."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             top_p=None, top_k=None, temperature=None, pad_token_id=eos, eos_token_id=eos)
    completions = []
    for row in out[:, width:].tolist():
        completions.append(row[:row.index(eos) + 1] if eos in row else row)
    return completions


def agreement(want: list[list[int]], got: list[list[int]]) -> tuple[int, float]:
    """(identical completions, mean number of leading tokens shared)."""
    shared = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in zip(want, got)]
    return sum(a == b for a, b in zip(want, got)), sum(shared) / len(shared)


def simulated_groups(reference, engine_weights: dict[str, torch.Tensor], groups: list[int], schemes: list[str],
                     prompts: list[list[int]], new_tokens: int, eos: int) -> dict:
    """Greedy agreement of `reference` (float32 transformers model) with copies whose weights named in
    `engine_weights` (the int8 engine's dequantized weights: which tensors it quantizes) are `fake_quantize`d per
    group size and scheme ({scheme: {group: result}}); "two-grid" in groups of 32 records how far its weights are
    from the engine's (float32 roundings only: the engine fuses q * s + m)."""
    originals = {name: (reference.get_input_embeddings().weight if name == "lm_head.weight" else
                        reference.get_parameter(name)).detach() for name in engine_weights}
    want = greedy(reference, prompts, new_tokens, eos)
    out: dict = {}
    for scheme in schemes:
        for group in groups:
            weights = {name: fake_quantize(w, group, scheme) for name, w in originals.items()}
            model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untie from the input
            model.load_state_dict(weights, strict=False)
            same, shared = agreement(want, greedy(model, prompts, new_tokens, eos))
            result = out.setdefault(scheme, {})[str(group)] = {"identical_completions": same,
                                                                "mean_shared_leading_tokens": shared}
            if scheme == "two-grid" and group == 32:
                result["max_abs_difference_from_engine"] = max((weights[n] - engine_weights[n]).abs().max().item()
                                                               for n in weights)
            print(f"{scheme} group {group or 'per channel'}: {same}/{len(prompts)} identical, {shared:.1f} leading "
                  f"tokens shared", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--results-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--groups", type=int, nargs="*", default=[],
                        help="instead: simulate per-group scales of these sizes in transformers (0: per channel), "
                             "into int8_groups.json")
    parser.add_argument("--schemes", nargs="+", choices=["symmetric", "asymmetric", "two-grid"],
                        default=["two-grid"],
                        help="with --groups: the int8 grids to simulate (fake_quantize)")
    args = parser.parse_args()
    config = dict(model_path=str(MODEL), dtype="float32", kv_cache_bytes=256 << 20, max_model_len=1024)
    fp32 = LLMEngine(EngineConfig(**config))
    int8 = LLMEngine(EngineConfig(**config, quantization="int8"))
    prompts = chat_prompts(fp32)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    if args.groups:
        reference = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
        result = {"cpu": serving.cpu_info(), "model": MODEL.name, "prompts": len(prompts),
                  "new_tokens": args.new_tokens, "how": "transformers float32, weights fake-quantized per group, "
                  "greedy in one left-padded batch against the unquantized model padded alike",
                  "groups": simulated_groups(reference, int8.runner.model.cpu_forward.dequantized_weights(),
                                             args.groups, args.schemes, prompts, args.new_tokens,
                                             fp32.tokenizer.convert_tokens_to_ids("<|im_end|>"))}
        out = args.results_dir / "int8_groups.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
        return
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0)
    want = [o.token_ids for o in fp32.generate(prompts, params)]
    got = [o.token_ids for o in int8.generate(prompts, params)]
    same, shared = agreement(want, got)

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
        "int8_kernel": int8.runner.model.cpu_forward.linear.int8_kernel, "greedy_identical_completions": same,
        "greedy_agreement": same / len(prompts),
        "mean_shared_leading_tokens": shared,
        "logit_max_abs_error": max_error, "logit_mean_abs_error": total_error / positions,
        "positions": positions, "argmax_differs_at_positions": argmax_differs,
        "weight_bytes": {"float32": fp32.runner.model.cpu_forward.weight_bytes,
                         "int8": int8.runner.model.cpu_forward.weight_bytes},
        "differing": [{"question": q, "float32": fp32.tokenizer.decode(a), "int8": fp32.tokenizer.decode(b)}
                      for q, a, b in zip(QUESTIONS, want, got) if a != b],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "differing"}, indent=2))
    out = args.results_dir / "int8_accuracy.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
