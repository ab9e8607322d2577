"""The official openai client (sync and async, streamed and not) against the front door over the real stack."""

import asyncio

import pytest
import tritonclient.grpc as grpcclient
from helpers.chat_client import chat_messages, make_inputs, stream_infer
from helpers.front_door import MODEL
from helpers.frontdoor_http import sse
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

pytestmark = pytest.mark.server

QUESTION = "What is the capital of France?"


def test_greedy_chat_equals_direct_triton(triton_server, openai_client):
    direct = stream_infer(triton_server.grpc_url, {"text_input": chat_messages(QUESTION), "max_tokens": 24,
                                                   "temperature": 0.0})
    assert direct.error is None
    answer = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=24, temperature=0)
    assert answer.choices[0].message.content == direct.text
    assert "Paris" in direct.text
    assert answer.choices[0].finish_reason == direct.last("finish_reason")
    assert answer.usage.prompt_tokens == direct.last("prompt_tokens")
    assert answer.usage.completion_tokens == direct.last("completion_tokens")
    assert answer.object == "chat.completion" and answer.model == MODEL and answer.id.startswith("chatcmpl-")


def test_greedy_completion_equals_direct_triton(triton_server, openai_client):
    prompt = "The capital of France is"
    direct = stream_infer(triton_server.grpc_url, {"text_input": prompt, "max_tokens": 12, "temperature": 0.0})
    answer = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert answer.choices[0].text == direct.text
    assert answer.usage.completion_tokens == direct.last("completion_tokens")
    echoed = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + direct.text


def test_streamed_chat_chunks_parse_and_join_to_the_answer(front_door, openai_client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16,
            "temperature": 0, "stream": True}
    status, events = sse(front_door.url + "/v1/chat/completions", body)
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(e, strict=False) for e in events[:-1]]
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert all("usage" not in e for e in events[:-1]), "no usage without include_usage"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks].count("stop") + \
        [c.choices[0].finish_reason for c in chunks].count("length") == 1
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    whole = openai_client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=16,
                                                  temperature=0)
    assert streamed == whole.choices[0].message.content

    sync_stream = openai_client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=16,
                                                        temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in sync_stream if c.choices) == streamed


def test_async_client_streams_with_exactly_one_usage_chunk(async_openai_client):
    async def run():
        messages = [{"role": "user", "content": QUESTION}]
        stream = await async_openai_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        whole = await async_openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                                  temperature=0)
        completion_stream = await async_openai_client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True)
        completion_chunks = [chunk async for chunk in completion_stream]
        completion = await async_openai_client.completions.create(model=MODEL, prompt="Once upon a time",
                                                                  max_tokens=8, temperature=0)
        return chunks, whole, completion_chunks, completion

    chunks, whole, completion_chunks, completion = asyncio.run(run())
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1].choices == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(chunks[-1].usage, n) for n in counts] == [getattr(whole.usage, n) for n in counts]
    # the same prompt just ran (streamed): its full KV blocks short of the last token come from the prefix cache
    assert whole.usage.prompt_tokens_details.cached_tokens == (whole.usage.prompt_tokens - 1) // 16 * 16
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content
    assert all(isinstance(c, Completion) for c in completion_chunks)
    assert "".join(c.choices[0].text for c in completion_chunks) == completion.choices[0].text


def test_n_choices_and_seeds(openai_client):
    messages = [{"role": "user", "content": "Name a color."}]
    first = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, n=2, seed=7,
                                                  temperature=1.0)
    assert [c.index for c in first.choices] == [0, 1]
    assert 2 <= first.usage.completion_tokens <= 16
    # One request alone in the engine: the seed makes it repeat (concurrent choices share engine steps, and the
    # engine's batched numerics, bfloat16 on CPUs with AVX512-BF16, need not be batch-invariant).
    seeded = [openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=7,
                                                    temperature=1.0).choices[0].message.content for _ in range(2)]
    assert seeded[0] == seeded[1]
    prompts = openai_client.completions.create(model=MODEL, prompt=["One", "Two"], max_tokens=3, n=2,
                                               temperature=0)
    assert [c.index for c in prompts.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in prompts.choices)


def test_logprobs_chat_and_completions(openai_client):
    chat = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                 max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and bytes(e.bytes).decode() == e.token for e in content)
    completion = openai_client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                                  temperature=0, logprobs=1)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert len(logprobs.token_logprobs) == 4 and all(len(t) >= 1 for t in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0


def postprocess_requests(triton_server) -> int:
    """Requests the postprocess stage has executed (Triton's statistics extension)."""
    stats = grpcclient.InferenceServerClient(triton_server.grpc_url).get_inference_statistics("postprocess",
                                                                                              as_json=True)
    return int(stats["model_stats"][0]["inference_stats"]["success"].get("count", 0))


def test_postprocess_runs_only_for_responses_with_logprobs(triton_server, openai_client):
    """Postprocess passes text through unchanged, so the front door calls it only for responses carrying
    logprobs (once per streamed llm response), and the text is the same either way."""
    messages = [{"role": "user", "content": QUESTION}]
    before = postprocess_requests(triton_server)
    plain = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert postprocess_requests(triton_server) == before
    with_logprobs = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                          temperature=0, logprobs=True)
    assert postprocess_requests(triton_server) > before
    assert plain.choices[0].message.content == with_logprobs.choices[0].message.content
    assert plain.usage.completion_tokens == with_logprobs.usage.completion_tokens == 6


def test_token_id_prompts(triton_server, openai_client):
    prompt = "The capital of France is"
    text = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True)
    with grpcclient.InferenceServerClient(triton_server.grpc_url) as client:
        ids = client.infer("preprocess", make_inputs({"text_input": prompt, "max_tokens": 5}, grpcclient)
                           ).as_numpy("input_ids").tolist()
    by_ids = openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, echo=True)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == text.choices[0].text


def test_models_lists_the_real_context_length(front_door, triton_server, openai_client):
    with grpcclient.InferenceServerClient(triton_server.grpc_url) as client:
        config = client.get_model_config("llm", as_json=True)["config"]
    expected = int(config["parameters"]["max_model_len"]["string_value"])
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == expected
    assert openai_client.models.retrieve(MODEL).id == MODEL
