"""Preprocess stage: prompt text or chat messages + request settings -> token ids + sampling parameters.

Input tensors (Triton names; all shape [1] except `stop_words` [-1] and `prompt_token_ids` [-1]):

    text_input          STRING  plain text prompt, tokenized as text (control-token strings such as
                                "<|im_end|>" are their text pieces, unless the operator setting
                                `completions_allow_special_tokens` lets them be tokens), or an OpenAI-style
                                messages JSON array (see `chat_messages.parse_chat`) to which the chat template is applied;
                                the messages' strings are always text: only the template writes control
                                tokens (`chat_template.ChatTemplate`)
    prompt_token_ids    INT32   a prompt given as token ids (the OpenAI front door's completions with
                                token-id prompts); when present it is used as it is and `text_input`
                                is ignored (send "")
    prompt_is_text      BOOL    (default false) `text_input` is a plain prompt even when it starts with '[' (the
                                OpenAI front door sends it for completions prompts, which are never messages)
    add_generation_prompt BOOL  (messages only; default true) end the prompt with the template's opening of an
                                assistant turn
    continue_final_message BOOL (messages only; default false) end the prompt inside the last message, which
                                must be the assistant's, so that the answer continues it; true together with
                                add_generation_prompt is refused
    the settings of `omni_backend.vocabulary.SAMPLING_FIELDS` (max_tokens, stream, temperature, top_p, top_k,
    min_p, random_seed, stop_words, penalties, ignore_eos, logprobs, guided_decoding_guide_type and
    guided_decoding_guide), all optional; ranges are SamplingParams'; a guide that cannot compile is refused here
    (engine/structured_output.py `check_guide`).
    An absent `max_tokens` means the rest of the context (max_model_len - prompt tokens).

Output tensors: `input_ids` INT32 [n_prompt_tokens], `sampling_params` STRING [1] (JSON of
`omni_backend.engine.sampling_params.SamplingParams`), `prompt_text` STRING [1] (the prompt as text: a plain
`text_input` as it is, else the decoded ids, i.e. the rendered chat template or the token-id prompt; the front
door echoes it; the entry points do not use it).

Image, audio and video content parts (`{"type": "image_url", "image_url": {"url": "data:..."}}`,
`{"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}}`, and for a checkpoint whose processor
reads video `{"type": "video_url", "video_url": {"url": "data:..." | "file://...", "use_audio_in_video": bool}}`)
are decoded here (`omni_backend.stages.media`) when the stage has encoders configured
(`preprocess_media.MediaConfig`); each becomes a run of the encoder's placeholder token in the prompt, and five more
outputs appear (with zero items for a request without media, when encoders are configured): `pixel_values` FP32
[n_items, 3, S, S] (Qwen2.5-Omni: [n_items, rows, cols, width] patch rows), `input_features` FP32 [n_audio, mel
bins, frames], `media_parts` STRING [1] (JSON `[{"kind": "image"|"audio"|"video", "tokens": int, "items": int,
"frames": int (audio), "size": [rows, cols] (zero-padded vision items)}, ...]` in prompt order: placeholders,
encoder items (an image split into crops has several, a video one per temporal patch), a clip's valid mel frames),
`media_positions` INT32 [n_placeholders] (prompt positions, in the same order) and `prompt_positions` INT32 [3, n]
(M-RoPE ids of a Qwen2.5-Omni prompt with media, else [3, 0]). The caller runs the encoders
(`media_encoder.encoder_calls`) and hands the llm `prompt_embeds` for those positions. A multimodal LLM
checkpoint renders every chat with its own processor instead (`hf_prompt.ProcessorPrompt`).

Every bad input raises a `FieldError` naming the tensor (and the path inside a messages array,
`text_input[0].content[1]`), or `ContextLengthExceeded` (engine/limits.py; kind CONTEXT_LENGTH_EXCEEDED); the
Triton model turns it into an INVALID_ARG error response whose message carries the kind and the field
(`omni_backend.vocabulary`).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

import numpy as np

from omni_backend import tensor_names as T
from omni_backend.engine.limits import check_context_length
from omni_backend.engine.sampling_params import InvalidSamplingParam, SamplingParams
from omni_backend.engine.structured_output import check_guide
from omni_backend.settings import SettingGroup, parse_field, setting
from omni_backend.stages.chat_messages import check_template_flags, parse_chat
from omni_backend.stages.chat_template import ChatTemplate
from omni_backend.stages.preprocess_media import ENCODER_INPUTS, MediaConfig, empty_media_outputs, media_outputs
from omni_backend.stages.tensors import one_value, string_tensor, text_list
from omni_backend.stages.tool_prompt import parse_tools
from omni_backend.vocabulary import BY_PARAM, SAMPLING_FIELDS, FieldError

TEMPLATE_FLAGS = {T.ADD_GENERATION_PROMPT: True, T.CONTINUE_FINAL_MESSAGE: False}  # BOOL inputs -> their defaults
INPUT_NAMES = (T.TEXT_INPUT, *(f.tensor for f in SAMPLING_FIELDS), T.PROMPT_TOKEN_IDS, T.PROMPT_IS_TEXT,
               *TEMPLATE_FLAGS, T.TOOLS)
OUTPUT_NAMES = (T.INPUT_IDS, T.SAMPLING_PARAMS, T.PROMPT_TEXT)
_PYTHON_TYPES = {"BOOL": bool, "FP32": float, "INT32": int, "UINT64": int, "BYTES": str}  # -> one_value's kind


@dataclass
class PreprocessSettings(SettingGroup):
    """Settings of the preprocess stage (rendered into its config by omni_backend/repository.py)."""

    completions_allow_special_tokens: bool = setting(
        False, "true: control-token strings (<|im_end|>, ...) in a plain-text prompt (completions' prompt, a "
        "text_input that is no messages array) become those tokens; false: they are text. Chat messages are always "
        "text (docs/api.md)")
    allowed_local_media_path: str = setting(
        "", "a folder whose files video_url parts may name as file:// URLs (vLLM's --allowed-local-media-path); "
        "empty: none, videos come as data: URIs")


class Preprocessor:
    """Tokenizes prompts and validates request settings for one model.

    Args:
        tokenizer: a transformers tokenizer (its chat template is used for messages).
        max_model_len: longest prompt + completion, in tokens.
        media: the encoders and limits for image/audio parts (None: text only).
        allow_special_tokens: a plain-text prompt's control-token strings ("<|im_end|>") become those tokens, as
            the operator setting `completions_allow_special_tokens` asks; off (the default), they are text like the
            rest. Chat messages are always text: only the chat template writes control tokens.
        allowed_local_media_path: the folder whose files video parts may name (`file://`); "" for none.
    """

    input_names = INPUT_NAMES  # the model's inputs (triton_glue.StageModel)

    def __init__(self, tokenizer, max_model_len: int, media: MediaConfig | None = None,
                 allow_special_tokens: bool = False, allowed_local_media_path: str = ""):
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.media = media
        self.allow_special_tokens = allow_special_tokens
        self.allowed_local_media_path = allowed_local_media_path
        self._marker = "<omni-media-" + secrets.token_hex(8) + ">"  # never typed by a client
        if media is not None and media.prompt is not None:
            self.chat = media.prompt.chat
        else:
            self.chat = ChatTemplate(tokenizer) if getattr(tokenizer, "chat_template", None) else None

    @classmethod
    def from_pretrained(cls, model_path: str, max_model_len: int, media: MediaConfig | None = None,
                        allow_special_tokens: bool = False, allowed_local_media_path: str = "") -> "Preprocessor":
        """Load the tokenizer from a local checkpoint folder (offline; no hub lookups)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_path, local_files_only=True), max_model_len, media,
                   allow_special_tokens, allowed_local_media_path)

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> "Preprocessor":
        """From the preprocess model's string parameters: the engine's `llm_model_path` and `max_model_len`
        (declared in engine/config.py), `PreprocessSettings`' and the media settings
        (`MediaConfig.from_parameters`).

        Raises:
            ValueError: a malformed setting or an unsupported checkpoint.
        """
        from omni_backend.engine.config import EngineConfig

        model_path = parse_field(EngineConfig, "model_path", parameters.get("llm_model_path"), "llm_model_path")
        max_model_len = parse_field(EngineConfig, "max_model_len", parameters.get("max_model_len"))
        own = PreprocessSettings.from_strings(parameters)
        return cls.from_pretrained(model_path, max_model_len, MediaConfig.from_parameters(parameters),
                                   own.completions_allow_special_tokens, own.allowed_local_media_path)

    def tokenize_text(self, text: str) -> list[int]:
        """Token ids of a plain-text prompt (with the tokens the tokenizer adds around a text, e.g. a BOS);
        control-token strings in it are text unless `allow_special_tokens`.

        Raises:
            FieldError: empty prompt.
        """
        if not text:
            raise FieldError(T.TEXT_INPUT, "is empty")
        ids = list(self.tokenizer(text, split_special_tokens=not self.allow_special_tokens).input_ids)
        if not ids:
            raise FieldError(T.TEXT_INPUT, "is empty after tokenization")
        return ids

    def tokenize_messages(self, text: str, add_generation_prompt: bool = True, continue_final_message: bool = False,
                          tools: list[dict] | None = None) -> tuple[list[int], dict[str, np.ndarray]]:
        """Chat-template token ids of a messages array, with each media part's placeholder run in place; the
        clients' strings are text (`ChatTemplate`).

        Args:
            add_generation_prompt: end with the template's opening of an assistant turn.
            continue_final_message: end inside the last message (an assistant's), which the answer continues.
            tools: OpenAI tool definitions shown to the model (stages/tool_prompt.py), None for none.

        Returns:
            (ids, media outputs): the media output tensors (module docstring) of a chat with media parts, else {}.

        Raises:
            FieldError: malformed messages, bad media, flags that contradict each other or the messages, or a
                template that rejects the messages.
        """
        if self.chat is None:
            raise FieldError(T.TEXT_INPUT, "is a messages array, but this model's tokenizer has no chat template: "
                             "send text_input as plain text")
        if self.media is not None and self.media.prompt is not None:
            return self._processor_messages(text, add_generation_prompt, continue_final_message, tools)
        marker = self._marker if self.media is not None else None
        messages, media = parse_chat(text, marker, as_text=self.chat.mark)
        check_template_flags(messages, add_generation_prompt, continue_final_message)
        if media:
            self._decode_media(media)
        rendered = self.chat.render(messages, add_generation_prompt, continue_final_message, tools)
        pieces = rendered.split(self._marker)
        if len(pieces) != len(media) + 1:
            raise FieldError(T.TEXT_INPUT, "messages: the chat template dropped or repeated a media part")
        ids = []
        for index, piece in enumerate(pieces):
            ids.extend(self.chat.encode(piece) if piece else [])
            if index < len(media):
                item = media[index]
                spec = self.media.specs[item["kind"]]
                token_id = self.tokenizer.convert_tokens_to_ids(spec.placeholder_token)
                item["start"] = len(ids)
                ids.extend([token_id] * item["tokens"])
        return ids, media_outputs(media, self.media.specs) if media else {}

    def _processor_messages(self, text: str, add_generation_prompt: bool, continue_final_message: bool,
                            tools: list[dict] | None) -> tuple[list[int], dict[str, np.ndarray]]:
        """`tokenize_messages` through a multimodal checkpoint's own processor (`hf_prompt.ProcessorPrompt`).
        Parts of a kind the checkpoint does not read go to a project encoder (`MediaConfig.specs`), written into
        the messages as runs of its placeholder token (after the client's text was marked: these are control
        tokens)."""
        prompt, limits = self.media.prompt, self.media.limits
        messages, media = parse_chat(text, self._marker, keep_parts=True, as_text=self.chat.mark)
        check_template_flags(messages, add_generation_prompt, continue_final_message)
        if len(media) > limits.max_media_parts:
            raise FieldError(media[limits.max_media_parts]["field"], f"(too many media parts: {len(media)}; "
                             f"the limit is {limits.max_media_parts} per request)")
        own = []
        for item in media:
            try:
                if item["kind"] in prompt.kinds:
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
            ids, parts, positions, items = prompt.render(messages, own, add_generation_prompt, continue_final_message,
                                                         tools)
        except FieldError:
            raise
        except ValueError as exc:
            raise FieldError(T.TEXT_INPUT, str(exc)) from None
        if not media:
            return ids, {}
        spans = np.split(positions, np.cumsum([p["tokens"] for p in parts])[:-1]) if parts else []
        placed = list(zip(spans, parts))
        for kind, spec in self.media.specs.items():
            mine = [m for m in media if m["kind"] == kind]
            found = np.flatnonzero(np.asarray(ids) == self.tokenizer.convert_tokens_to_ids(spec.placeholder_token))
            if found.size != sum(m["tokens"] for m in mine):
                raise FieldError(T.TEXT_INPUT, f"holds {spec.placeholder_token}, the {kind} placeholder token, "
                                 f"outside its media parts")
            for span, m in zip(np.split(found, np.cumsum([m["tokens"] for m in mine])[:-1]) if mine else [], mine):
                placed.append((span, {"kind": kind, "tokens": m["tokens"], "items": 1}
                               | ({"frames": m["frames"]} if kind == "audio" else {})))
            if mine:
                items[ENCODER_INPUTS[kind]] = np.stack([m["array"] for m in mine]).astype(np.float32)
        placed.sort(key=lambda pair: int(pair[0][0]))
        return ids, items | {
            T.MEDIA_PARTS: string_tensor(json.dumps([part for _, part in placed])),
            T.MEDIA_POSITIONS: np.concatenate([span for span, _ in placed]).astype(np.int32),
        }

    def _processor_media(self, item: dict):
        """An image (RGB `PIL.Image`), clip (float32 samples at the processor's rate) or video (`media.DecodedVideo`
        of the frames the processor samples, with its audio track at the processor's rate when the part's
        `use_audio_in_video` asks) for the processor.

        Raises:
            ValueError: what the media decoders raise (`omni_backend.stages.media`), or a malformed video part.
        """
        from omni_backend.stages import media as decoding

        label = f"{item['field']} ({item['part'].get('type')})"
        rate = self.media.prompt.sampling_rate
        if item["kind"] == "image":
            return decoding.open_image(self._image_bytes(item, label), label, self.media.limits,
                                       draft_size=decoding.LARGE_IMAGE_DRAFT)
        if item["kind"] == "video":
            body = item["part"].get("video_url")
            body = {"url": body} if isinstance(body, str) else body
            if not isinstance(body, dict) or not isinstance(body.get("url"), str):
                raise ValueError(f"{label}: video_url.url must be a string")
            with_audio = body.get("use_audio_in_video", False)
            if not isinstance(with_audio, bool):
                raise ValueError(f"{label}: video_url.use_audio_in_video must be true or false")
            data = decoding.video_bytes_from_url(body["url"], label, self.media.limits, self.allowed_local_media_path)
            video = decoding.decode_video(data, label, self.media.limits, self.media.prompt.pick_frames, with_audio)
            if video.audio is not None:
                video.audio = decoding.resample(video.audio, decoding.SAMPLE_RATE, rate)
            return video
        samples = decoding.decode_audio(self._audio_data(item, label), label, self.media.limits)
        return decoding.resample(samples, decoding.SAMPLE_RATE, rate)

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
            raise FieldError(media[limits.max_media_parts]["field"], f"(too many media parts: {len(media)}; "
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
            raise FieldError(T.PROMPT_TOKEN_IDS, "is empty")
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
            if field.param == "stop":  # the one list-valued setting (stop_words [-1])
                values[field.param] = text_list(arrays, field.tensor)
            else:
                values[field.param] = one_value(arrays, field.tensor, _PYTHON_TYPES[field.datatype])
        max_tokens = values["max_tokens"]
        if max_tokens is not None and max_tokens > self.max_model_len:
            raise FieldError(BY_PARAM["max_tokens"].tensor,
                             f"must be at most {self.max_model_len} (max_model_len), got {max_tokens}")
        return values

    def sampling_params(self, settings: dict, prompt_tokens: int) -> SamplingParams:
        """Validated sampling parameters of a prompt of `prompt_tokens` tokens; an absent max_tokens is the rest
        of the context.

        Raises:
            FieldError: an invalid setting, named by its tensor (ranges: SamplingParams).
            ContextLengthExceeded: the prompt and the completion do not fit max_model_len (engine/limits.py).
        """
        max_tokens = settings["max_tokens"]
        check_context_length(self.max_model_len, prompt_tokens, max_tokens)
        room = self.max_model_len - prompt_tokens
        try:
            params = SamplingParams.from_dict({**settings, "max_tokens": room if max_tokens is None else max_tokens})
            if params.guide_type is not None:
                check_guide(params.guide_type, params.guide)
            return params
        except InvalidSamplingParam as exc:
            raise FieldError(BY_PARAM[exc.field].tensor, exc.problem) from None

    def run(self, arrays: dict) -> dict[str, np.ndarray]:
        """One request: input arrays by tensor name -> {"input_ids": int32 [n], "sampling_params": object [1],
        "prompt_text": object [1]} (and the media outputs when encoders are configured).

        Raises:
            FieldError, ContextLengthExceeded: any bad input; the message names the tensor and the problem.
        """
        text = one_value(arrays, T.TEXT_INPUT, str)
        if text is None:
            raise FieldError(T.TEXT_INPUT, "is required")
        settings = self.settings(arrays)
        flags = {name: one_value(arrays, name, bool, default) for name, default in TEMPLATE_FLAGS.items()}
        media = {}
        is_messages = arrays.get(T.PROMPT_TOKEN_IDS) is None and not one_value(arrays, T.PROMPT_IS_TEXT, bool, False) \
            and text.lstrip().startswith("[")
        tools = parse_tools(one_value(arrays, T.TOOLS, str))
        if not is_messages:
            for name, default in TEMPLATE_FLAGS.items():
                if flags[name] != default:
                    raise FieldError(name, "applies to a messages array only (the prompt is text or token ids)")
            if tools is not None:
                raise FieldError(T.TOOLS, "applies to a messages array only (the prompt is text or token ids)")
        if arrays.get(T.PROMPT_TOKEN_IDS) is not None:
            ids = self.check_token_ids(arrays[T.PROMPT_TOKEN_IDS])
            prompt_text = self.tokenizer.decode(ids)
        elif is_messages:
            ids, media = self.tokenize_messages(text, **flags, tools=tools)
            if not ids:
                raise FieldError(T.TEXT_INPUT, "is empty after tokenization")
            prompt_text = self.tokenizer.decode(ids)
        else:
            ids = self.tokenize_text(text)
            prompt_text = text
        params = self.sampling_params(settings, len(ids))
        outputs = {
            T.INPUT_IDS: np.asarray(ids, dtype=np.int32),
            T.SAMPLING_PARAMS: string_tensor(params.to_json()),
            T.PROMPT_TEXT: string_tensor(prompt_text),
        }
        if self.media is not None:  # every media output, empty or not: omni_chat_mm reads media_parts to skip none
            outputs.update(empty_media_outputs(self.media.specs) | media)
        return outputs
