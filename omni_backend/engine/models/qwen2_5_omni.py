"""The language model of Qwen2.5-Omni's thinker (Qwen Team, "Qwen2.5-Omni Technical Report", 2025; transformers'
`Qwen2_5OmniThinkerTextModel`): the Qwen2 decoder of models/qwen2.py with multimodal rotary embeddings (M-RoPE,
from Qwen2-VL; TMRoPE in the report).

M-RoPE gives each prompt token three position ids (t, h, w): equal for text, the (t, h, w) grid of an image or
video patch, time-aligned ids for audio and video (40 ms per id). The rotary frequencies are split in three
sections (`rope_parameters.mrope_section`, e.g. [16, 24, 24] of the 64 frequencies of a 128-wide head): the
frequencies of section s rotate by position row s. With three equal rows this is plain RoPE, so text and generated
tokens (whose three ids are equal) take 1-D positions; only a prefill chunk of a prompt with media takes [3, T].
The prompt's ids come from preprocess (stages/models/qwen2_5_omni.py, `mrope_positions`), following transformers'
`get_rope_index`.
"""

from __future__ import annotations

import torch

from omni_backend.engine.attention.interface import AttentionBackend
from omni_backend.engine.models.qwen2 import Qwen2ForCausalLM
from omni_backend.engine.models.rope import rope_parameters
from omni_backend.engine.tensor_parallel import SINGLE, Shard


class Qwen2_5OmniThinkerForCausalLM(Qwen2ForCausalLM):
    """The thinker's decoder: `LlamaForCausalLM`'s interface; forward takes positions int64 [T] or [3, T]."""

    position_rows = 3

    @staticmethod
    def language_model_config(hf_config, multimodal: bool):
        """The thinker's text config, tied as the thinker's config says (its text config's own default, True,
        is not what transformers' thinker does)."""
        thinker = hf_config.thinker_config
        text_config = thinker.get_text_config()
        text_config.tie_word_embeddings = bool(getattr(thinker, "tie_word_embeddings", False))
        return text_config

    def __init__(self, config, attention: AttentionBackend, max_positions: int, shard: Shard = SINGLE):
        # A video's temporal ids advance 25 per second of video whatever its token count, so a prompt's position ids
        # can pass its length: the tables cover every position the model was trained for.
        super().__init__(config, attention, max(max_positions, config.max_position_embeddings), shard)
        section = list(rope_parameters(config)["mrope_section"])
        head_dim = self.layers[0].head_dim
        if sum(section) * 2 != head_dim:
            raise ValueError(f"mrope_section {section} does not split the {head_dim // 2} rotary frequencies")
        with torch.device("cpu"):  # the model is built on the meta device
            rows = torch.repeat_interleave(torch.arange(3), torch.tensor(section)).repeat(2)  # [head_dim], 0..2
        self.rope_rows = rows.view(1, 1, head_dim)

    def place_rope_cache(self, device: torch.device) -> None:
        super().place_rope_cache(device)
        self.rope_rows = self.rope_rows.to(device)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] for positions int64 [T] (three equal rows) or [3, T] (t, h, w rows): dimension d
        rotates by the row its frequency's section names, as transformers' `recomposition_frequencies`."""
        if positions.dim() == 1:
            return super().rotary(positions, dtype)
        index = self.rope_rows.expand(1, positions.shape[1], -1)
        cos = self.cos_cache[positions].gather(0, index).squeeze(0)
        sin = self.sin_cache[positions].gather(0, index).squeeze(0)
        return cos.to(dtype), sin.to(dtype)


class Qwen2_5OmniTalkerForCausalLM(Qwen2_5OmniThinkerForCausalLM):
    """Qwen2.5-Omni's talker (transformers' `Qwen2_5OmniTalkerForConditionalGeneration`): codec tokens out of the
    thinker's reply. A Qwen2 decoder with M-RoPE like the thinker's, over its own narrower width, behind a projection:
    its input rows are as wide as the thinker's hidden states (`embedding_size`), a codec token's embedding plus a
    row of the thinker's (`sequence.InputAddends`), and `thinker_to_talker_proj` (with bias) maps them to the
    decoder's width; `codec_head` gives the logits over the codec vocabulary.

    `LlamaForCausalLM`'s interface: `embed_tokens` is the codec embedding [vocab, embedding_size], so a prompt
    embedding row (`PromptEmbeds`) is thinker-wide, and `forward` projects whatever rows it is given.
    """

    head_weight = "codec_head.weight"
    decodes_from_embeds = True

    @staticmethod
    def language_model_config(hf_config, multimodal: bool):
        """The talker's config (an untied codec head)."""
        config = hf_config.talker_config
        config.tie_word_embeddings = False
        return config

    def __init__(self, config, attention: AttentionBackend, max_positions: int, shard: Shard = SINGLE):
        super().__init__(config, attention, max_positions, shard)
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.embedding_size)
        self.thinker_to_talker_proj = torch.nn.Linear(config.embedding_size, config.hidden_size)

    def extra_weights(self) -> dict[str, torch.Tensor]:
        return {"thinker_to_talker_proj.weight": self.thinker_to_talker_proj.weight,
                "thinker_to_talker_proj.bias": self.thinker_to_talker_proj.bias}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                meta, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        rows = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        return super().forward(input_ids, positions, kv_caches, meta, self.thinker_to_talker_proj(rows))
