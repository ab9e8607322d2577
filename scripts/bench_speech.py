#!/usr/bin/env python3
"""Speech benchmark: time to first audio and real-time factor at concurrency 1 and 4, through the OpenAI front
door on a real tritonserver (its own, on free ports).

Two workloads, each at concurrency 1 and 4:
  speech      POST /v1/audio/speech, streamed pcm: a fixed three-sentence paragraph (about 10 s of audio).
              Time to first audio = first body bytes; RTF = request wall time / audio duration.
  chat_audio  POST /v1/chat/completions with modalities [text, audio], streamed pcm16: the LLM writes (greedy,
              80 tokens) while finished phrases are spoken. Time to first audio = first `delta.audio.data`
              (includes preprocess, prefill and the first phrase); RTF = request wall time / audio duration
              (LLM time included).
Targets on this CPU (issue 6): first audio <= 1.0 s and RTF <= 0.1 at concurrency 1 (speech workload).
Writes benchmarks/results/speech.json.

Usage: .venv/bin/python scripts/bench_speech.py [--requests 8] [--chat-requests 4]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import statistics
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omni_backend import paths, repository
from omni_backend.stages.tts_audio import PCM_RATE
from omni_backend.launch.tritonserver import TritonServer
from omni_backend.launch.ports import free_ports

RESULTS = paths.PROJECT_ROOT / "benchmarks" / "results"
PARAGRAPH = ("The weather is nice and warm today, so we are going to the park after school. "
             "Please call me when you get home tonight. "
             "I would like a cup of coffee with milk, and a slice of bread with butter.")
CHAT_PROMPTS = ["Tell me a short story about a cat.", "Describe a day at the beach.",
                "Tell me about your favourite food.", "Describe a walk in the forest."]
TARGETS = {"first_audio_s": 1.0, "rtf": 0.1}


def post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                  headers={"Content-Type": "application/json"})


def speech_request(url: str) -> dict:
    started = time.perf_counter()
    first, size = None, 0
    with urllib.request.urlopen(post(url + "/v1/audio/speech", {"model": "tts-1", "input": PARAGRAPH, "voice": "alloy",
                                                                "response_format": "pcm"}), timeout=300) as response:
        while True:
            data = response.read1(65536)
            if not data:
                break
            if first is None:
                first = time.perf_counter() - started
            size += len(data)
    wall = time.perf_counter() - started
    audio = size / 2 / PCM_RATE
    return {"first_audio_s": first, "wall_s": wall, "audio_s": audio, "rtf": wall / audio}


def chat_audio_request(url: str, prompt: str) -> dict:
    body = {"model": "omni_chat", "messages": [{"role": "user", "content": prompt}], "max_tokens": 80,
            "temperature": 0, "stream": True, "modalities": ["text", "audio"],
            "audio": {"voice": "alloy", "format": "pcm16"}}
    started = time.perf_counter()
    first, size, last_text = None, 0, None
    with urllib.request.urlopen(post(url + "/v1/chat/completions", body), timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            audio = (event["choices"][0]["delta"].get("audio") or {}) if event["choices"] else {}
            if "data" in audio:
                first = first if first is not None else time.perf_counter() - started
                size += len(base64.b64decode(audio["data"]))
            if "transcript" in audio:
                last_text = time.perf_counter() - started
    wall = time.perf_counter() - started
    audio = size / 2 / PCM_RATE
    return {"first_audio_s": first, "llm_finished_s": last_text, "wall_s": wall, "audio_s": audio,
            "rtf": wall / audio}


def run(job, count: int, concurrency: int) -> dict:
    job(0)  # warm-up, not counted
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        samples = list(pool.map(job, range(count)))
    wall = time.perf_counter() - started

    def summary(key):
        values = [s[key] for s in samples if s.get(key) is not None]
        return {"mean": round(statistics.mean(values), 4), "p50": round(statistics.median(values), 4),
                "max": round(max(values), 4)}

    out = {"requests": count, "concurrency": concurrency, "first_audio_s": summary("first_audio_s"),
           "rtf": summary("rtf"), "audio_s_total": round(sum(s["audio_s"] for s in samples), 2),
           "wall_s": round(wall, 2), "aggregate_rtf": round(wall / sum(s["audio_s"] for s in samples), 4)}
    if "llm_finished_s" in samples[0]:
        out["llm_finished_s"] = summary("llm_finished_s")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8, help="speech requests per concurrency level")
    parser.add_argument("--chat-requests", type=int, default=4, help="chat-audio requests per concurrency level")
    args = parser.parse_args()

    import uvicorn

    from omni_backend.serving import ServingConfig, create_app

    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "model_repository"
        repository.render_repository(repo, models=["preprocess", "llm", "postprocess", "omni_chat", "tts"],
                                     kv_cache_bytes=64 << 20, max_num_seqs=8)
        http, grpc, metrics, door_port = free_ports(4)
        with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, exit_timeout_s=5,
                          log_file=Path(tmp) / "tritonserver.log") as server:
            config = ServingConfig(triton_grpc=server.grpc_url, triton_http=server.http_url,
                                   triton_metrics_url=server.metrics_url, port=door_port)
            door = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=door_port,
                                                 log_level="warning"))
            thread = threading.Thread(target=door.run, daemon=True)
            thread.start()
            while not door.started:
                time.sleep(0.05)
            url = f"http://127.0.0.1:{door_port}"
            results = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU",
                       "voice": "joe (Piper en_US-joe-medium, 22,050 Hz)", "targets_concurrency_1": TARGETS,
                       "speech": {}, "chat_audio": {}}
            for concurrency in (1, 4):
                stats = run(lambda i: speech_request(url), args.requests, concurrency)
                results["speech"][f"concurrency_{concurrency}"] = stats
                print(f"speech c={concurrency}: first audio p50 {stats['first_audio_s']['p50']:.3f} s, "
                      f"RTF p50 {stats['rtf']['p50']:.3f}", flush=True)
            for concurrency in (1, 4):
                stats = run(lambda i: chat_audio_request(url, CHAT_PROMPTS[i % len(CHAT_PROMPTS)]),
                            args.chat_requests, concurrency)
                results["chat_audio"][f"concurrency_{concurrency}"] = stats
                print(f"chat_audio c={concurrency}: first audio p50 {stats['first_audio_s']['p50']:.3f} s, "
                      f"LLM finished p50 {stats['llm_finished_s']['p50']:.3f} s, RTF p50 {stats['rtf']['p50']:.3f}",
                      flush=True)
            door.should_exit = True
            thread.join(timeout=10)
    single = results["speech"]["concurrency_1"]
    results["meets_targets"] = {"first_audio_s": single["first_audio_s"]["max"] <= TARGETS["first_audio_s"],
                                "rtf": single["rtf"]["max"] <= TARGETS["rtf"]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "speech.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS / 'speech.json'}: meets targets {results['meets_targets']}")


if __name__ == "__main__":
    main()
