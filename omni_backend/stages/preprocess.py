"""Preprocess stage: prompt text or chat messages + request settings -> token ids + sampling parameters.

Input tensors (Triton names; all shape [1] except `stop_words` [-1]):

    text_input          STRING  plain text prompt, tokenized as it is (the tokenizer's own special-token
                                rules), or an OpenAI-style messages JSON array (see `parse_messages`) to
                                which the tokenizer's chat template is applied with a generation prompt
    max_tokens          INT32   tokens to generate, 1..max_model_len (required)
    stream              BOOL    send text deltas (default false)
    temperature         FP32    0 = greedy (default 1.0)
    top_p, min_p        FP32
    top_k               INT32
    random_seed         UINT64  per-request sampling seed
    stop_words          STRING  stop strings
    repetition_penalty, presence_penalty, frequency_penalty   FP32
    ignore_eos          BOOL
    logprobs            INT32   number of top alternatives per token (absent: no logprobs)
    prompt_token_ids    INT32 [-1]  a prompt given as token ids (the OpenAI front door's completions with
                                    token-id prompts); when present it is used as it is and `text_input`
                                    is ignored (send "")

Output tensors: `input_ids` INT32 [n_prompt_tokens], `sampling_params` STRING [1] (JSON of
`omni_backend.engine.sampling_params.SamplingParams`), `prompt_text` STRING [1] (the prompt as text: a plain
`text_input` as it is, else the decoded ids, i.e. the rendered chat template or the token-id prompt; the front
door echoes it; the ensemble does not use it).

Every bad input raises `ValueError` with a message naming the tensor; the Triton model turns it into an
INVALID_ARG error response.
"""

from __future__ import annotations

import json

import numpy as np

from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.stages.tensors import one_value, string_tensor, text_list

# Tensor name -> (SamplingParams field, Python type) for the optional per-request settings.
SAMPLING_INPUTS = {
    "stream": ("stream", bool),
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "random_seed": ("seed", int),
    "repetition_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
    "ignore_eos": ("ignore_eos", bool),
    "logprobs": ("logprobs", int),
}
INPUT_NAMES = ("text_input", "max_tokens", "stop_words", *SAMPLING_INPUTS, "prompt_token_ids")
OUTPUT_NAMES = ("input_ids", "sampling_params", "prompt_text")
_FIELD_TO_TENSOR = {field: name for name, (field, _) in SAMPLING_INPUTS.items() if field != name} | {
    "stop": "stop_words"
}


def parse_messages(text: str) -> list[dict]:
    """Parse an OpenAI-style messages JSON array into `[{"role": str, "content": str}, ...]`.

    `content` is a string, or a list of `{"type": "text", "text": str}` parts joined with newlines.

    Raises:
        ValueError: not valid JSON, not a non-empty array, or a message of the wrong shape (the message
            names the offending index).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"text_input starts with '[' but is not a valid messages JSON array: {exc.msg} "
            f"(line {exc.lineno}, column {exc.colno})"
        ) from None
    if not isinstance(value, list) or not value:
        raise ValueError("text_input messages must be a non-empty JSON array of {role, content} objects")
    messages = []
    for index, message in enumerate(value):
        where = f"text_input messages[{index}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}.role must be a non-empty string")
        if isinstance(content, list):
            texts = []
            for part_index, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}.content[{part_index}] must be {{\"type\": \"text\", \"text\": string}}")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise ValueError(f"{where}.content must be a string or a list of text parts")
        messages.append({"role": role, "content": content})
    return messages


class Preprocessor:
    """Tokenizes prompts and validates request settings for one model.

    Args:
        tokenizer: a transformers tokenizer (its chat template is used for messages).
        max_model_len: longest prompt + completion, in tokens.
    """

    def __init__(self, tokenizer, max_model_len: int):
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    @classmethod
    def from_pretrained(cls, model_path: str, max_model_len: int) -> "Preprocessor":
        """Load the tokenizer from a local checkpoint folder (offline; no hub lookups)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_path, local_files_only=True), max_model_len)

    def tokenize(self, text: str) -> list[int]:
        """Prompt token ids: chat template for a messages array (text starting with '['), else plain text.

        Raises:
            ValueError: empty prompt, malformed messages, or a template that rejects the messages.
        """
        if not text:
            raise ValueError("text_input is empty")
        if text.lstrip().startswith("["):
            messages = parse_messages(text)
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("this model's tokenizer has no chat template; send text_input as plain text")
            try:
                encoded = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=True
                )
            except Exception as exc:  # jinja2 TemplateError and friends: the template refused these messages
                raise ValueError(f"the chat template rejected text_input messages: {exc}") from None
            ids = list(encoded["input_ids"])
        else:
            ids = list(self.tokenizer(text).input_ids)
        if not ids:
            raise ValueError("text_input is empty after tokenization")
        return ids

    def check_token_ids(self, array) -> list[int]:
        """A prompt given as token ids, checked against the vocabulary.

        Raises:
            ValueError: no ids, or an id outside the vocabulary (the message names its position).
        """
        ids = [int(i) for i in np.asarray(array).reshape(-1)]
        if not ids:
            raise ValueError("prompt_token_ids is empty")
        vocab_size = len(self.tokenizer)
        for index, token_id in enumerate(ids):
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"prompt_token_ids[{index}] = {token_id} is not a token id "
                                 f"(vocabulary size {vocab_size})")
        return ids

    def sampling_params(self, arrays: dict) -> SamplingParams:
        """Validated sampling parameters from the request's tensors (see module docstring).

        Raises:
            ValueError: missing or out-of-range `max_tokens`, or any invalid setting (named by tensor).
        """
        max_tokens = one_value(arrays, "max_tokens", int)
        if max_tokens is None:
            raise ValueError("max_tokens is required")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens must be at most {self.max_model_len} (max_model_len), got {max_tokens}")
        values = {"max_tokens": max_tokens, "stop": text_list(arrays, "stop_words")}
        for name, (field, kind) in SAMPLING_INPUTS.items():
            values[field] = one_value(arrays, name, kind)
        try:
            return SamplingParams.from_dict(values)
        except ValueError as exc:
            raise ValueError(_tensor_names(str(exc))) from None

    def run(self, arrays: dict) -> dict[str, np.ndarray]:
        """One request: input arrays by tensor name -> {"input_ids": int32 [n], "sampling_params": object [1],
        "prompt_text": object [1]}.

        Raises:
            ValueError: any bad input; the message names the tensor and the problem.
        """
        text = one_value(arrays, "text_input", str)
        if text is None:
            raise ValueError("text_input is required")
        params = self.sampling_params(arrays)
        if arrays.get("prompt_token_ids") is not None:
            ids = self.check_token_ids(arrays["prompt_token_ids"])
            prompt_text = self.tokenizer.decode(ids)
        else:
            ids = self.tokenize(text)
            prompt_text = self.tokenizer.decode(ids) if text.lstrip().startswith("[") else text
        requested = len(ids) + params.max_tokens
        if requested > self.max_model_len:
            raise ValueError(
                f"maximum context length is {self.max_model_len} tokens, you requested {requested} tokens "
                f"({len(ids)} in the prompt, {params.max_tokens} for the completion)"
            )
        return {
            "input_ids": np.asarray(ids, dtype=np.int32),
            "sampling_params": string_tensor(params.to_json()),
            "prompt_text": string_tensor(prompt_text),
        }


def _tensor_names(message: str) -> str:
    """Rewrite a SamplingParams error that starts with a field name to use the tensor's name."""
    for field, tensor in _FIELD_TO_TENSOR.items():
        if message.startswith(field + " "):
            return tensor + message[len(field):]
    return message
