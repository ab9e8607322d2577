"""Build the default multimodal models, from real transformers configs with a fixed seed (same weights every
build):

- the default LLM folder, `<cache>/models/SmolVLM-SmolLM2-135M-Instruct`: a SmolVLM-architecture checkpoint
  (`Idefics3ForConditionalGeneration`) whose language model is the real SmolLM2-135M-Instruct (its weights, its
  ChatML chat template, extended to image parts) and whose SigLIP vision tower and pixel-shuffle connector are
  random, so the default image path runs the code a downloaded SmolVLM folder runs;
- the default audio encoder, `<cache>/models/tiny-omni-audio`: a random Whisper encoder with a projector to the
  SmolLM2 hidden size (576), in the project encoder layout (`stages/media_encoder.py`), which serves audio beside
  the SmolVLM-shaped folder (and beside any text-only LLM of that width);
- `<cache>/models/tiny-omni-vision`: a random SigLIP tower with 2x2 pooling and a projector in the same layout,
  the image encoder beside a text-only LLM folder (`OMNI_LLM_MODEL_PATH` at SmolLM2 itself).

Their image/audio understanding is NOT meaningful: those weights are random. They exercise the whole serving path
(decode, encode, batch, splice into the prompt); text answers are SmolLM2's. Point OMNI_LLM_MODEL_PATH at a real
multimodal folder to serve a real model (docs/api.md, "Image and audio input").
"""

from __future__ import annotations

import shutil
from pathlib import Path

from omni_backend.stages.media_spec import SPEC_FILE, encoder_path

LLM_HIDDEN = 576  # SmolLM2-135M
PLACEHOLDER = "<empty_output>"  # a rarely used special token of the SmolLM2 tokenizer (id 16): the audio placeholder
SEED = 1234
VLM_NAME = "SmolVLM-SmolLM2-135M-Instruct"
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]  # SmolVLM's added tokens
# SmolLM2's own ChatML template (its default system prompt included), taking content as transformers' list of parts:
# text parts joined by newlines, an image part written as "<image>", which the processor expands to
# <fake_token_around_image><global-img><image>x49<fake_token_around_image>. A text-only chat renders exactly as
# with SmolLM2's tokenizer.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% for part in message['content'] %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}{{ '<image>' }}{% endif %}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# google/siglip-base-patch16-224's vision config, cut to 2 layers (the tiny default stays light on CPU): 14x14
# patches, 49 tokens after the connector's 2x2 pixel shuffle.
SIGLIP_VISION = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=2,
                     image_size=224, patch_size=16, num_channels=3, hidden_act="gelu_pytorch_tanh",
                     layer_norm_eps=1e-6)
# openai/whisper-tiny's encoder config (4 layers, d_model 384, 80 mel bins, 30 s windows).
WHISPER_TINY = dict(d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536,
                    decoder_layers=4, decoder_attention_heads=6, decoder_ffn_dim=1536, num_mel_bins=80,
                    max_source_positions=1500, max_target_positions=448, vocab_size=51865,
                    pad_token_id=50257, bos_token_id=50257, eos_token_id=50257, decoder_start_token_id=50258)


def ensure_encoders(log=print) -> bool:
    """Build the default SmolVLM-shaped LLM folder and both project encoders unless present. Returns True when
    something was built.

    Raises:
        OSError: the SmolLM2 checkpoint is not converted yet (`smollm2.ensure_checkpoint` comes first).
    """
    built = False
    if not (default_vlm_dir() / "config.json").is_file():
        _build_default_vlm(default_vlm_dir(), log)
        built = True
    for kind in ("image", "audio"):
        target = encoder_path(kind, str(_default(kind)))
        if (target / SPEC_FILE).is_file():
            continue
        import torch

        from omni_backend.stages.media_encoder import save_encoder

        torch.manual_seed(SEED)
        if kind == "image":
            from transformers import SiglipVisionConfig

            from omni_backend.stages.vision import VisionEncoder

            model = VisionEncoder(SiglipVisionConfig(**SIGLIP_VISION), LLM_HIDDEN, pool=2)
        else:
            from transformers import WhisperConfig

            from omni_backend.stages.audio import AudioEncoder

            model = AudioEncoder(WhisperConfig(**WHISPER_TINY), LLM_HIDDEN, pool=4)
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        save_encoder(model, staging, PLACEHOLDER)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        log(f"[setup] built the tiny random {kind} encoder in {target}")
        built = True
    return built


def default_vlm_dir() -> Path:
    """The default LLM folder: `<cache>/models/SmolVLM-SmolLM2-135M-Instruct` (absolute)."""
    from omni_backend import paths

    return paths.models_dir() / VLM_NAME


def _build_default_vlm(target: Path, log) -> None:
    """Write the SmolVLM-shaped checkpoint around the converted SmolLM2 (module docstring), atomically."""
    import torch
    from safetensors.torch import load_file
    from transformers import (AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3ImageProcessorPil, Idefics3Processor, LlamaConfig)

    from omni_backend.setup.smollm2 import checkpoint_dir

    source = checkpoint_dir()
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    text_config = LlamaConfig.from_pretrained(source).to_dict()
    text_config["vocab_size"] = len(tokenizer)
    config = Idefics3Config(text_config=text_config, vision_config=SIGLIP_VISION, scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=True)
    torch.manual_seed(SEED)
    model = Idefics3ForConditionalGeneration(config).eval()
    weights = {name.removeprefix("model."): tensor
               for name, tensor in load_file(str(source / "model.safetensors")).items()}
    table = weights["embed_tokens.weight"]
    # The added tokens' rows are zero: they never appear in text, and their logits stay 0 (tied head).
    weights["embed_tokens.weight"] = torch.cat([table, table.new_zeros(len(tokenizer) - table.shape[0],
                                                                        table.shape[1])])
    weights.pop("lm_head.weight", None)
    model.model.text_model.load_state_dict(weights)
    images = Idefics3ImageProcessorPil(size={"longest_edge": SIGLIP_VISION["image_size"]}, do_image_splitting=False,
                                       max_image_size={"longest_edge": SIGLIP_VISION["image_size"]})
    tokens = (SIGLIP_VISION["image_size"] // SIGLIP_VISION["patch_size"]) ** 2 // 4  # 2x2 pixel shuffle: 49
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
                                  image_seq_len=tokens)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    processor.save_pretrained(staging)
    shutil.copy(source / "generation_config.json", staging / "generation_config.json")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    log(f"[setup] built the SmolVLM-shaped default model (SmolLM2 weights, random vision tower) in {target}")


def _default(kind: str) -> Path:
    from omni_backend import paths
    from omni_backend.stages.media_spec import DEFAULT_DIRS

    return paths.models_dir() / DEFAULT_DIRS[kind]
