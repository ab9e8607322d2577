"""End to end on NVIDIA Dynamo: etcd + NATS + Dynamo's frontend (KV routing) + 2 of our workers (SmolLM2) on
localhost, called with the openai client (launch/dynamo/local.py, as scripts/serve_dynamo.sh runs them).

Opt-in (it takes minutes): it runs only with OMNI_DYNAMO_TESTS=1, and then needs the Dynamo packages
(`scripts/setup.sh --dynamo`: ai-dynamo-runtime in .venv, the frontend's venv, etcd-server and nats-server) and skips
without them. Run it with:

    scripts/setup.sh --dynamo
    OMNI_DYNAMO_TESTS=1 flock /tmp/omni-server-tests.lock .venv/bin/python -m pytest tests/serving/test_dynamo_e2e.py -q

What it proves: the frontend tokenizes and templates for our worker, which answers; a long shared prefix sent
again is routed to the worker that holds it (every repeat reports `usage.prompt_tokens_details.cached_tokens` > 0,
which our engine counts from its prefix cache, while a round-robin router would send every other repeat to the
cold worker), and the router's index applied our workers' KV events (its `kv_cache_events_applied` counter) with
none refused; a request only our worker refuses (n=2) is a 400 with the worker's message and the next one works; a
stream the client closes early ends the worker's handler, which logs that request's abort in the engine (the abort itself: tests/engine/test_dynamo_worker_units.py).
"""

from __future__ import annotations

import os
import re
import time
import urllib.request

import openai
import pytest

from omni_backend import paths

if os.environ.get("OMNI_DYNAMO_TESTS") != "1":
    pytest.skip("opt-in (minutes): set OMNI_DYNAMO_TESTS=1", allow_module_level=True)
pytest.importorskip("dynamo.llm", reason="the Dynamo worker's packages are not installed: scripts/setup.sh --dynamo")

from omni_backend.launch.dynamo.local import LocalDynamo, find_binary, frontend_python

pytestmark = [pytest.mark.dynamo, pytest.mark.server]

MODEL = str(paths.models_dir() / "SmolLM2-135M-Instruct")
SETTINGS = {"kv_cache_bytes": str(96 * 1024 * 1024), "max_num_seqs": "8", "dtype": "float32"}
SYSTEM = " ".join(f"Rule {i}: answer politely and mention the number {i * 7} when asked about item {i}."
                  for i in range(30))  # 656 tokens of shared prefix with the chat template


@pytest.fixture(scope="module")
def dynamo():
    try:
        find_binary("etcd"), find_binary("nats-server")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    if not frontend_python().exists():
        pytest.skip("Dynamo's frontend venv is missing: scripts/setup.sh --dynamo")
    deployment = LocalDynamo(MODEL, workers=2, router_mode="kv", settings=SETTINGS).start(ready_timeout_s=300)
    yield deployment
    deployment.stop()


def _events_applied(deployment: LocalDynamo) -> dict[str, int]:
    """The frontend router's `kv_cache_events_applied` by (event type, status), summed over workers."""
    with urllib.request.urlopen(f"http://127.0.0.1:{deployment.http_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, int] = {}
    for labels, value in re.findall(r"^dynamo_component_kv_cache_events_applied\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        key = "/".join(re.search(rf'{name}="([^"]*)"', labels).group(1) for name in ("event_type", "status"))
        counts[key] = counts.get(key, 0) + int(float(value))
    return counts


def test_the_openai_client_gets_an_answer_through_dynamo(dynamo):
    client = openai.OpenAI(base_url=dynamo.base_url, api_key="unused")
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=32,
        temperature=0)
    assert answer.choices[0].message.content == "The capital of France is Paris."
    assert answer.choices[0].finish_reason == "stop" and answer.usage.prompt_tokens == 37


def test_a_repeated_long_prefix_goes_to_the_worker_that_holds_it(dynamo):
    client = openai.OpenAI(base_url=dynamo.base_url, api_key="unused")
    cached = []
    for question in range(5):
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": f"Question {question}: what is item 3?"}],
            max_tokens=8, temperature=0)
        assert answer.usage.prompt_tokens > 600
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and all(c >= 640 for c in cached[1:]), cached  # 40 of 41 blocks of 16: the shared ones
    applied = _events_applied(dynamo)
    assert applied.get("stored/ok", 0) > 0, applied
    assert not {k: v for k, v in applied.items() if v and not k.endswith("/ok")}, applied


def test_a_refused_request_is_a_client_error_and_the_next_one_works(dynamo):
    client = openai.OpenAI(base_url=dynamo.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2)
    # the frontend answers "Bad Request" whoever refused it: the worker's log shows that it was ours
    _wait_for_worker_line(dynamo, "HTTP 400: sampling_options.n must be 1 on this worker, got 2")
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            temperature=0)
    assert answer.usage.completion_tokens == 4


def test_a_stream_the_client_closes_is_aborted_by_the_worker(dynamo):
    client = openai.OpenAI(base_url=dynamo.base_url, api_key="unused")
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a very long story."}], max_tokens=1500,
        stream=True, extra_body={"ignore_eos": True})
    for received, chunk in enumerate(stream, 1):
        if received == 5:
            break
    stream.close()
    # the frontend's request id (the chunks' `chatcmpl-<id>`) is the worker's context id, which its log line names
    line = f"(Dynamo's {chunk.id.removeprefix('chatcmpl-')}) ended by its caller; aborting it in the engine"
    _wait_for_worker_line(dynamo, line, timeout_s=120)  # the frontend tells the worker at its next chunk


def _wait_for_worker_line(deployment: LocalDynamo, line: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(line in deployment.log(f"worker{i}") for i in range(deployment.workers)):
            return
        time.sleep(0.2)
    pytest.fail(f"no worker logged {line!r}")
