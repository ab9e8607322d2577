"""Tiny random-weight Hugging Face multimodal checkpoints, for tests and for trying the one-variable way of serving a
real folder without downloading one (`OMNI_LLM_MODEL_PATH=<folder> scripts/serve.sh`).

Each folder is what `save_pretrained` writes for the architecture: transformers' own config class (small sizes,
the real structure), random weights under the checkpoint's own tensor names, the SmolLM2 tokenizer with the
model's added image/audio tokens, a chat template and the processor config. Their answers mean nothing; they run
the same code a downloaded SmolVLM, LLaVA or Qwen2-Audio folder would, and they are the tiny checkpoints of the
model registry's equivalence tests (docs/architecture.md, "Model registry").

    python -m omni_backend.setup.tiny_hf_multimodal idefics3|llava|qwen2_audio <folder>
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from omni_backend import paths

ARCHITECTURES = ("idefics3", "llava", "qwen2_audio")
SEED = 1234
# A small Llama/Qwen2 language model: 2 layers, grouped-query attention (4 query heads over 2 KV heads).
_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5)

# Chat templates in the shape of each family's own (SmolVLM's "User:<image>...<end_of_utterance>", LLaVA-1.5's
# "USER: <image>\n... ASSISTANT:", Qwen2-Audio's ChatML with "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>").
_IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
_LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<image>\n' }}"
    "{% else %}{{ item['text'] + ' ' }}{% endif %}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
_QWEN2_AUDIO_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' %}{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% else %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build(architecture: str, folder: str | Path, log=print) -> Path:
    """Write a tiny random `architecture` checkpoint ("idefics3", "llava" or "qwen2_audio") into `folder`
    (replaced if present); same weights every build (seed 1234).

    Raises:
        ValueError: an unknown architecture.
        OSError: the SmolLM2 tokenizer is not set up (`scripts/setup.sh`).
    """
    import torch
    from transformers import AutoTokenizer

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; choose one of {', '.join(ARCHITECTURES)}")
    folder = Path(folder)
    tokenizer = AutoTokenizer.from_pretrained(paths.models_dir() / "SmolLM2-135M-Instruct")
    torch.manual_seed(SEED)
    model, processor = {"idefics3": _idefics3, "llava": _llava, "qwen2_audio": _qwen2_audio}[architecture](tokenizer)
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    log(f"[setup] built a tiny random {type(model).__name__} checkpoint in {folder}")
    return folder


def _add_tokens(tokenizer, tokens: list[str]) -> int:
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    return len(tokenizer)


def _idefics3(tokenizer):
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                              Idefics3Processor)

    rows = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    vocab = _add_tokens(tokenizer, ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>", *rows])
    # SmolVLM-256M's structure: a SigLIP tower (patch 16), pixel shuffle by 4 (here 2), a Llama LM.
    config = Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=vocab, tie_word_embeddings=False, **_TEXT),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=64, patch_size=16),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 128}, max_image_size={"longest_edge": 64})
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, chat_template=_IDEFICS3_TEMPLATE,
                                  image_seq_len=4)
    return Idefics3ForConditionalGeneration(config), processor


def _llava(tokenizer):
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    vocab = _add_tokens(tokenizer, ["<image>"])
    # llava-1.5's structure: a CLIP tower, features of its second-to-last layer without CLS, a 2-layer MLP.
    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=vocab, **_TEXT),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8,
                           projection_dim=32),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
        vision_feature_select_strategy="default")
    images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=_LLAVA_TEMPLATE)
    return LlavaForConditionalGeneration(config), processor


def _qwen2_audio(tokenizer):
    from transformers import (Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor,
                              WhisperFeatureExtractor)

    vocab = _add_tokens(tokenizer, ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"])
    # Qwen2-Audio-7B's structure: a Whisper-style encoder over 128 mel bins with 2x average pooling, a linear
    # projector, a Qwen2 LM (QKV bias).
    config = Qwen2AudioConfig(
        text_config=dict(model_type="qwen2", vocab_size=vocab, **_TEXT),
        audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                          num_mel_bins=128, max_source_positions=1500),
        audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"))
    processor = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=tokenizer,
                                    chat_template=_QWEN2_AUDIO_TEMPLATE)
    return Qwen2AudioForConditionalGeneration(config), processor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("architecture", choices=ARCHITECTURES)
    parser.add_argument("folder")
    args = parser.parse_args()
    build(args.architecture, args.folder)


if __name__ == "__main__":
    main()
