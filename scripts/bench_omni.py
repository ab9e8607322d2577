#!/usr/bin/env python3
"""Spoken answers of Qwen2.5-Omni, in one process: our thinker engine feeding `OmniVoice` (talker engine and
code2wav, stages/omni_voice.py) at concurrency 1, 4 and 8, against transformers'
`Qwen2_5OmniForConditionalGeneration.generate` one request at a time, in the same run.

The Triton and front-door path for speech is not wired yet (issue 27, step 4): this measures the engines and
their batching, not the server. Every answer: a text question, greedy thinker reply of --reply tokens (EOS
ignored by ours), sampled talker codes (the generation config's sampling, seeded) up to --codes, code2wav with
its default settings (10 flow steps; chunks of two DiT blocks, then four, with one block of look-back and one of
look-ahead). Per concurrency c, c answers start together. Reported: time to first audio (p50, p99: from the start
to the answer's first waveform chunk), audio seconds produced per wall second, and for each answer whether its
first chunk came before its thinker's last token. One answer of each peer runs first as a warm-up (its numbers are
kept apart); then --rounds rounds, each ours at every concurrency and transformers (interleaved: a busy spell of a
shared machine hits both), with the 1-minute load average before and after; medians over the rounds, and the
ratios per round (median, min, max).
Writes benchmarks/results/omni.json and omni.png.

Usage: .venv/bin/python scripts/bench_omni.py [--model FOLDER] [--reply 32] [--codes 96] [--device cpu] [--rounds 3]
(default model: the tiny random Qwen2.5-Omni, built into a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_serving import cpu_info  # scripts/ is on sys.path when run as a script

from omni_backend import paths
from omni_backend import tensor_names as T
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.stages.code2wav import Code2WavSettings
from omni_backend.stages.omni_voice import OmniVoice
from omni_backend.stages.preprocess import Preprocessor
from omni_backend.stages.preprocess_media import MediaConfig
from omni_backend.stages.talker import TalkerSettings
from omni_backend.stages.tensors import string_tensor

RESULTS = paths.PROJECT_ROOT / "benchmarks" / "results"
QUESTIONS = ["Describe a sunrise over the sea.", "What is the capital of France?", "Tell me about volcanoes.",
             "How do bees make honey?", "Why is the sky blue?", "Name three planets.", "What is a prime number?",
             "Sing me a short song."]
CONCURRENCY = (1, 4, 8)


def prompts(folder: str) -> list[list[int]]:
    stage = Preprocessor.from_pretrained(folder, 2048, MediaConfig.from_parameters({"llm_model_path": folder}))
    return [stage.run({T.TEXT_INPUT: string_tensor(json.dumps([{"role": "user", "content": q}]))})["input_ids"].tolist()
            for q in QUESTIONS]


def ours(folder: str, questions: list[list[int]], concurrency: int, args) -> dict:
    thinker = LLMEngine(EngineConfig(model_path=folder, device=args.device, max_num_seqs=8, max_model_len=2048))
    voice = OmniVoice(folder, TalkerSettings(max_num_seqs=8, max_codec_tokens=args.codes, max_model_len=2048),
                      Code2WavSettings(), device=args.device)
    params = SamplingParams(max_tokens=args.reply, temperature=0.0, ignore_eos=True, stream=True,
                            return_hidden_states=True)
    start = time.perf_counter()
    first, thinker_end, samples = {}, {}, 0
    for i in range(concurrency):
        thinker.add_request(f"r{i}", questions[i % len(questions)], params)
        voice.start(f"r{i}", "Chelsie" if i % 2 == 0 else "Ethan", i, len(questions[i % len(questions)]))
    done = set()
    while len(done) < concurrency:
        for output in thinker.step():
            voice.push(output.request_id, output.hidden_states, output.input_embeds, output.finished)
            if output.finished:
                thinker_end[output.request_id] = time.perf_counter() - start
        for chunk in voice.step():
            if chunk.error:
                raise RuntimeError(chunk.error)
            first.setdefault(chunk.request_id, time.perf_counter() - start)
            samples += chunk.audio.numel()
            if chunk.final:
                done.add(chunk.request_id)
    wall = time.perf_counter() - start
    ttfa = sorted(first.values())
    return {"concurrency": concurrency, "wall_s": wall, "audio_s": samples / voice.code2wav.sample_rate,
            "audio_s_per_wall_s": samples / voice.code2wav.sample_rate / wall,
            "ttfa_p50_s": float(np.percentile(ttfa, 50)), "ttfa_p99_s": float(np.percentile(ttfa, 99)),
            "first_audio_before_thinker_end": sum(first[r] < thinker_end[r] for r in first),
            "code2wav_batch_sizes": dict(voice.code2wav.batch_sizes)}


def load_transformers(folder: str, questions: list[list[int]], args):
    """transformers' whole Qwen2.5-Omni (float32) on the device, warmed up by one untimed answer."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).to(args.device).eval()
    transformers_one_at_a_time(model, questions, 1, args)
    return model


def transformers_one_at_a_time(model, questions: list[list[int]], count: int, args) -> dict:
    start, samples = time.perf_counter(), 0
    with torch.no_grad():
        for i in range(count):
            ids = torch.tensor([questions[i % len(questions)]], device=args.device)
            torch.manual_seed(i)
            _, wav = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                    speaker="Chelsie" if i % 2 == 0 else "Ethan", thinker_max_new_tokens=args.reply,
                                    thinker_do_sample=False, talker_max_new_tokens=args.codes)
            samples += wav.numel()
    wall = time.perf_counter() - start
    return {"requests": count, "wall_s": wall, "audio_s": samples / 24000, "audio_s_per_wall_s": samples / 24000 / wall}


def plot(results: dict, path: Path) -> None:
    """Medians over the rounds: audio seconds per wall second against transformers', and time to first audio."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    rows = results["median"]["ours"]
    left.bar([str(r["concurrency"]) for r in rows], [r["audio_s_per_wall_s"] for r in rows], label="ours")
    left.axhline(results["median"]["transformers"]["audio_s_per_wall_s"], color="k", ls="--",
                 label="transformers, 1 at a time")
    left.set(xlabel="concurrency", ylabel="audio s / wall s (median of rounds)")
    left.legend()
    right.plot([r["concurrency"] for r in rows], [r["ttfa_p50_s"] for r in rows], "o-", label="p50")
    right.plot([r["concurrency"] for r in rows], [r["ttfa_p99_s"] for r in rows], "s--", label="p99")
    right.set(xlabel="concurrency", ylabel="time to first audio, s (median of rounds)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def medians(rounds: list[dict]) -> dict:
    """Per concurrency and for transformers, the median over the rounds of every number measured."""
    def median(rows: list[dict]) -> dict:
        return {key: float(np.median([row[key] for row in rows])) if isinstance(rows[0][key], float) else rows[0][key]
                for key in rows[0]}

    return {"ours": [median([r["ours"][i] for r in rounds]) for i in range(len(CONCURRENCY))],
            "transformers": median([r["transformers"] for r in rounds])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--reply", type=int, default=32)
    parser.add_argument("--codes", type=int, default=96)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    folder = args.model
    if not folder:
        from omni_backend.setup.tiny_hf_multimodal import build
        folder = str(build("qwen2_5_omni", Path(tempfile.mkdtemp()) / "tiny-omni", log=lambda _: None))
    questions = prompts(folder)
    results = {"model": args.model or "tiny random Qwen2.5-Omni", "device": args.device, "machine": cpu_info(),
               "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "reply_tokens": args.reply,
               "max_codec_tokens": args.codes, "rounds": [],
               "warmup": ours(folder, questions, 1, args)}  # first use of each shape and kernel, untimed below
    model = load_transformers(folder, questions, args)
    for _ in range(args.rounds):  # interleaved, so that a busy spell on a shared machine hits both sides alike
        load = os.getloadavg()[0]
        row = {"ours": [ours(folder, questions, c, args) for c in CONCURRENCY],
               "transformers": transformers_one_at_a_time(model, questions, max(CONCURRENCY), args)}
        row["load_average_1min"] = [load, os.getloadavg()[0]]
        row["speedup_at_8"] = row["ours"][-1]["audio_s_per_wall_s"] / row["transformers"]["audio_s_per_wall_s"]
        row["ttfa_p50_ratio_8_to_1"] = row["ours"][-1]["ttfa_p50_s"] / row["ours"][0]["ttfa_p50_s"]
        results["rounds"].append(row)
        print(json.dumps(row), flush=True)
    results["median"] = medians(results["rounds"])
    for key in ("speedup_at_8", "ttfa_p50_ratio_8_to_1"):
        values = [row[key] for row in results["rounds"]]
        results[key] = {"median": float(np.median(values)), "min": min(values), "max": max(values)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "omni.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS / "omni.png")
    print(json.dumps({key: results[key] for key in ("median", "speedup_at_8", "ttfa_p50_ratio_8_to_1")}, indent=2))


if __name__ == "__main__":
    main()
