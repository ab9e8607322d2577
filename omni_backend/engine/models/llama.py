"""The Llama decoder (Llama, SmolLM2; the base of models/qwen2.py) running on the paged KV cache.

Architecture per Touvron et al., "LLaMA" (2023) and the Hugging Face `LlamaForCausalLM` config: pre-RMSNorm
(Zhang & Sennrich 2019), rotary embeddings, grouped-query attention (Ainslie et al. 2023), SwiGLU MLP (Shazeer
2020), a QKV bias where the config asks for one (`qkv_bias`) and tied input/output embeddings. Q/K/V and gate/up
projections are fused into one matmul each.

Under tensor parallelism (engine/tensor_parallel.py) a model holds one rank's shard: its KV-head groups with their
query heads (q/k/v rows, o_proj columns) and its part of the MLP (gate/up rows, down_proj columns); o_proj and
down_proj outputs are partial sums, all-reduced over the ranks. Embeddings, norms and the output head are whole on
every rank.

`LlamaForCausalLM` is also the interface of every engine model the registry names (models/registry.py): built
on the meta device from the language model's config, the attention backend and the RoPE table length; then
`place_rope_cache`, `load_weights`, `forward`, `compute_logits`, `embed_tokens`, `pack_for_cpu`, and, for a model
whose registry row names a CPU step, `use_cpu_kernels`.
"""

from __future__ import annotations

import glob
import os
from contextlib import ExitStack

import torch
from safetensors import safe_open
from torch import nn

from omni_backend import checkpoints
from omni_backend.engine import cpu_linear
from omni_backend.engine.attention.interface import AttentionBackend, AttentionMetadata
from omni_backend.engine.models.llama_cpu import CpuLlamaForward
from omni_backend.engine.models.rope import apply_rope, cos_sin_cache, rope_parameters
from omni_backend.engine.tensor_parallel import SINGLE, Shard


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 like the HF reference."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DecoderLayer(nn.Module):
    """One decoder layer, or `shard`'s part of it: x [T, hidden] -> [T, hidden] (whole on every rank)."""

    def __init__(self, config, attention: AttentionBackend, bias: bool, shard: Shard):
        super().__init__()
        self.head_dim = checkpoints.head_dim(config)
        self.heads = shard.heads(config.num_attention_heads, config.num_key_value_heads)
        self.num_heads, self.num_kv_heads = self.heads.num_q, self.heads.num_kv
        self.mlp_span = shard.span(config.intermediate_size)
        intermediate = self.mlp_span[1] - self.mlp_span[0]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, config.hidden_size, bias=False)
        self.shard = shard
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = attention

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        tokens = x.shape[0]
        h = self.input_layernorm(x)
        qkv = self.qkv_proj(h)
        qk_size = self.q_size + self.kv_size
        # q and k heads rotate together: one RoPE over [T, Hq + Hkv, D]
        qk = apply_rope(qkv[:, :qk_size].view(tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, self.head_dim)
        attn = self.attention(q, k, v, k_cache, v_cache, meta)
        x = x + self.shard.all_reduce(self.o_proj(attn.reshape(tokens, self.q_size)))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.shard.all_reduce(self.down_proj(nn.functional.silu(gate) * up))


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM. forward: input_ids int64 [T], positions int64 [T] -> hidden [T, hidden_size].

    Attributes:
        position_rows: rows of a prompt's position ids the model reads: 1 (a token index), or 3 for M-RoPE models
            (models/qwen2_5_omni.py), whose prompts may bring (t, h, w) positions.
        decodes_from_embeds: whether its decode steps feed an embedding row per token (a talker: codec embedding
            plus its thinker's row), so its CUDA graphs read embeddings rather than token ids.
        max_positions: rows of the RoPE tables, the largest position id + 1 the model can rotate.
    """

    position_rows = 1
    decodes_from_embeds = False  # True: a decode step's input is an embedding row per token (the talker's)
    head_weight = "lm_head.weight"  # the checkpoint name of an untied output head (after `prefixes` are removed)

    @staticmethod
    def language_model_config(hf_config, multimodal: bool):
        """The transformers config of the language model the engine runs, from the checkpoint's config: a text
        checkpoint's own, or a multimodal checkpoint's text config (its tower and connector run in the encoder
        stages), with the tying of input and output embeddings the top-level config decides (transformers ties
        them by the top level for these architectures)."""
        if not multimodal:
            return hf_config
        text_config = hf_config.get_text_config()
        tie = getattr(hf_config, "tie_word_embeddings", None)
        if tie is not None:
            text_config.tie_word_embeddings = bool(tie)
        return text_config

    def __init__(self, config, attention: AttentionBackend, max_positions: int, shard: Shard = SINGLE):
        super().__init__()
        self.config = config
        self.shard = shard
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        bias = self.qkv_bias(config)
        self.layers = nn.ModuleList(DecoderLayer(config, attention, bias, shard)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                        bias=False)
        self.has_head = True  # False on a tensor-parallel rank > 0, which never computes logits (see `build`)
        self.packed_lm_head: cpu_linear.PackedLinear | None = None  # see `pack_for_cpu`
        self.cpu_forward: CpuLlamaForward | None = None  # see `use_cpu_kernels`
        # float32 tables, kept out of the parameters so dtype casts leave them alone; see `place_rope_cache`
        self.max_positions = max_positions
        self.cos_cache, self.sin_cache = cos_sin_cache(self.layers[0].head_dim, max_positions,
                                                       rope_parameters(config))

    @classmethod
    def build(cls, config, attention: AttentionBackend, max_positions: int, shard: Shard, dtype: torch.dtype,
              device: torch.device, model_path: str, prefixes: tuple[str, ...],
              head: bool = True) -> LlamaForCausalLM:
        """The model (`shard`'s part of it) built on the meta device, cast there (free), then materialised on
        `device` in `dtype` and loaded (`load_weights`): device memory never holds a float32 copy of bf16/fp16
        weights. `head` False: without the output head (an untied one is neither allocated nor loaded, and
        `compute_logits` raises), for a tensor-parallel rank > 0, which only runs the decoder."""
        with torch.device("meta"):
            model = cls(config, attention, max_positions, shard)
            if not head:
                model.lm_head, model.has_head = None, False
        model = model.to(dtype).to_empty(device=device)
        model.place_rope_cache(device)
        model.load_weights(model_path, prefixes)
        return model

    @staticmethod
    def qkv_bias(config) -> bool:
        """Whether the q/k/v projections carry a bias: the config's `attention_bias`, as in transformers' Llama."""
        return bool(getattr(config, "attention_bias", False))

    def place_rope_cache(self, device: torch.device) -> None:
        """Move the RoPE tables [max_positions, head_dim] float32 to the model's device."""
        self.cos_cache = self.cos_cache.to(device)
        self.sin_cache = self.sin_cache.to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                meta: AttentionMetadata, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if self.cpu_forward is not None:
            return self.cpu_forward(input_ids, positions, kv_caches, meta, input_embeds)
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        cos, sin = self.rotary(positions, x.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, k_cache, v_cache, meta)
        return self.norm(x)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] in `dtype` for positions int64 [T]. RoPE runs in the activation dtype, as HF's
        LlamaRotaryEmbedding hands it cos/sin in x's dtype."""
        return self.cos_cache[positions].to(dtype), self.sin_cache[positions].to(dtype)

    def pack_for_cpu(self, expected_rows: int) -> None:
        """Replace every projection and the output head by `cpu_linear.PackedLinear` (after `load_weights`, on
        the CPU). A tied head gets its own packed copy of the embedding table ([vocab, hidden], the model's dtype);
        an untied one is dropped after packing. A model built without its head (`build`) packs none."""
        for layer in self.layers:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                linear = getattr(layer, name)
                setattr(layer, name, cpu_linear.PackedLinear(linear.weight, linear.bias, expected_rows))
        if not self.has_head:
            return
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.packed_lm_head = cpu_linear.PackedLinear(head, None, expected_rows)
        self.lm_head = None  # an untied head's plain weight is no longer read

    def use_cpu_kernels(self, forward: CpuLlamaForward) -> None:
        """Run `forward` (the float32 CPU step through the C++ kernels, built from this loaded model) in place of
        the torch modules, and drop the projections' and an untied head's weights it has copied."""
        self.cpu_forward = forward
        for layer in self.layers:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                delattr(layer, name)
        self.lm_head = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab] float32.

        Raises:
            RuntimeError: the model was built without its head (`build`).
        """
        if not self.has_head:
            raise RuntimeError("this model was built without its output head (a tensor-parallel rank > 0)")
        if self.cpu_forward is not None:
            return self.cpu_forward.compute_logits(hidden)
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(hidden, weight).float()

    def extra_weights(self) -> dict[str, torch.Tensor]:
        """Parameters beyond the Llama decoder's that `load_weights` fills, by checkpoint name (none here)."""
        return {}

    def load_weights(self, model_path: str, prefixes: tuple[str, ...]) -> None:
        """Load HF safetensors weights into the parameters (already on their device, in their final dtype),
        fusing q/k/v and gate/up projections and keeping the shard's rows / columns of each (`Shard`). Tensors
        are read one at a time from the memory-mapped files, so the host holds at most one fused weight beside
        the mapping, never a second copy of the checkpoint. The language model is read under the checkpoint's own names: `prefixes` is where the architecture keeps it
        (its registry row's `weight_prefixes`, `checkpoints.text_weight_name`).

        Raises:
            FileNotFoundError: no *.safetensors in model_path.
            KeyError: a weight the model needs is missing from the checkpoint.
        """
        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {model_path}")
        with ExitStack() as stack:
            where: dict[str, tuple] = {}  # the language model's name -> (open file, name in the file)
            for path in files:
                handle = stack.enter_context(safe_open(path, framework="pt"))
                for name in handle.keys():
                    where[checkpoints.text_weight_name(name, prefixes)] = (handle, name)

            def take(name: str) -> torch.Tensor:
                if name not in where:
                    raise KeyError(f"checkpoint {model_path} lacks weight {name!r}")
                handle, stored = where[name]
                return handle.get_tensor(stored)

            with torch.no_grad():
                self.embed_tokens.weight.copy_(take("embed_tokens.weight"))
                self.norm.weight.copy_(take("norm.weight"))
                if self.lm_head is not None:
                    self.lm_head.weight.copy_(take(self.head_weight if self.head_weight in where
                                                   else "embed_tokens.weight"))
                for name, parameter in self.extra_weights().items():
                    parameter.copy_(take(name))
                for i, layer in enumerate(self.layers):
                    p = f"layers.{i}."
                    spans = layer.heads.qkv_spans(layer.head_dim)  # this shard's output rows of q, k and v
                    qkv = [take(p + f"self_attn.{n}_proj.weight")[a:b] for n, (a, b) in zip("qkv", spans)]
                    layer.qkv_proj.weight.copy_(torch.cat(qkv))
                    if layer.qkv_proj.bias is not None:
                        layer.qkv_proj.bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias")[a:b]
                                                             for n, (a, b) in zip("qkv", spans)]))
                    q_start, q_stop = spans[0]
                    layer.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight")[:, q_start:q_stop])
                    m_start, m_stop = layer.mlp_span
                    layer.gate_up_proj.weight.copy_(torch.cat([take(p + "mlp.gate_proj.weight")[m_start:m_stop],
                                                               take(p + "mlp.up_proj.weight")[m_start:m_stop]]))
                    layer.down_proj.weight.copy_(take(p + "mlp.down_proj.weight")[:, m_start:m_stop])
                    layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
                    layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
