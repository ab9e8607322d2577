"""Prompts of a Hugging Face multimodal checkpoint, made by the checkpoint's own processor.

The processor (`AutoProcessor` of the folder: tokenizer, chat template, image processor or feature extractor)
renders the chat messages, expands each image or audio placeholder into the model's run of tokens (SmolVLM's
image splitting with `<fake_token_around_image>`, `<row_r_col_c>` and `<global-img>` rows, LLaVA's patch
count, Qwen2-Audio's frame count) and turns the media into encoder items. The client's text stays text
(`chat_template.ChatTemplate`): a typed "<image>" is neither a token nor an image slot. This module then splits
those items and placeholder positions by media part for the encoder stages (`media_encoder.encoder_calls`):

    Idefics3 / SmolVLM  an image -> its crops, each one item of `image_seq_len` placeholders (the global
                        image last, behind `<global-img>`)
    LLaVA               an image -> one item of the processor's image-token count
    Qwen2-Audio         a clip   -> one item [128, 3000] and its valid frames (`frames`)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from omni_backend import checkpoints
from omni_backend.stages.chat_template import ChatTemplate


class ProcessorPrompt:
    """Renders chat messages with media through a multimodal checkpoint's processor.

    Args:
        folder: the checkpoint folder (its processor files, tokenizer and config.json).
        architecture: its `checkpoints.MultimodalArchitecture`.

    Attributes:
        kind: the media the model reads ("image" or "audio").
        sampling_rate: the audio rate its feature extractor expects, Hz (audio models only).
        chat: its `ChatTemplate` (the processor's template, the processor's tokenizer); the client's strings in the
            messages given to `render` must have gone through `chat.mark`.
    """

    def __init__(self, folder: str | Path, architecture: checkpoints.MultimodalArchitecture):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True)
        self.architecture = architecture
        self.kind = architecture.kind
        self.token_id = int(checkpoints.read_config(folder)[architecture.token_key])
        extractor = getattr(self.processor, "feature_extractor", None)
        self.sampling_rate = int(getattr(extractor, "sampling_rate", 16_000))
        self.chat = ChatTemplate(self.processor.tokenizer, self.processor)
        self._media_token = self.processor.image_token if self.kind == "image" else self.processor.audio_token
        self._added = _added_around(self.processor.tokenizer)

    def render(self, messages: list[dict], media: list, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> tuple[list[int], list[dict], np.ndarray,
                                                              dict[str, np.ndarray]]:
        """Token ids and media outputs of a chat: the ids the processor gives for the rendered chat, except that
        the client's marked strings are text.

        Args:
            messages: `[{"role": str, "content": [{"type": "text", "text": str} | {"type": "image"|"audio"}]}]`,
                the client's strings marked (`chat.mark`).
            media: the decoded media of the chat's media parts in order: RGB `PIL.Image`s or float32 samples
                at `sampling_rate`.
            add_generation_prompt, continue_final_message: as `ChatTemplate.render` takes them.

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
        text = self.chat.render(messages, add_generation_prompt, continue_final_message)
        encoded = {}
        if media:
            # The processor expands its placeholder in a text of placeholders only, so that the client's text
            # never passes through it; each expansion then replaces the template's placeholder (a marked one, typed
            # by the client, is skipped) and the whole chat is tokenized with marked text kept as text.
            kwargs = {"audio": media, "sampling_rate": self.sampling_rate}
            if self.kind == "image":
                kwargs = {"images": [media] if self.architecture.name != "LlavaForConditionalGeneration" else media}
            encoded = self.processor(text=self._media_token * len(media), return_tensors="np",
                                     return_text_replacement_offsets=True, **kwargs)
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
        if self.kind == "audio":
            features = np.asarray(encoded["input_features"], dtype=np.float32)
            frames = [int(n) for n in np.asarray(encoded["feature_attention_mask"]).sum(axis=-1)]
            from omni_backend.stages.hf_encoders import audio_tokens

            parts = [{"kind": "audio", "tokens": audio_tokens(n), "items": 1, "frames": n} for n in frames]
            items = {"input_features": features}
        else:
            pixels = np.asarray(encoded["pixel_values"], dtype=np.float32)
            pixels = pixels.reshape(-1, *pixels.shape[-3:])
            parts = self._image_parts(ids, len(media), pixels.shape[0])
            items = {"pixel_values": pixels}
        if sum(p["tokens"] for p in parts) != positions.size:
            raise ValueError(f"the processor wrote {positions.size} placeholders for media parts of "
                             f"{sum(p['tokens'] for p in parts)} embeddings")
        return ids, parts, positions, items

    def _image_parts(self, ids: list[int], num_images: int, num_items: int) -> list[dict]:
        """Parts of `num_images` images whose processor made `num_items` items (crops or images)."""
        if self.architecture.name == "LlavaForConditionalGeneration":
            tokens = sum(1 for i in ids if i == self.token_id) // num_images
            return [{"kind": "image", "tokens": tokens, "items": 1} for _ in range(num_images)]
        # Idefics3 / SmolVLM: one run of image_seq_len placeholders per crop; an image's runs end with the one
        # behind its <global-img> tag.
        global_id = self.processor.tokenizer.convert_tokens_to_ids(self.processor.global_image_tag)
        parts, runs = [], []
        index = 0
        while index < len(ids):
            if ids[index] != self.token_id:
                index += 1
                continue
            start = index
            while index < len(ids) and ids[index] == self.token_id:
                index += 1
            runs.append(index - start)
            if start > 0 and ids[start - 1] == global_id:
                parts.append({"kind": "image", "tokens": sum(runs), "items": len(runs)})
                runs = []
        if runs or len(parts) != num_images or sum(p["items"] for p in parts) != num_items:
            raise ValueError(f"the processor's image expansion ({len(parts)} images, "
                             f"{sum(p['items'] for p in parts)} crops) does not match its {num_images} images "
                             f"and {num_items} crops")
        return parts


def _added_around(tokenizer) -> tuple[list[int], list[int]]:
    """The ids a tokenizer adds before and after one text (e.g. Llama's BOS), which a processor's own call adds."""
    bare = tokenizer("a", add_special_tokens=False).input_ids
    full = tokenizer("a").input_ids
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start], full[start + len(bare):]
    raise ValueError("the tokenizer's added tokens around a text could not be told apart from the text")
