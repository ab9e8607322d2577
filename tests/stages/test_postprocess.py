"""Postprocess stage logic without a server: pass-through and OpenAI-style logprobs with exact bytes."""

import json

import numpy as np
import pytest

from omni_backend.setup import smollm2
from omni_backend.stages.postprocess import Postprocessor, byte_level_alphabet


@pytest.fixture(scope="module")
def postprocessor():
    return Postprocessor.from_pretrained(str(smollm2.checkpoint_dir()))


def test_byte_level_alphabet_covers_every_byte_once():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["Ġ"] == ord(" ") and alphabet["a"] == ord("a")


def test_token_bytes_rebuild_multibyte_text(postprocessor):
    tokenizer = postprocessor.token_bytes.tokenizer
    text = "é 日本語 😀 café"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    pieces = [postprocessor.token_bytes.lookup(i)[1] for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    partial = [p for p in pieces if not _is_utf8(p)]  # tokens holding part of a character
    assert partial, "the test text should split a character across tokens"
    assert all("\ufffd" in postprocessor.token_bytes.lookup(i)[0] for i, p in zip(ids, pieces) if p in partial)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_special_tokens_are_their_text(postprocessor):
    eos = postprocessor.token_bytes.tokenizer.eos_token_id
    assert postprocessor.token_bytes.lookup(eos) == ("<|im_end|>", b"<|im_end|>")


def test_logprobs_are_converted(postprocessor):
    tokenizer = postprocessor.token_bytes.tokenizer
    paris, london = tokenizer(" Paris", add_special_tokens=False).input_ids[0], tokenizer(" London").input_ids[0]
    engine = json.dumps([{"id": paris, "logprob": -0.1, "top": [[paris, -0.1], [london, -2.5]]}])
    converted = json.loads(postprocessor.convert_logprobs(engine))
    assert converted == [{
        "token": " Paris", "bytes": list(b" Paris"), "logprob": -0.1,
        "top_logprobs": [{"token": " Paris", "bytes": list(b" Paris"), "logprob": -0.1},
                         {"token": " London", "bytes": list(b" London"), "logprob": -2.5}],
    }]


def test_run_passes_text_and_counts_through(postprocessor):
    arrays = {
        "text_output": np.array(["Paris.".encode()], dtype=np.object_),
        "finish_reason": np.array([b"stop"], dtype=np.object_),
        "prompt_tokens": np.array([37], dtype=np.int32),
        "completion_tokens": np.array([8], dtype=np.int32),
        "cached_tokens": np.array([32], dtype=np.int32),
        "output_logprobs": np.array([b""], dtype=np.object_),
    }
    out = postprocessor.run(arrays)
    assert out["text_output"].tolist() == [b"Paris."] and out["finish_reason"].tolist() == [b"stop"]
    assert out["prompt_tokens"].tolist() == [37] and out["completion_tokens"].tolist() == [8]
    assert out["cached_tokens"].tolist() == [32] and out["cached_tokens"].dtype == np.int32
    assert out["prompt_tokens"].dtype == np.int32 and out["output_logprobs"].tolist() == [b""]
    del arrays["cached_tokens"]  # optional: an llm without a prefix cache hit count means none reused
    assert postprocessor.run(arrays)["cached_tokens"].tolist() == [0]


def test_malformed_logprobs_raise_value_error(postprocessor):
    with pytest.raises(ValueError, match="output_logprobs is malformed"):
        postprocessor.convert_logprobs("[{\"logprob\": 1}]")
