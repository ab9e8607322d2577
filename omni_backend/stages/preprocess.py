"""Preprocess stage: prompt text or chat messages + request settings -> token ids + sampling parameters.

Input tensors (Triton names; all shape [1] except `stop_words` [-1] and `prompt_token_ids` [-1]):

    text_input          STRING  plain text prompt, tokenized as it is (the tokenizer's own special-token
                                rules), or an OpenAI-style messages JSON array (see `parse_messages`) to
                                which the tokenizer's chat template is applied with a generation prompt
    prompt_token_ids    INT32   a prompt given as token ids (the OpenAI front door's completions with
                                token-id prompts); when present it is used as it is and `text_input`
                                is ignored (send "")
    the settings of `omni_backend.vocabulary.SAMPLING_FIELDS` (max_tokens, stream, temperature, top_p, top_k,
    min_p, random_seed, stop_words, penalties, ignore_eos, logprobs), all optional; ranges are SamplingParams'.
    An absent `max_tokens` means the rest of the context (max_model_len - prompt tokens).

Output tensors: `input_ids` INT32 [n_prompt_tokens], `sampling_params` STRING [1] (JSON of
`omni_backend.engine.sampling_params.SamplingParams`), `prompt_text` STRING [1] (the prompt as text: a plain
`text_input` as it is, else the decoded ids, i.e. the rendered chat template or the token-id prompt; the front
door echoes it; the entry points do not use it).

Image and audio content parts (`{"type": "image_url", "image_url": {"url": "data:..."}}`,
`{"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}}`) are decoded here
(`omni_backend.stages.media`) when the stage has encoders configured (`MediaConfig`); each becomes a run of the
encoder's placeholder token in the prompt, and four more outputs appear (with zero items for a request without
media, when encoders are configured):
`pixel_values` FP32 [n_items, 3, S, S], `input_features` FP32 [n_audio, mel bins, frames], `media_parts`
STRING [1] (JSON `[{"kind": "image"|"audio", "tokens": int, "items": int, "frames": int (audio)}, ...]` in prompt
order: placeholders, encoder items (an image split into crops has several) and a clip's valid mel frames) and
`media_positions` INT32 [n_placeholders] (prompt positions, in the same order). The caller runs the encoders
(`media_encoder.encoder_calls`) and hands the llm `prompt_embeds` for those positions. A multimodal LLM
checkpoint renders every chat with its own processor instead (`hf_prompt.ProcessorPrompt`).

Every bad input raises a `FieldError` naming the tensor (and the path inside a messages array,
`text_input[0].content[1]`), or a `StageError` of kind CONTEXT_LENGTH_EXCEEDED; the Triton model turns it into an
INVALID_ARG error response whose message carries the kind and the field (`omni_backend.vocabulary`).
"""

from __future__ import annotations

import json
import secrets

import numpy as np

from omni_backend.engine.sampling_params import InvalidSamplingParam, SamplingParams
from omni_backend.stages.tensors import one_value, string_tensor, text_list
from omni_backend.vocabulary import BY_PARAM, SAMPLING_FIELDS, ErrorKind, FieldError, StageError

INPUT_NAMES = ("text_input", *(f.tensor for f in SAMPLING_FIELDS), "prompt_token_ids")
OUTPUT_NAMES = ("input_ids", "sampling_params", "prompt_text")
MEDIA_OUTPUT_NAMES = ("pixel_values", "input_features", "media_parts", "media_positions")
MEDIA_PART_TYPES = {"image_url": "image", "input_audio": "audio"}
ENCODER_INPUTS = {"image": "pixel_values", "audio": "input_features"}  # the media output holding each kind's items
_PYTHON_TYPES = {"BOOL": bool, "FP32": float, "INT32": int, "UINT64": int}  # Triton datatype -> one_value kind


def parse_messages(text: str) -> list[dict]:
    """Parse an OpenAI-style messages JSON array of text content into `[{"role": str, "content": str}, ...]`
    (see `parse_chat`)."""
    return parse_chat(text)[0]


def parse_chat(text: str, marker: str | None = None, keep_parts: bool = False) -> tuple[list[dict], list[dict]]:
    """Parse an OpenAI-style messages JSON array into `[{"role": str, "content": str}, ...]` and its media parts.

    `content` is a string, or a list of parts joined with newlines: `{"type": "text", "text": str}`, and, when
    `marker` is given, `image_url` / `input_audio` parts, each written into the content as `marker` and returned
    (in order) as `{"kind": "image"|"audio", "part": <the part>, "slot": <its entry in the kept parts>, "field":
    "text_input[i].content[j]"}`. With `keep_parts`, every content is instead the list of parts transformers'
    multimodal chat templates read: `{"type": "text", "text": str}` and `{"type": "image"|"audio"}` in place of
    each media part.

    Raises:
        FieldError: not valid JSON, not a non-empty array, or a message of the wrong shape (the field names the
            offending message or part, e.g. `text_input[0].content`).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FieldError("text_input", f"starts with '[' but is not a valid messages JSON array: {exc.msg} "
                         f"(line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(value, list) or not value:
        raise FieldError("text_input", "messages must be a non-empty JSON array of {role, content} objects")
    messages, media = [], []
    for index, message in enumerate(value):
        where = f"text_input[{index}]"
        if not isinstance(message, dict):
            raise FieldError(where, "must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise FieldError(f"{where}.role", "must be a non-empty string")
        if isinstance(content, list):
            texts, parts = [], []
            for part_index, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if marker is not None and kind in MEDIA_PART_TYPES:
                    parts.append({"type": MEDIA_PART_TYPES[kind]})
                    media.append({"kind": MEDIA_PART_TYPES[kind], "part": part, "slot": parts[-1],
                                  "field": f"{where}.content[{part_index}]"})
                    texts.append(marker)
                    continue
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise FieldError(f"{where}.content[{part_index}]", "must be {\"type\": \"text\", \"text\": string}"
                                     + ("" if marker is None else " or an image_url / input_audio part"))
                texts.append(part["text"])
                parts.append({"type": "text", "text": part["text"]})
            content = parts if keep_parts else "\n".join(texts)
        elif not isinstance(content, str):
            raise FieldError(f"{where}.content", "must be a string or a list of text parts")
        elif keep_parts:
            content = [{"type": "text", "text": content}]
        messages.append({"role": role, "content": content})
    return messages, media


class MediaConfig:
    """The encoders the preprocess stage prepares inputs for, and the media limits.

    Args:
        specs: kind ("image"/"audio") -> `MediaSpec` of its project encoder; a kind without one answers 400.
        limits: `omni_backend.stages.media.MediaLimits`.
        prompt: the `hf_prompt.ProcessorPrompt` of a multimodal LLM checkpoint, which then renders every chat and
            reads its own kind of media; `specs` then holds the project encoders of the other kinds, if any.
    """

    def __init__(self, specs: dict, limits, prompt=None):
        self.specs, self.limits, self.prompt = specs, limits, prompt

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> "MediaConfig":
        """From preprocess config parameters: `llm_model_path` (a multimodal checkpoint brings its own encoder
        and processor), `vision_model_path` / `audio_model_path` (empty: the default encoders; "none": off) and
        the `MediaLimits` fields.

        Raises:
            ValueError: an unsupported checkpoint architecture (`omni_backend.checkpoints`).
        """
        from omni_backend.stages.media import MediaLimits
        from omni_backend.stages.media_spec import SPEC_FILE, MediaSpec, media_source

        limits = MediaLimits.from_parameters(parameters)
        llm_model_path = parameters.get("llm_model_path", "")
        specs, prompt = {}, None
        for kind, key in (("image", "vision_model_path"), ("audio", "audio_model_path")):
            configured = parameters.get(key, "")
            source = media_source(kind, "" if configured.lower() == "none" else configured, llm_model_path)
            if source is not None and source.architecture is not None:
                from omni_backend.stages.hf_prompt import ProcessorPrompt

                prompt = ProcessorPrompt(source.folder, source.architecture)
            elif source is not None and configured.lower() != "none" and (source.folder / SPEC_FILE).is_file():
                specs[kind] = MediaSpec.load(source.folder)
        return cls(specs, limits, prompt)


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
            FieldError: empty prompt, malformed messages, or a template that rejects the messages.
        """
        if not text:
            raise FieldError("text_input", "is empty")
        if text.lstrip().startswith("["):
            ids, media = self.tokenize_messages(text)
            if media:
                raise FieldError("text_input", "has image or audio parts: use run() for media parts")
        else:
            ids = list(self.tokenizer(text).input_ids)
        if not ids:
            raise FieldError("text_input", "is empty after tokenization")
        return ids

    def tokenize_messages(self, text: str) -> tuple[list[int], dict[str, np.ndarray]]:
        """Chat-template token ids of a messages array, with each media part's placeholder run in place.

        Returns:
            (ids, media outputs): the media output tensors (module docstring) of a chat with media parts, else {}.
        """
        if self.media is not None and self.media.prompt is not None:
            return self._processor_messages(text)
        marker = self._marker if self.media is not None else None
        messages, media = parse_chat(text, marker)
        if not getattr(self.tokenizer, "chat_template", None):
            raise FieldError("text_input", "is a messages array, but this model's tokenizer has no chat template: "
                             "send text_input as plain text")
        if media:
            self._decode_media(media)
        try:
            if not media:
                encoded = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=True)
                return list(encoded["input_ids"]), {}
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja2 TemplateError and friends: the template refused these messages
            raise FieldError("text_input", f"messages were rejected by the chat template: {exc}") from None
        pieces = rendered.split(self._marker)
        if len(pieces) != len(media) + 1:
            raise FieldError("text_input", "messages: the chat template dropped or repeated a media part")
        ids = []
        for index, piece in enumerate(pieces):
            ids.extend(self.tokenizer(piece, add_special_tokens=False).input_ids if piece else [])
            if index < len(media):
                item = media[index]
                spec = self.media.specs[item["kind"]]
                token_id = self.tokenizer.convert_tokens_to_ids(spec.placeholder_token)
                item["start"] = len(ids)
                ids.extend([token_id] * item["tokens"])
        return ids, media_outputs(media, self.media.specs) if media else {}

    def _processor_messages(self, text: str) -> tuple[list[int], dict[str, np.ndarray]]:
        """`tokenize_messages` through a multimodal checkpoint's own processor (`hf_prompt.ProcessorPrompt`).
        Parts of a kind the checkpoint does not read go to a project encoder (`MediaConfig.specs`), written into
        the messages as runs of its placeholder token."""
        prompt, limits = self.media.prompt, self.media.limits
        messages, media = parse_chat(text, self._marker, keep_parts=True)
        if len(media) > limits.max_media_parts:
            raise FieldError(media[limits.max_media_parts]["field"], f"(too many image/audio parts: {len(media)}; "
                             f"the limit is {limits.max_media_parts} per request)")
        own = []
        for item in media:
            try:
                if item["kind"] == prompt.kind:
                    own.append(self._processor_media(item))
                else:
                    self._decode_part(item)
                    token = self.media.specs[item["kind"]].placeholder_token
                    item["slot"].clear()
                    item["slot"].update(type="text", text=token * item["tokens"])
            except FieldError:
                raise
            except ValueError as exc:  # media.py's messages start with the label it was given
                raise FieldError(item["field"], str(exc).removeprefix(item["field"] + " ")) from None
        try:
            ids, parts, positions, items = prompt.render(messages, own)
        except ValueError as exc:
            raise FieldError("text_input", str(exc)) from None
        if not media:
            return ids, {}
        spans = np.split(positions, np.cumsum([p["tokens"] for p in parts])[:-1]) if parts else []
        placed = list(zip(spans, parts))
        for kind, spec in self.media.specs.items():
            mine = [m for m in media if m["kind"] == kind]
            found = np.flatnonzero(np.asarray(ids) == self.tokenizer.convert_tokens_to_ids(spec.placeholder_token))
            if found.size != sum(m["tokens"] for m in mine):
                raise FieldError("text_input", f"holds {spec.placeholder_token}, the {kind} placeholder token, "
                                 f"outside its media parts")
            for span, m in zip(np.split(found, np.cumsum([m["tokens"] for m in mine])[:-1]) if mine else [], mine):
                placed.append((span, {"kind": kind, "tokens": m["tokens"], "items": 1}
                               | ({"frames": m["frames"]} if kind == "audio" else {})))
            if mine:
                items[ENCODER_INPUTS[kind]] = np.stack([m["array"] for m in mine]).astype(np.float32)
        placed.sort(key=lambda pair: int(pair[0][0]))
        return ids, items | {
            "media_parts": string_tensor(json.dumps([part for _, part in placed])),
            "media_positions": np.concatenate([span for span, _ in placed]).astype(np.int32),
        }

    def _processor_media(self, item: dict):
        """An image (RGB `PIL.Image`) or clip (float32 samples at the processor's rate) for the processor.

        Raises:
            ValueError: what the media decoders raise (`omni_backend.stages.media`).
        """
        from omni_backend.stages import media as decoding

        label = f"{item['field']} ({item['part'].get('type')})"
        if item["kind"] == "image":
            return decoding.open_image(self._image_bytes(item, label), label, self.media.limits,
                                       draft_size=decoding.LARGE_IMAGE_DRAFT)
        samples = decoding.decode_audio(self._audio_data(item, label), label, self.media.limits)
        return decoding.resample(samples, decoding.SAMPLE_RATE, self.media.prompt.sampling_rate)

    def _image_bytes(self, item: dict, label: str) -> bytes:
        """The encoded image of an image_url part.

        Raises:
            ValueError: no string url, or what `media.image_bytes_from_url` raises.
        """
        from omni_backend.stages import media as decoding

        body = item["part"].get("image_url")
        url = body.get("url") if isinstance(body, dict) else body
        if not isinstance(url, str):
            raise ValueError(f"{label}: image_url.url must be a string")
        return decoding.image_bytes_from_url(url, label, self.media.limits)

    @staticmethod
    def _audio_data(item: dict, label: str) -> str:
        """The base64 data of an input_audio part.

        Raises:
            ValueError: no base64 string.
        """
        body = item["part"].get("input_audio")
        if not isinstance(body, dict) or not isinstance(body.get("data"), str):
            raise ValueError(f"{label}: input_audio.data must be a base64 string")
        return body["data"]

    def _decode_media(self, media: list[dict]) -> None:
        """Decode each media part into its encoder input (`array`) and placeholder count (`tokens`).

        Raises:
            FieldError: naming the part (`text_input[0].content[1]`): too many parts, no encoder for its kind,
                or media that does not decode or exceeds a limit (`omni_backend.stages.media`).
        """
        limits = self.media.limits
        if len(media) > limits.max_media_parts:
            raise FieldError(media[limits.max_media_parts]["field"], f"(too many image/audio parts: {len(media)}; "
                             f"the limit is {limits.max_media_parts} per request)")
        for item in media:
            field = item["field"]
            try:
                self._decode_part(item)
            except FieldError:
                raise
            except ValueError as exc:  # media.py's messages start with the label it was given
                raise FieldError(field, str(exc).removeprefix(field + " ")) from None

    def _decode_part(self, item: dict) -> None:
        from omni_backend.stages import media as decoding

        part, kind, limits = item["part"], item["kind"], self.media.limits
        label = f"{item['field']} ({part.get('type')})"
        spec = self.media.specs.get(kind)
        if spec is None:
            raise ValueError(f"{label}: this server has no {kind} encoder")
        if kind == "image":
            data = self._image_bytes(item, label)
            p = spec.processor
            item["array"] = decoding.decode_image(data, label, limits, p["image_size"], p["mean"], p["std"])
            item["tokens"] = spec.tokens
        else:
            from omni_backend.stages.audio import HOP_LENGTH, log_mel, tokens_for_frames

            samples = decoding.decode_audio(self._audio_data(item, label), label, limits)
            p = spec.processor
            samples = samples[:p["max_frames"] * HOP_LENGTH]
            item["array"] = log_mel(samples, p["feature_size"], p["max_frames"]).astype(np.float32)
            item["frames"] = min(p["max_frames"], -(-samples.size // HOP_LENGTH))
            item["tokens"] = tokens_for_frames(item["frames"], spec.pool)

    def check_token_ids(self, array) -> list[int]:
        """A prompt given as token ids, checked against the vocabulary.

        Raises:
            FieldError: no ids, or an id outside the vocabulary (the field names its position).
        """
        ids = [int(i) for i in np.asarray(array).reshape(-1)]
        if not ids:
            raise FieldError("prompt_token_ids", "is empty")
        vocab_size = len(self.tokenizer)
        for index, token_id in enumerate(ids):
            if not 0 <= token_id < vocab_size:
                raise FieldError(f"prompt_token_ids[{index}]", f"= {token_id} is not a token id "
                                 f"(vocabulary size {vocab_size})")
        return ids

    def settings(self, arrays: dict) -> dict:
        """The request's settings by SamplingParams attribute (absent ones None), read from their tensors
        (`SAMPLING_FIELDS`); `max_tokens` is also checked against max_model_len here, before tokenizing.

        Raises:
            FieldError: a tensor of the wrong shape or encoding, or max_tokens above max_model_len.
        """
        values = {}
        for field in SAMPLING_FIELDS:
            if field.datatype == "BYTES":
                values[field.param] = text_list(arrays, field.tensor)
            else:
                values[field.param] = one_value(arrays, field.tensor, _PYTHON_TYPES[field.datatype])
        max_tokens = values["max_tokens"]
        if max_tokens is not None and max_tokens > self.max_model_len:
            raise FieldError("max_tokens", f"must be at most {self.max_model_len} (max_model_len), got {max_tokens}")
        return values

    def sampling_params(self, settings: dict, prompt_tokens: int) -> SamplingParams:
        """Validated sampling parameters of a prompt of `prompt_tokens` tokens; an absent max_tokens is the rest
        of the context.

        Raises:
            FieldError: an invalid setting, named by its tensor (ranges: SamplingParams).
            StageError: CONTEXT_LENGTH_EXCEEDED when the prompt and the completion do not fit max_model_len.
        """
        max_tokens = settings["max_tokens"]
        room = self.max_model_len - prompt_tokens
        if (max_tokens if max_tokens is not None else 1) > room:
            requested = prompt_tokens + (max_tokens if max_tokens is not None else 1)
            completion = max_tokens if max_tokens is not None else "at least 1"
            raise StageError(ErrorKind.CONTEXT_LENGTH_EXCEEDED,
                             f"maximum context length is {self.max_model_len} tokens, you requested {requested} "
                             f"tokens ({prompt_tokens} in the prompt, {completion} for the completion)")
        try:
            return SamplingParams.from_dict({**settings, "max_tokens": room if max_tokens is None else max_tokens})
        except InvalidSamplingParam as exc:
            raise FieldError(BY_PARAM[exc.field].tensor, exc.problem) from None

    def run(self, arrays: dict) -> dict[str, np.ndarray]:
        """One request: input arrays by tensor name -> {"input_ids": int32 [n], "sampling_params": object [1],
        "prompt_text": object [1]} (and the media outputs when encoders are configured).

        Raises:
            FieldError, StageError: any bad input; the message names the tensor and the problem.
        """
        text = one_value(arrays, "text_input", str)
        if text is None:
            raise FieldError("text_input", "is required")
        settings = self.settings(arrays)
        media = {}
        if arrays.get("prompt_token_ids") is not None:
            ids = self.check_token_ids(arrays["prompt_token_ids"])
            prompt_text = self.tokenizer.decode(ids)
        elif text and text.lstrip().startswith("["):
            ids, media = self.tokenize_messages(text)
            if not ids:
                raise FieldError("text_input", "is empty after tokenization")
            prompt_text = self.tokenizer.decode(ids)
        else:
            ids = self.tokenize(text)
            prompt_text = text
        params = self.sampling_params(settings, len(ids))
        outputs = {
            "input_ids": np.asarray(ids, dtype=np.int32),
            "sampling_params": string_tensor(params.to_json()),
            "prompt_text": string_tensor(prompt_text),
        }
        if self.media is not None:  # every media output, empty or not: omni_chat_mm reads media_parts to skip none
            outputs.update(empty_media_outputs(self.media.specs) | media)
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
        "media_parts": string_tensor(json.dumps([{"kind": m["kind"], "tokens": m["tokens"], "items": 1}
                                                 | ({"frames": m["frames"]} if m["kind"] == "audio" else {})
                                                 for m in media])),
        "media_positions": np.asarray(positions, dtype=np.int32),
    }
    if images:
        outputs["pixel_values"] = np.stack(images).astype(np.float32)
    if audio:
        outputs["input_features"] = np.stack(audio).astype(np.float32)
    return outputs
