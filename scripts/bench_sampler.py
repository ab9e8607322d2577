#!/usr/bin/env python3
"""Benchmark token sampling: the sampler on the logits' device (omni_backend/engine/sampler.py) against the
pre-#14 CPU sampler (tests/engine/sampler_reference.py, what the engine ran before), in the same run.

One step = one call for a batch of --batch rows (default 64). Cases: greedy; temperature only (T 0.8); top_p
0.9 at T 0.8; top_k 50; min_p 0.05; penalties (repetition 1.2, presence 0.5, frequency 0.3 over a history of
prompt + 128 generated tokens, with the top-p case's sampling); seeded top-p (seed = row); top-p with
logprobs 5. Vocabularies 49152 and 128256.

Logits (the nucleus size decides the cost, so they must be realistic):
- 49152, "real": SmolLM2-135M-Instruct's next-token logits (fp32, transformers) for 64 varied chat prompts and
  the 3 steps after them (continuations sampled at T 0.8, top_p 0.9): 4 steps of [64, 49152].
- 128256, "real + tail": no real model of that vocabulary is available offline, so each real row gets 79104
  more tokens whose logits are drawn with replacement from that row's lower half (+ N(0, 0.1) jitter, so values
  do not repeat exactly), and one fixed random permutation spreads the real tokens over the 128256 columns:
  the head (nucleus) is real, the tail is larger as in a bigger vocabulary.
- "synthetic" (a GPU machine without our checkpoint or transformers' model files, --source synthetic, and
  --quick): each row's logits follow a power law over ranks, x_r = -a ln(1 + r), in a random token order per
  row; a is set per row (by bisection) in the middle of the interval in which the row keeps exactly a target
  number of tokens at T 0.8 and top_p 0.9.
  The targets are the real sources' nucleus sizes at the 64 quantiles (i + 0.5) / 64 (REAL_NUCLEUS, measured
  by this script and recorded in its JSON under "nucleus_sizes"), one per row.
- Worst case, reported apart: N(0, 1) logits. Nearly flat, so top-p and min-p keep thousands of tokens and the
  new sampler falls back to the full sort.
The JSON records, per source, the nucleus-size quantiles and the share of rows keeping more than 64 and 1024
tokens (those redo their draw with more candidates, then with the full sort).

Timing: wall clock per call around a synchronized device (the sampler returns host lists, so a call ends with
its results on the host); the reference gets `logits.cpu()` inside the timed call on a GPU, as the engine did.
Rounds are interleaved over vocabularies, cases and the two samplers (which one goes first alternates), each
round on the next step's logits, after one warm-up call each; reported: medians and minima (ms) and the ratio
reference / new of the medians. On CUDA the rounds stop once --time-limit-s has passed (at least 3), so the
whole run fits a GPU check's budget of about 60 s.

Writes JSON (--output, default $OUT/sampler.json when OUT is set, else benchmarks/results/sampler.json; --quick
writes only with --output) with the machine (CPU model and flags from /proc/cpuinfo, cores, torch threads, GPU,
load average and CPU pressure before and after) and, for a full CPU run, a plot next to it (.png).

Usage:
  .venv/bin/python scripts/bench_sampler.py [--rounds 7] [--note "machine shared with ..."]
  python3 scripts/bench_sampler.py --device cuda --output $OUT/sampler.json
  .venv/bin/python scripts/bench_sampler.py --quick     (batch 8, 1 round, synthetic logits: a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "engine"))

from omni_backend import paths  # noqa: E402
from omni_backend.engine.sampler import Sampler  # noqa: E402
from omni_backend.engine.sampling_params import SamplingParams  # noqa: E402
from omni_backend.engine.sequence import Sequence  # noqa: E402
from omni_backend.ops.memory_env import reexec_with_memory_environment  # noqa: E402
from sampler_reference import Sampler as ReferenceSampler  # noqa: E402

VOCABS = (49152, 128256)
TEMPERATURE, TOP_P = 0.8, 0.9
CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=TEMPERATURE),
    "top_p": dict(temperature=TEMPERATURE, top_p=TOP_P),
    "top_k": dict(top_k=50),
    "min_p": dict(min_p=0.05),
    "penalties": dict(temperature=TEMPERATURE, top_p=TOP_P, repetition_penalty=1.2, presence_penalty=0.5,
                      frequency_penalty=0.3),
    "seeded_top_p": dict(temperature=TEMPERATURE, top_p=TOP_P, seed=0),
    "logprobs": dict(temperature=TEMPERATURE, top_p=TOP_P, logprobs=5),
}
WORST_CASES = ("top_p", "min_p", "seeded_top_p")
STEPS = 4
GENERATED = 128
"""Generated tokens in each row's history (what the penalties read)."""
CPU_TARGET_MS, GPU_TARGET_MS = 20.0, 0.5
"""Targets for the top-p case at batch 64 (issue #14)."""

REAL_NUCLEUS = [1] * 21 + [2] * 8 + [3] * 5 + [4] * 3 + [5] * 3 + [
    6, 7, 8, 9, 11, 12, 14, 15, 16, 17, 19, 22, 23, 24, 29, 32, 37, 41, 46, 51, 56, 63, 87, 137]
"""Tokens kept at T 0.8, top_p 0.9 by the real rows (256: 64 prompts x 4 steps) at the 64 quantiles
(i + 0.5) / 64, from this script's JSON ("nucleus_sizes" -> "quantiles_64"), the same for 49152 (real) and
128256 (real + tail, whose extra tokens carry too little mass to change a nucleus): the synthetic targets."""

PROMPTS = [
    "Tell me a story about a dragon.", "What is the capital of France?", "Write a haiku about autumn leaves.",
    "Explain how a transistor works.", "Give me three ideas for a birthday party.", "What is 17 times 23?",
    "Describe your ideal vacation.", "Write a product description for a water bottle.", "Who painted the Mona Lisa?",
    "Suggest a name for a coffee shop.", "How do I boil an egg?", "Write a limerick about a cat.",
    "What causes rain?", "List five animals that live in the ocean.", "Translate 'thank you' into German.",
    "Why do we dream?", "Write the opening line of a mystery novel.", "What is a prime number?",
    "Give me a motivational quote.", "How does a bicycle stay upright?", "Invent a new holiday and describe it.",
    "What is the tallest mountain on Earth?", "Write a short poem about the moon.", "Explain recursion to a child.",
    "What should I cook for dinner tonight?", "Describe the color blue without naming it.",
    "What are the benefits of exercise?", "Write a tweet announcing a new smartphone.", "What is photosynthesis?",
    "Tell me a joke about computers.", "How many legs does a spider have?", "Write a thank-you note to a teacher.",
    "Summarize the plot of Romeo and Juliet.", "What is the difference between weather and climate?",
    "Write a Python function that reverses a string.", "Give me tips for a job interview.",
    "What is the speed of light?", "Compose a short lullaby.", "Explain what a black hole is.",
    "List the planets of the solar system.", "How do vaccines work?", "Write a dialogue between a robot and a cat.",
    "What is the meaning of the word 'serendipity'?", "Plan a three-day trip to Rome.",
    "Why is the ocean salty?", "Describe a sunset over the desert.", "What are three uses of baking soda?",
    "Write a riddle and its answer.", "How do airplanes fly?", "Recommend a book for a teenager.",
    "Explain inflation in simple terms.", "Write a short speech for a wedding toast.",
    "What is the largest animal on Earth?", "Describe the smell of rain.", "How can I improve my sleep?",
    "Write a four-line poem about coffee.", "What is machine learning?", "Name three famous composers.",
    "What happens when you mix red and blue?", "Give me a fun fact about honey.",
    "Write an apology email for a late reply.", "What is the Pythagorean theorem?",
    "Invent a superhero and describe their powers.", "How do bees make honey?",
]


def main() -> None:
    reexec_with_memory_environment()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="where the logits live: cpu or cuda (default cpu)")
    parser.add_argument("--batch", type=int, default=64, help="rows per step (default 64)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per case and sampler (default 7)")
    parser.add_argument("--source", choices=["auto", "real", "synthetic"], default="auto",
                        help="logits: real SmolLM2 (+ tail for 128256), synthetic, or real when the checkpoint "
                             "and transformers are there (default auto)")
    parser.add_argument("--time-limit-s", type=float, default=None,
                        help="stop the rounds once this many seconds have passed, after at least 3 (default: "
                             "25 on CUDA, none on the CPU)")
    parser.add_argument("--quick", action="store_true", help="batch 8, 1 round, synthetic logits (a smoke run)")
    parser.add_argument("--output", default=None, help="JSON path")
    parser.add_argument("--note", default="", help="free text stored in the JSON (e.g. that the machine was shared)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_sampler.py: --device cuda but torch sees no CUDA device")
    if args.quick:
        args.batch, args.rounds, args.source = 8, 1, "synthetic"
    time_limit = args.time_limit_s if args.time_limit_s is not None else (25.0 if device.type == "cuda" else None)
    output = args.output
    if output is None and not args.quick:
        output = str(Path(os.environ["OUT"]) / "sampler.json" if os.environ.get("OUT")
                     else ROOT / "benchmarks" / "results" / "sampler.json")

    started = time.perf_counter()
    machine = machine_info(device)
    gen = torch.Generator().manual_seed(0)
    real = None if args.source == "synthetic" else real_logits(args.batch)
    if args.source == "real" and real is None:
        sys.exit("bench_sampler.py: --source real needs the SmolLM2 checkpoint (scripts/setup.sh) and transformers")
    sources, histories = {}, {}
    for vocab in VOCABS:
        if real is not None:
            steps, prompts = real
            if vocab != steps[0].shape[1]:
                steps = with_tail(steps, vocab, gen)
            sources[vocab] = ("real" if vocab == 49152 else "real + tail", [s.to(device) for s in steps])
        else:
            prompts = [torch.randint(0, vocab, (40,), generator=gen).tolist() for _ in range(args.batch)]
            sources[vocab] = ("synthetic", synthetic_logits(vocab, args.batch, gen, device))
        histories[vocab] = [p + torch.randint(0, vocab, (GENERATED,), generator=gen).tolist() for p in prompts]
    worst = {vocab: [torch.randn(args.batch, vocab, generator=gen).to(device) for _ in range(2)] for vocab in VOCABS}

    nucleus = {vocab: nucleus_summary(torch.cat(steps)) for vocab, (_, steps) in sources.items()}
    nucleus_worst = {vocab: nucleus_summary(torch.cat(steps)) for vocab, steps in worst.items()}
    jobs = [("typical", vocab, case, steps) for vocab, (_, steps) in sources.items() for case in CASES]
    jobs += [("worst", vocab, case, steps) for vocab, steps in worst.items() for case in WORST_CASES]
    runs = run_rounds(jobs, histories, args.rounds, device, time_limit)

    result = {
        "batch": args.batch, "device": str(device), "machine": machine, "note": args.note,
        "timing": "wall clock per call (ms), device synchronized; medians over interleaved rounds",
        "rounds": min(len(r["new"]) for r in runs.values()),
        "sources": {str(vocab): label for vocab, (label, _) in sources.items()},
        "nucleus_sizes": {str(v): s for v, s in nucleus.items()},
        "nucleus_sizes_worst": {str(v): s for v, s in nucleus_worst.items()},
        "typical": summarize(runs, "typical"), "worst": summarize(runs, "worst"),
    }
    target = GPU_TARGET_MS if device.type == "cuda" else CPU_TARGET_MS
    result["target_top_p_ms"] = target
    result["target_top_p_met"] = {v: c["top_p"]["new_ms"] <= target for v, c in result["typical"].items()}
    result["machine"]["load_after"] = load()
    result["seconds"] = round(time.perf_counter() - started, 1)
    report(result)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {output}")
        if device.type == "cpu" and not args.quick:
            plot(result, Path(output).with_suffix(".png"))


def machine_info(device: torch.device) -> dict:
    """CPU model and flags (/proc/cpuinfo), cores, torch version and threads, GPU name, current load."""
    info = {"platform": platform.platform(), "cores": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for key, name in (("model name", "cpu_model"), ("flags", "cpu_flags")):
        value = next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), None)
        info[name] = value.split() if key == "flags" and value else value
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    info["load_before"] = load()
    return info


def load() -> dict:
    """1/5/15-minute load average and CPU pressure (share of time some task waited for a CPU), if readable."""
    out = {}
    for key, path in (("loadavg", "/proc/loadavg"), ("cpu_pressure", "/proc/pressure/cpu")):
        try:
            out[key] = Path(path).read_text().splitlines()[0]
        except OSError:
            pass
    return out


def real_logits(batch: int) -> tuple[list[torch.Tensor], list[list[int]]] | None:
    """SmolLM2's next-token logits for `batch` chat prompts (PROMPTS, cycled) and the STEPS - 1 steps after
    them, continuations sampled at T 0.8 and top_p 0.9 (seeded): STEPS float32 [batch, 49152] CPU tensors and
    the prompts' token ids. None when the checkpoint or transformers is missing."""
    checkpoint = paths.models_dir() / "SmolLM2-135M-Instruct"
    if not (checkpoint / "config.json").exists():
        return None
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        return None
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                           add_generation_prompt=True, tokenize=False) for i in range(batch)]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**encoded, do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, max_new_tokens=STEPS,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])]
    return [step.float() for step in out.logits], prompts


def with_tail(steps: list[torch.Tensor], vocab: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Real [B, V0] logits widened to `vocab` tokens: each row's extra tokens take values drawn with replacement
    from the row's lower half, plus N(0, 0.1) jitter; one fixed random permutation of the columns spreads the
    real tokens over the vocabulary."""
    order = torch.randperm(vocab, generator=gen)
    out = []
    for logits in steps:
        rows, known = logits.shape
        lower = logits.sort(dim=-1).values[:, :known // 2]
        picks = torch.randint(0, known // 2, (rows, vocab - known), generator=gen)
        extra = lower.gather(1, picks) + 0.1 * torch.randn(rows, vocab - known, generator=gen)
        out.append(torch.cat([logits, extra], dim=1)[:, order].contiguous())
    return out


def nucleus_sizes(logits: torch.Tensor, ranked: bool = False) -> torch.Tensor:
    """int64 [B]: tokens each row keeps at T 0.8 and top_p 0.9 (logits [B, V]; ranked: already descending)."""
    if not ranked:
        logits = logits.sort(dim=-1, descending=True).values
    probs = torch.softmax(logits / TEMPERATURE, dim=-1)
    return ((probs.cumsum(dim=-1) - probs) < TOP_P).sum(dim=-1)


def nucleus_summary(logits: torch.Tensor) -> dict:
    """Nucleus-size quantiles of the rows of [B, V] logits, the 64 quantiles (i + 0.5) / 64, and the shares of
    rows keeping more than 64 and 1024 tokens."""
    sizes = nucleus_sizes(logits).cpu().double()

    def quantiles(qs):
        return [round(v) for v in torch.quantile(sizes, torch.tensor(qs, dtype=torch.float64)).tolist()]

    return {"rows": sizes.numel(),
            "quantiles": dict(zip(["min", "p25", "median", "p75", "p90", "p99", "max"],
                                  quantiles([0, 0.25, 0.5, 0.75, 0.9, 0.99, 1]))),
            "share_over_64": round((sizes > 64).double().mean().item(), 3),
            "share_over_1024": round((sizes > 1024).double().mean().item(), 3),
            "quantiles_64": quantiles([(i + 0.5) / 64 for i in range(64)])}


def synthetic_logits(vocab: int, batch: int, gen: torch.Generator, device: torch.device) -> list[torch.Tensor]:
    """STEPS [batch, vocab] tensors on `device` whose rows keep REAL_NUCLEUS tokens at T 0.8 and top_p 0.9:
    x_r = -a ln(1 + r) over ranks r, in a random token order per row. A larger a keeps fewer tokens; a row that
    must keep t gets the middle of the interval of a that keeps exactly t (its ends by bisection), so its
    cumulative masses are not pinned to top_p. Step s gives row i the target of quantile
    (i * 64 // batch + 16 s) mod 64."""
    ranks = torch.arange(vocab, device=device, dtype=torch.float32).log1p()
    counts = sorted(set(REAL_NUCLEUS) | {t - 1 for t in REAL_NUCLEUS if t > 1} | {2})
    low = torch.zeros(len(counts), 1, device=device)
    high = torch.full((len(counts), 1), 64.0, device=device)
    limit = torch.tensor(counts, device=device)
    for _ in range(24):  # high: the smallest a keeping at most `count` tokens
        mid = (low + high) / 2
        too_many = (nucleus_sizes(-mid * ranks, ranked=True) > limit).unsqueeze(1)
        low, high = torch.where(too_many, mid, low), torch.where(too_many, high, mid)
    edge = dict(zip(counts, high.squeeze(1).tolist()))
    middle = {t: (edge[t] + edge[t - 1]) / 2 if t > 1 else edge[1] + (edge[1] - edge[2]) / 2
              for t in set(REAL_NUCLEUS)}
    out = []
    for step in range(STEPS):
        a = torch.tensor([[middle[REAL_NUCLEUS[(i * 64 // batch + 16 * step) % 64]]] for i in range(batch)],
                         device=device)
        order = torch.argsort(torch.rand(batch, vocab, generator=gen), dim=-1).to(device)
        out.append(torch.empty(batch, vocab, device=device).scatter_(1, order, -a * ranks))
    return out


def sequences(case: dict, histories: list[list[int]], reference: bool) -> list[Sequence]:
    """One sequence per history (40-ish prompt tokens, then GENERATED generated ones) with the case's settings;
    seeded cases seed row i with i; the reference's seeded rows get the CPU generator it expects."""
    seqs = []
    for row, history in enumerate(histories):
        params = SamplingParams(**{**case, "seed": row} if "seed" in case else case)
        seq = Sequence(str(row), history[:-GENERATED], params, 0.0)
        seq.token_ids += history[-GENERATED:]
        if reference and params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        seqs.append(seq)
    return seqs


def run_rounds(jobs: list, histories: dict, rounds: int, device: torch.device,
               time_limit: float | None) -> dict:
    """Time every job (kind, vocab, case, steps) with both samplers: one warm-up call each, then `rounds`
    interleaved rounds (fewer when time_limit passes, at least 3); round r uses steps[r % len(steps)].
    Returns {(kind, vocab, case): {"new": [ms...], "reference": [ms...]}}."""
    ours, reference = Sampler(), ReferenceSampler()
    peers = {}
    for kind, vocab, case, steps in jobs:
        batch = steps[0].shape[0]
        new_seqs = sequences(CASES[case], histories[vocab][:batch], reference=False)
        ref_seqs = sequences(CASES[case], histories[vocab][:batch], reference=True)
        peers[kind, vocab, case] = {
            "new": lambda logits, s=new_seqs: ours(logits, s),
            "reference": lambda logits, s=ref_seqs: reference(logits.cpu(), s)}
    runs = {key: {"new": [], "reference": []} for key in peers}
    start = time.perf_counter()
    for r in range(-1, rounds):
        for kind, vocab, case, steps in jobs:
            logits = steps[max(r, 0) % len(steps)]
            order = ("new", "reference") if r % 2 else ("reference", "new")
            for name in order:
                elapsed = timed(peers[kind, vocab, case][name], logits, device)
                if r >= 0:
                    runs[kind, vocab, case][name].append(elapsed)
        if time_limit is not None and r >= 2 and time.perf_counter() - start > time_limit:
            break
    return runs


def timed(fn, logits: torch.Tensor, device: torch.device) -> float:
    """Milliseconds of one call of fn(logits), the device idle before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn(logits)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def summarize(runs: dict, kind: str) -> dict:
    """{vocab: {case: medians, minima, ratio, runs}} for one kind of logits."""
    out: dict = {}
    for (k, vocab, case), times in runs.items():
        if k != kind:
            continue
        new, ref = statistics.median(times["new"]), statistics.median(times["reference"])
        out.setdefault(str(vocab), {})[case] = {
            "new_ms": round(new, 3), "reference_ms": round(ref, 3), "reference_over_new": round(ref / new, 1),
            "new_min_ms": round(min(times["new"]), 3), "reference_min_ms": round(min(times["reference"]), 3),
            "new_runs_ms": [round(t, 3) for t in times["new"]],
            "reference_runs_ms": [round(t, 3) for t in times["reference"]]}
    return out


def report(result: dict) -> None:
    print(f"device {result['device']}, batch {result['batch']}, {result['rounds']} rounds, "
          f"torch threads {result['machine']['torch_threads']}, {result['machine'].get('cpu_model')}")
    for kind in ("typical", "worst"):
        for vocab, cases in result[kind].items():
            label = result["sources"][vocab] if kind == "typical" else "N(0, 1) worst case"
            sizes = (result["nucleus_sizes"] if kind == "typical" else result["nucleus_sizes_worst"])[vocab]
            print(f"\n{vocab} tokens, {label}; nucleus at T 0.8 / top_p 0.9: median {sizes['quantiles']['median']}, "
                  f"p99 {sizes['quantiles']['p99']}, > 64: {sizes['share_over_64']:.0%}")
            print(f"  {'case':14s} {'new ms':>10s} {'reference ms':>13s} {'ratio':>7s}")
            for case, r in cases.items():
                print(f"  {case:14s} {r['new_ms']:10.3f} {r['reference_ms']:13.1f} {r['reference_over_new']:6.1f}x")
    print(f"\ntop-p target {result['target_top_p_ms']} ms met: {result['target_top_p_met']}")


def plot(result: dict, path: Path) -> None:
    """Bars (log scale) of the medians per case, new against reference, one panel per vocabulary."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vocabs = list(result["typical"])
    fig, axes = plt.subplots(1, len(vocabs), figsize=(6 * len(vocabs), 4.4), sharey=True)
    for ax, vocab in zip(axes, vocabs):
        cases = result["typical"][vocab]
        names = list(cases)
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [cases[n]["reference_ms"] for n in names], 0.4, label="pre-#14 (CPU sort)")
        ax.bar([x + 0.2 for x in xs], [cases[n]["new_ms"] for n in names], 0.4, label="on the logits' device")
        ax.axhline(result["target_top_p_ms"], color="gray", linestyle="--", linewidth=1, label="top-p target")
        ax.set_yscale("log")
        ax.set_xticks(list(xs), names, rotation=45, ha="right")
        ax.set_title(f"{vocab} tokens ({result['sources'][vocab]}), batch {result['batch']}")
    axes[0].set_ylabel("ms per step (median)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", ncol=3)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
