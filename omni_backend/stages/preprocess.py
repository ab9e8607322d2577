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

Image and audio content parts (`{"type": "image_url", "image_url": {"url": "data:..."}}`,
`{"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}}`) are decoded here
(`omni_backend.stages.media`) when the stage has encoders configured (`MediaConfig`); each becomes a run of the
encoder's placeholder token in the prompt, and four more outputs appear (with zero items for a request without
media, when encoders are configured):
`pixel_values` FP32 [n_images, 3, S, S], `input_features` FP32 [n_audio, mel bins, frames], `media_parts`
STRING [1] (JSON `[{"kind": "image"|"audio", "tokens": int}, ...]` in prompt order) and `media_positions` INT32
[n_placeholders] (prompt positions, in the same order). The caller runs the encoders and hands the llm
`prompt_embeds` for those positions.

Every bad input raises `ValueError` with a message naming the tensor; the Triton model turns it into an
INVALID_ARG error response.
"""

from __future__ import annotations

import json
import secrets

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
MEDIA_OUTPUT_NAMES = ("pixel_values", "input_features", "media_parts", "media_positions")
MEDIA_PART_TYPES = {"image_url": "image", "input_audio": "audio"}
_FIELD_TO_TENSOR = {field: name for name, (field, _) in SAMPLING_INPUTS.items() if field != name} | {
    "stop": "stop_words"
}


def parse_messages(text: str) -> list[dict]:
    """Parse an OpenAI-style messages JSON array of text content into `[{"role": str, "content": str}, ...]`
    (see `parse_chat`)."""
    return parse_chat(text)[0]


def parse_chat(text: str, marker: str | None = None) -> tuple[list[dict], list[dict]]:
    """Parse an OpenAI-style messages JSON array into `[{"role": str, "content": str}, ...]` and its media parts.

    `content` is a string, or a list of parts joined with newlines: `{"type": "text", "text": str}`, and, when
    `marker` is given, `image_url` / `input_audio` parts, each written into the content as `marker` and returned
    (in order) as `{"kind": "image"|"audio", "part": <the part>, "where": "messages[i].content[j] (type)"}`.

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
    messages, media = [], []
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
                kind = part.get("type") if isinstance(part, dict) else None
                if marker is not None and kind in MEDIA_PART_TYPES:
                    media.append({"kind": MEDIA_PART_TYPES[kind], "part": part,
                                  "where": f"{where}.content[{part_index}] ({kind})"})
                    texts.append(marker)
                    continue
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}.content[{part_index}] must be {{\"type\": \"text\", \"text\": string}}"
                                     + ("" if marker is None else " or an image_url / input_audio part"))
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise ValueError(f"{where}.content must be a string or a list of text parts")
        messages.append({"role": role, "content": content})
    return messages, media


class MediaConfig:
    """The encoders the preprocess stage prepares inputs for, and the media limits.

    Args:
        specs: kind ("image"/"audio") -> `MediaSpec` of its encoder; a kind without one answers 400.
        limits: `omni_backend.stages.media.MediaLimits`.
    """

    def __init__(self, specs: dict, limits):
        self.specs, self.limits = specs, limits

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> "MediaConfig":
        """From preprocess config parameters: `vision_model_path` / `audio_model_path` (empty: the default
        encoders; "none": off) and the `MediaLimits` fields."""
        from omni_backend.stages.media import MediaLimits
        from omni_backend.stages.media_encoder import SPEC_FILE, MediaSpec, encoder_path

        specs = {}
        for kind, key in (("image", "vision_model_path"), ("audio", "audio_model_path")):
            configured = parameters.get(key, "")
            if configured.lower() == "none":
                continue
            folder = encoder_path(kind, configured)
            if (folder / SPEC_FILE).is_file():
                specs[kind] = MediaSpec.load(folder)
        return cls(specs, MediaLimits.from_parameters(parameters))


class Preprocessor:
    """Tokenizes prompts and validates request settings for one model.

    Args:
        tokenizer: a transformers tokenizer (its chat template is used for messages).
        max_model_len: longest prompt + completion, in tokens.
    """

    def __init__(self, tokenizer, max_model_len: int, media: MediaConfig | None = None):
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.media = media
        self._marker = "<omni-media-" + secrets.token_hex(8) + ">"  # never typed by a client

    @classmethod
    def from_pretrained(cls, model_path: str, max_model_len: int, media: MediaConfig | None = None) -> "Preprocessor":
        """Load the tokenizer from a local checkpoint folder (offline; no hub lookups)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_path, local_files_only=True), max_model_len, media)

    def tokenize(self, text: str) -> list[int]:
        """Prompt token ids: chat template for a messages array (text starting with '['), else plain text.

        Raises:
            ValueError: empty prompt, malformed messages, or a template that rejects the messages.
        """
        if not text:
            raise ValueError("text_input is empty")
        if text.lstrip().startswith("["):
            ids, media = self.tokenize_messages(text)
            if media:
                raise ValueError(f"{media[0]['where']}: use run() for media parts")
        else:
            ids = list(self.tokenizer(text).input_ids)
        if not ids:
            raise ValueError("text_input is empty after tokenization")
        return ids

    def tokenize_messages(self, text: str) -> tuple[list[int], list[dict]]:
        """Chat-template token ids of a messages array, with each media part's placeholder run in place.

        Returns:
            (ids, media): media parts in prompt order, each with `start` (its first placeholder position),
            `tokens` and the decoded encoder input `array`.
        """
        marker = self._marker if self.media is not None else None
        messages, media = parse_chat(text, marker)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send text_input as plain text")
        if media:
            self._decode_media(media)
        try:
            if not media:
                encoded = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=True)
                return list(encoded["input_ids"]), []
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja2 TemplateError and friends: the template refused these messages
            raise ValueError(f"the chat template rejected text_input messages: {exc}") from None
        pieces = rendered.split(self._marker)
        if len(pieces) != len(media) + 1:
            raise ValueError("the chat template dropped or repeated a media part")
        ids = []
        for index, piece in enumerate(pieces):
            ids.extend(self.tokenizer(piece, add_special_tokens=False).input_ids if piece else [])
            if index < len(media):
                item = media[index]
                spec = self.media.specs[item["kind"]]
                token_id = self.tokenizer.convert_tokens_to_ids(spec.placeholder_token)
                item["start"] = len(ids)
                ids.extend([token_id] * item["tokens"])
        return ids, media

    def _decode_media(self, media: list[dict]) -> None:
        """Decode each media part into its encoder input (`array`) and placeholder count (`tokens`)."""
        from omni_backend.stages import media as decoding

        limits = self.media.limits
        if len(media) > limits.max_media_parts:
            raise ValueError(f"{media[limits.max_media_parts]['where']}: too many image/audio parts "
                             f"({len(media)}; the limit is {limits.max_media_parts} per request)")
        for item in media:
            where, part, kind = item["where"], item["part"], item["kind"]
            spec = self.media.specs.get(kind)
            if spec is None:
                raise ValueError(f"{where}: this server has no {kind} encoder")
            if kind == "image":
                body = part.get("image_url")
                url = body.get("url") if isinstance(body, dict) else body
                if not isinstance(url, str):
                    raise ValueError(f"{where}: image_url.url must be a string")
                data = decoding.image_bytes_from_url(url, where, limits)
                p = spec.processor
                item["array"] = decoding.decode_image(data, where, limits, p["image_size"], p["mean"], p["std"])
                item["tokens"] = spec.tokens
            else:
                from omni_backend.stages.audio import HOP_LENGTH, log_mel, tokens_for_frames

                body = part.get("input_audio")
                if not isinstance(body, dict) or not isinstance(body.get("data"), str):
                    raise ValueError(f"{where}: input_audio.data must be a base64 string")
                samples = decoding.decode_audio(body["data"], where, limits)
                p = spec.processor
                max_samples = p["max_frames"] * HOP_LENGTH
                samples = samples[:max_samples]
                item["array"] = log_mel(samples, p["feature_size"], p["max_frames"]).astype(np.float32)
                frames = min(p["max_frames"], -(-samples.size // HOP_LENGTH))
                item["tokens"] = tokens_for_frames(frames, spec.pool)

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
        media = []
        if arrays.get("prompt_token_ids") is not None:
            ids = self.check_token_ids(arrays["prompt_token_ids"])
            prompt_text = self.tokenizer.decode(ids)
        elif text and text.lstrip().startswith("["):
            ids, media = self.tokenize_messages(text)
            if not ids:
                raise ValueError("text_input is empty after tokenization")
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
        outputs = {
            "input_ids": np.asarray(ids, dtype=np.int32),
            "sampling_params": string_tensor(params.to_json()),
            "prompt_text": string_tensor(prompt_text),
        }
        if media:
            outputs.update(media_outputs(media, self.media.specs))
        elif self.media is not None:  # empty media outputs: the omni_chat_mm ensemble's later steps wait for them
            outputs.update(empty_media_outputs(self.media.specs))
        return outputs


def empty_media_outputs(specs: dict) -> dict[str, np.ndarray]:
    """Media outputs of a request without media (zero items, zero placeholders)."""
    image = specs["image"].processor["image_size"] if "image" in specs else 224
    audio = specs["audio"].processor if "audio" in specs else {"feature_size": 80, "max_frames": 3000}
    return {
        "media_parts": string_tensor("[]"),
        "media_positions": np.zeros(0, dtype=np.int32),
        "pixel_values": np.zeros((0, 3, image, image), dtype=np.float32),
        "input_features": np.zeros((0, audio["feature_size"], audio["max_frames"]), dtype=np.float32),
    }


def media_outputs(media: list[dict], specs: dict) -> dict[str, np.ndarray]:
    """The media output tensors (see the module docstring) of decoded media parts (a kind with no part: empty)."""
    images = [m["array"] for m in media if m["kind"] == "image"]
    audio = [m["array"] for m in media if m["kind"] == "audio"]
    positions = [m["start"] + i for m in media for i in range(m["tokens"])]
    outputs = empty_media_outputs(specs)
    outputs |= {
        "media_parts": string_tensor(json.dumps([{"kind": m["kind"], "tokens": m["tokens"]} for m in media])),
        "media_positions": np.asarray(positions, dtype=np.int32),
    }
    if images:
        outputs["pixel_values"] = np.stack(images).astype(np.float32)
    if audio:
        outputs["input_features"] = np.stack(audio).astype(np.float32)
    return outputs


def _tensor_names(message: str) -> str:
    """Rewrite a SamplingParams error that starts with a field name to use the tensor's name."""
    for field, tensor in _FIELD_TO_TENSOR.items():
        if message.startswith(field + " "):
            return tensor + message[len(field):]
    return message
