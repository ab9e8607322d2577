"""Tiny random-weight Hugging Face multimodal checkpoints, for tests and for trying the one-variable way of serving a
real folder without downloading one (`OMNI_LLM_MODEL_PATH=<folder> scripts/serve.sh`).

Each folder is what `save_pretrained` writes for the architecture: transformers' own config class (small sizes,
the real structure), random weights under the checkpoint's own tensor names, the SmolLM2 tokenizer with the
model's added image/audio/video tokens, a chat template and the processor config (Qwen2.5-Omni: also its talker,
token2wav and `spk_dict.pt`, as downloaded folders have them). Their answers mean nothing; they run the same code a
downloaded SmolVLM, LLaVA, Qwen2-Audio or Qwen2.5-Omni folder would, and they are the tiny checkpoints of the model
registry's equivalence tests (docs/architecture.md, "Model registry").

    python -m omni_backend.setup.tiny_hf_multimodal idefics3|llava|qwen2_audio|qwen2_5_omni <folder>
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from omni_backend import paths

ARCHITECTURES = ("idefics3", "llava", "qwen2_audio", "qwen2_5_omni")
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
_QWEN2_5_OMNI_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2.5-Omni's special tokens, under the names its processor reads from the tokenizer.
_QWEN2_5_OMNI_TOKENS = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
                        "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                        "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
# The talker config's thinker tokens (text stream start, end and padding) and each speaker's first token.
_TALKER_TEXT_TOKENS = {"tts_text_start_token_id": "<|tts_bos|>", "tts_text_end_token_id": "<|tts_eos|>",
                       "tts_text_pad_token_id": "<|tts_pad|>"}
_SPEAKER_TOKENS = {"Chelsie": "<|chelsie|>", "Ethan": "<|ethan|>"}


def build(architecture: str, folder: str | Path, log=print) -> Path:
    """Write a tiny random `architecture` checkpoint ("idefics3", "llava", "qwen2_audio" or "qwen2_5_omni") into
    `folder` (replaced if present); same weights every build (seed 1234).

    Raises:
        ValueError: an unknown architecture.
        OSError: the SmolLM2 tokenizer is not set up (`scripts/setup.sh`).
    """
    import torch
    from transformers import AutoTokenizer

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; choose one of {', '.join(ARCHITECTURES)}")
    folder = Path(folder)
    named = {"extra_special_tokens": _QWEN2_5_OMNI_TOKENS} if architecture == "qwen2_5_omni" else {}
    tokenizer = AutoTokenizer.from_pretrained(paths.models_dir() / "SmolLM2-135M-Instruct", **named)
    torch.manual_seed(SEED)
    makers = {"idefics3": _idefics3, "llava": _llava, "qwen2_audio": _qwen2_audio, "qwen2_5_omni": _qwen2_5_omni}
    model, processor = makers[architecture](tokenizer)
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    if architecture == "qwen2_5_omni":
        _finish_qwen2_5_omni(folder, tokenizer)
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


def _qwen2_5_omni(tokenizer):
    import torch
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration, Qwen2VLImageProcessorPil
    from transformers import WhisperFeatureExtractor

    from omni_backend.stages.models.qwen2_5_omni import OmniProcessor

    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in _QWEN2_5_OMNI_TOKENS.items()}
    # The talker's text marks and the speakers' first tokens are thinker tokens (their embeddings open and close the
    # talker's text stream), so they live in the thinker's vocabulary, as in the released models.
    _add_tokens(tokenizer, [*_TALKER_TEXT_TOKENS.values(), *_SPEAKER_TOKENS.values()])
    speech = {key: tokenizer.convert_tokens_to_ids(token) for key, token in _TALKER_TEXT_TOKENS.items()}
    marks = dict(image_token_index=ids["image_token"], video_token_index=ids["video_token"],
                 audio_token_index=ids["audio_token"], audio_start_token_id=ids["audio_bos_token"],
                 audio_end_token_id=ids["audio_eos_token"], vision_start_token_id=ids["vision_bos_token"],
                 vision_end_token_id=ids["vision_eos_token"])
    # Qwen2.5-Omni-7B's structure, small: a Qwen2 thinker with M-RoPE (head 16: mrope_section [2, 3, 3] of its 8
    # frequencies, as [16, 24, 24] of 64), a windowed vision encoder (patch 14, merge 2, one full-attention block of
    # two), a Whisper-style audio encoder (100-frame chunks here, 200 there); a one-layer talker and a small
    # token2wav (BigVGAN: three dilations per kernel, upsample_initial_channel a multiple of 64).
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]}
    thinker = dict(
        text_config=dict(vocab_size=len(tokenizer), rope_parameters=rope, **{**_TEXT, "rms_norm_eps": 1e-6}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        audio_config=dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                          d_model=32, output_dim=64, n_window=50, max_source_positions=1500),
        **marks)
    talker = dict(vocab_size=8448, embedding_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_parameters=rope, **marks, **speech)
    token2wav = dict(
        dit_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16, emb_dim=32,
                        enc_emb_dim=192, enc_dim=32, enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16,
                        enc_se_channels=16, look_ahead_layers=[1], look_backward_layers=[0]),
        bigvgan_config=dict(upsample_initial_channel=128, resblock_kernel_sizes=[3],
                            resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[5, 3, 2, 2, 2, 2],
                            upsample_kernel_sizes=[11, 7, 4, 4, 4, 4]))
    config = Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, token2wav_config=token2wav)
    # Images of 4 to 32 merged patches (28 x 28 pixels each); the processor's own video limits apply to frames.
    images = Qwen2VLImageProcessorPil(min_pixels=4 * 28 * 28, max_pixels=32 * 28 * 28)
    processor = OmniProcessor(images, WhisperFeatureExtractor(feature_size=128), tokenizer,
                              chat_template=_QWEN2_5_OMNI_TEMPLATE)
    model = Qwen2_5OmniForConditionalGeneration(config)
    # A trained talker never emits the codec vocabulary's marks between answers' codes (code2wav embeds only codes
    # below its num_embeds + 1); here their logits are 0, below the best of 8,194 random ones, so the tiny talker
    # emits codes and its two stop ids only.
    marks = torch.ones(config.talker_config.vocab_size, dtype=torch.bool)
    marks[:config.token2wav_config.dit_config.num_embeds + 1] = False
    marks[[config.talker_config.tts_codec_pad_token_id, config.talker_config.tts_codec_end_token_id]] = False
    with torch.no_grad():
        model.talker.codec_head.weight[marks] = 0
    return model, processor


def _finish_qwen2_5_omni(folder: Path, tokenizer) -> None:
    """What a downloaded Qwen2.5-Omni folder has beyond `save_pretrained`: `spk_dict.pt` (speaker -> its first
    thinker token, 192-wide speaker condition and reference mel [frames, 80]), and `Qwen2_5OmniProcessor` as the
    processor class (transformers' AutoProcessor then loads the whole processor where torchvision is installed)."""
    import json

    import torch

    speakers = {name: {"bos_token": tokenizer.convert_tokens_to_ids(token), "cond": torch.randn(192),
                       "ref_mel": torch.randn(40, 80)} for name, token in _SPEAKER_TOKENS.items()}
    torch.save(speakers, folder / "spk_dict.pt")
    for name in ("processor_config.json", "tokenizer_config.json"):
        path = folder / name
        saved = json.loads(path.read_text())
        saved["processor_class"] = "Qwen2_5OmniProcessor"
        path.write_text(json.dumps(saved, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("architecture", choices=ARCHITECTURES)
    parser.add_argument("folder")
    args = parser.parse_args()
    build(args.architecture, args.folder)


if __name__ == "__main__":
    main()
