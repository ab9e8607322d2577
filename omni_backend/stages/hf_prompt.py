"""Prompts of a Hugging Face multimodal checkpoint, made by the checkpoint's own processor.

The processor (`AutoProcessor` of the folder: tokenizer, chat template, image processor or feature extractor)
renders the chat messages, expands each image or audio placeholder into the model's run of tokens (SmolVLM's
image splitting with `<fake_token_around_image>`, `<row_r_col_c>` and `<global-img>` rows, LLaVA's patch
count, Qwen2-Audio's frame count) and turns the media into encoder items. The client's text stays text
(`chat_template.ChatTemplate`): a typed "<image>" is neither a token nor an image slot. Each architecture's
subclass (omni_backend/stages/models/, named by the model registry's `processor`) then splits those items and
placeholder positions by media part for the encoder stages (`media_encoder.encoder_calls`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from omni_backend import checkpoints
from omni_backend import tensor_names as T
from omni_backend.engine.models.registry import Architecture
from omni_backend.stages.chat_template import ChatTemplate


class ProcessorPrompt:
    """Renders chat messages with media through a multimodal checkpoint's processor.

    Subclasses set `kind` and supply `_processor_media` (the processor's media arguments) and `_parts` (the
    processor's output cut into media parts and encoder items).

    Args:
        folder: the checkpoint folder (its processor files, tokenizer and config.json).
        architecture: its row of the model registry (`placeholders[kind]` names its placeholder token id's key).

    Attributes:
        kind: the media the model reads ("image" or "audio").
        sampling_rate: the audio rate its feature extractor expects, Hz (audio models only).
        chat: its `ChatTemplate` (the processor's template, the processor's tokenizer); the client's strings in the
            messages given to `render` must have gone through `chat.mark`.
    """

    kind = ""

    @property
    def kinds(self) -> frozenset[str]:
        """The media kinds the processor reads (one for most checkpoints)."""
        return frozenset({self.kind})

    def __init__(self, folder: str | Path, architecture: Architecture):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True)
        self.token_id = int(checkpoints.config_value(folder, architecture.placeholders[self.kind]))
        extractor = getattr(self.processor, "feature_extractor", None)
        self.sampling_rate = int(getattr(extractor, "sampling_rate", 16_000))
        self.chat = ChatTemplate(self.processor.tokenizer, self.processor)
        self._media_token = getattr(self.processor, f"{self.kind}_token")  # its image_token / audio_token
        self._added = added_around(self.processor.tokenizer)

    def render(self, messages: list[dict], media: list, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict] | None = None
               ) -> tuple[list[int], list[dict], np.ndarray, dict[str, np.ndarray]]:
        """Token ids and media outputs of a chat: the ids the processor gives for the rendered chat, except that
        the client's marked strings are text.

        Args:
            messages: `[{"role": str, "content": [{"type": "text", "text": str} | {"type": "image"|"audio"}]}]`,
                the client's strings marked (`chat.mark`).
            media: the decoded media of the chat's media parts in order: RGB `PIL.Image`s or float32 samples
                at `sampling_rate`.
            add_generation_prompt, continue_final_message, tools: as `ChatTemplate.render` takes them.

        Returns:
            (ids, parts, positions, items): one `{"kind", "tokens", "items"[, "frames"]}` per media part, the
            placeholder positions int32 [sum of tokens] in order, and the items by output name (`pixel_values`
            [crops or images, 3, S, S] or `input_features` [clips, mel bins, frames]); no parts, positions or
            items for a chat without media.

        Raises:
            FieldError: the template rejected the messages (`ChatTemplate.render`).
            ValueError: the processor's expansion disagrees with its items (a processor this module does not know),
                or the template wrote another number of media placeholders than there are media parts.
        """
        text = self.chat.render(messages, add_generation_prompt, continue_final_message, tools)
        encoded = {}
        if media:
            # The processor expands its placeholder in a text of placeholders only, so that the client's text
            # never passes through it; each expansion then replaces the template's placeholder (a marked one, typed
            # by the client, is skipped) and the whole chat is tokenized with marked text kept as text.
            encoded = self.processor(text=self._media_token * len(media), return_tensors="np",
                                     return_text_replacement_offsets=True, **self._processor_media(media))
            expansions = [entry["replacement"] for entry in encoded["text_replacement_offsets"][0]]
            try:
                text = self.processor.get_text_with_replacements(
                    [text], **{"images_replacements" if self.kind == "image" else "audio_replacements": expansions}
                )[0][0]
            except StopIteration:  # more placeholders in the text than expansions
                raise ValueError("the chat template wrote more media placeholders than there are media parts") from None
        before, after = self._added
        ids = before + self.chat.encode(text) + after
        positions = np.flatnonzero(np.asarray(ids) == self.token_id).astype(np.int32)
        if not media:
            return ids, [], positions, {}
        parts, items = self._parts(ids, encoded, len(media))
        if sum(p["tokens"] for p in parts) != positions.size:
            raise ValueError(f"the processor wrote {positions.size} placeholders for media parts of "
                             f"{sum(p['tokens'] for p in parts)} embeddings")
        return ids, parts, positions, items

    def _processor_media(self, media: list) -> dict:
        """The processor's keyword arguments carrying `media` (the decoded media of one chat, in order)."""
        raise NotImplementedError

    def _parts(self, ids: list[int], encoded: dict, count: int) -> tuple[list[dict], dict[str, np.ndarray]]:
        """The `count` media parts (`render`'s parts) and the encoder items by output name, from the processor's
        output `encoded` for them and the chat's ids.

        Raises:
            ValueError: an output the parts cannot be read from.
        """
        raise NotImplementedError


def pixel_items(encoded: dict) -> dict[str, np.ndarray]:
    """An image processor's `pixel_values` as encoder items [items, 3, S, S] float32 (crops or images)."""
    pixels = np.asarray(encoded["pixel_values"], dtype=np.float32)
    return {T.PIXEL_VALUES: pixels.reshape(-1, *pixels.shape[-3:])}


def added_around(tokenizer) -> tuple[list[int], list[int]]:
    """The ids a tokenizer adds before and after one text (e.g. Llama's BOS), which a processor's own call adds."""
    bare = tokenizer("a", add_special_tokens=False).input_ids
    full = tokenizer("a").input_ids
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start], full[start + len(bare):]
    raise ValueError("the tokenizer's added tokens around a text could not be told apart from the text")
