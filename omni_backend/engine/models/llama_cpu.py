"""The forward pass of a float32 or bfloat16 `LlamaForCausalLM` (and of its Qwen2 subclass) on the CPU through the
C++ kernels of `kernels/`: the CPU step the model registry names for the Llama-family models (engine/models/registry.py); a
model whose registry row names no CPU step never runs it.

Per layer: RMSNorm (`kernels.cpu_ops`), the fused QKV projection (`kernels.linear_cpu`), RoPE on q/k fused with
writing the step's K/V into the paged cache, paged attention (`AttentionBackend.attend`: with the cpu backend the
C++ decode kernel and the torch prefill reference), the output projection added into the residual stream in
place, RMSNorm, the fused gate/up projection, SiLU(gate) * up, and the down projection added into the residual
stream: 9 calls where the torch modules take about 35 ops; a decode-only step with the C++ attention runs all of it
in one call (`kernels/cpu_decode_step.py`, bit-identical). The arithmetic is the torch modules' (`models/llama.py`)
in float32, each product one float32 sum; the weights are packed once, as float32 panels, with quantization "int8"
as int8 codes with a scale and minimum per 32 inputs (weight-only; on CPUs with VNNI each projection's input is
rounded to 15 bits per group of 32 for integer dot products, elsewhere it stays float32), or for a bfloat16
model as bfloat16 panels (each projection's input rounded to bfloat16, float32 sums: AMX or AVX512-BF16), whose K/V cache is then
bfloat16 too; norms, RoPE, softmax and the residual stream stay float32. Measured in docs/benchmarks.md ("The CPU
step").
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels.cpu_decode_step import CpuDecodeStep, DecodeStepModel
from kernels.cpu_ops import CpuOps
from kernels.linear_cpu import CpuLinearKernels, PackedWeight
from omni_backend.engine.attention.interface import AttentionMetadata


def _float32(t: torch.Tensor) -> torch.Tensor:
    """A contiguous float32 copy of a float32 or bfloat16 parameter (the same tensor when it is one already)."""
    return t.detach().float().contiguous()


def _pack(linear: CpuLinearKernels, weight: torch.Tensor, weight_format: str) -> PackedWeight:
    return linear.pack(_float32(weight), weight_format)  # bfloat16 -> float32 -> bfloat16 panels is exact


class _Layer:
    """One decoder layer's packed weights and norms."""

    def __init__(self, layer, linear: CpuLinearKernels, weight_format: str):
        self.qkv = _pack(linear, layer.qkv_proj.weight, weight_format)
        self.qkv_bias = None if layer.qkv_proj.bias is None else _float32(layer.qkv_proj.bias)
        self.o = _pack(linear, layer.o_proj.weight, weight_format)
        self.gate_up = _pack(linear, layer.gate_up_proj.weight, weight_format)
        self.down = _pack(linear, layer.down_proj.weight, weight_format)
        self.input_norm = _float32(layer.input_layernorm.weight)
        self.input_eps = layer.input_layernorm.eps
        self.post_norm = _float32(layer.post_attention_layernorm.weight)
        self.post_eps = layer.post_attention_layernorm.eps


class CpuLlamaForward:
    """`LlamaForCausalLM.forward` and `compute_logits` for float32 and bfloat16 on the CPU (see the module docstring).

    Built from a loaded float32 or bfloat16 model on the CPU; takes copies of its weights in the kernels' layout, after which
    the model drops its projections (`LlamaForCausalLM.use_cpu_kernels`).

    Args:
        model: the loaded `LlamaForCausalLM` (float32, or bfloat16 with weight_format "bfloat16"; CPU).
        linear: the built linear kernels.
        ops: the built elementwise ops.
        decode_step: the built one-call decode step, which runs decode-only steps when the attention backend has
            a C++ decode kernel for it (`AttentionBackend.cpu_decode_kernel`, the cpu backend's); None: every step
            op by op.
        weight_format: "float32", "int8" (float32 models) or "bfloat16" (bfloat16 models;
            `kernels.linear_cpu.WEIGHT_FORMATS`), for every projection and the output head; the input embedding
            table stays in the model's dtype (rows are looked up, not multiplied, then widened to float32).

    Raises:
        ValueError: a model that is not float32 or bfloat16 on the CPU, a format that does not fit its dtype, or an
            unknown weight format.
        kernels.cpu_library.CpuKernelUnavailable: "bfloat16" on a CPU without AVX512-BF16; "int8" where the int8
            kernels (their own library, built at the first int8 pack) cannot be built or loaded.
    """

    def __init__(self, model, linear: CpuLinearKernels, ops: CpuOps, decode_step: CpuDecodeStep | None,
                 weight_format: str):
        dtype = model.embed_tokens.weight.dtype
        if dtype not in (torch.float32, torch.bfloat16) or model.embed_tokens.weight.device.type != "cpu":
            raise ValueError("the C++ CPU forward runs float32 and bfloat16 models on the CPU, got "
                             f"{dtype} on {model.embed_tokens.weight.device}")
        if (dtype == torch.bfloat16) != (weight_format == "bfloat16"):
            raise ValueError(f"a {dtype} model takes {'bfloat16' if dtype == torch.bfloat16 else 'float32 or int8'} "
                             f"weights, got {weight_format!r}")
        self.linear, self.ops, self.weight_format = linear, ops, weight_format
        first = model.layers[0]
        self.decode_step = decode_step if first.attention.cpu_decode_kernel is not None else None
        self._described: DecodeStepModel | None = None  # the decode step's view of the engine's KV caches
        self.num_heads, self.num_kv_heads, self.q_size = first.num_heads, first.num_kv_heads, first.q_size
        self.kv_size = first.kv_size
        self.attention = first.attention
        self.embed_tokens = model.embed_tokens
        self.cos, self.sin = _float32(model.cos_cache), _float32(model.sin_cache)
        self.layers = [_Layer(layer, linear, weight_format) for layer in model.layers]
        self.norm, self.norm_eps = _float32(model.norm.weight), model.norm.eps
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        self.head: PackedWeight = _pack(linear, head, weight_format)

    @classmethod
    def build(cls, model, build_dir: Path, weight_format: str) -> "CpuLlamaForward":
        """The forward of `model` with the C++ kernels built in `build_dir` (on first use): what the registry names
        as the CPU step of the Llama-family models (engine/models/registry.py).

        Raises:
            kernels.cpu_library.CpuKernelUnavailable: the kernels cannot be built or loaded here.
            ValueError: as the constructor.
        """
        return cls(model, CpuLinearKernels(build_dir), CpuOps(build_dir), CpuDecodeStep(build_dir), weight_format)

    @property
    def kernel(self) -> str:
        """The microkernel the packed weights run on: float32 "fma"; int8 `CpuLinearKernels.int8_kernel` ("fma",
        "avx512_vnni", "avx_vnni"); bfloat16 `CpuLinearKernels.bf16_kernel` ("amx", "avx512_bf16", "avx512_fma")."""
        if self.weight_format == "int8":
            return self.linear.int8_kernel
        return self.linear.bf16_kernel if self.weight_format == "bfloat16" else "fma"

    @property
    def weight_bytes(self) -> int:
        """Bytes of the packed projections and head."""
        packed = [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(w.nbytes for w in packed) + self.head.nbytes

    def dequantized_weights(self) -> dict[str, torch.Tensor]:
        """The float32 weights the packed projections and head multiply by (int8: q * s + m), split into
        transformers' LlamaForCausalLM / Qwen2ForCausalLM names (``model.layers.{i}.self_attn.q_proj.weight``, ...,
        ``lm_head.weight``): loaded into transformers' model (strict=False, the head untied from the input table)
        they reproduce this step's weights there. int8 groups are within one output row, so the fused QKV and
        gate/up rows are each projection's own."""
        weights = {"lm_head.weight": self.linear.dequantize(self.head)}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            q, k, v = self.linear.dequantize(layer.qkv).split([self.q_size, self.kv_size, self.kv_size])
            gate, up = self.linear.dequantize(layer.gate_up).chunk(2)
            weights.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                            p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight":
                            self.linear.dequantize(layer.o), p + "mlp.gate_proj.weight": gate,
                            p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": self.linear.dequantize(layer.down)})
        return weights

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                 meta: AttentionMetadata, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids int64 [T], positions int64 [T] (or input_embeds [T, hidden]) -> hidden [T, hidden] float32
        after the final norm; writes the step's K/V into `kv_caches` (float32 or bfloat16) at `meta.slot_mapping`."""
        if input_embeds is not None:
            x = input_embeds.float().clone()  # the step writes the residual stream into x, never into the caller's
        else:
            x = self.embed_tokens(input_ids).float()
        if meta.num_prefill_tokens == 0 and self.decode_step is not None:
            if self._described is None or self._described.cache_pointer != kv_caches[0][0].data_ptr():
                self._described = self.decode_step.describe(self, kv_caches)
            return self._described(x, positions.contiguous(), meta.slot_mapping.contiguous(),
                                   meta.decode_block_tables, meta.decode_context_lens)
        tokens = x.shape[0]
        positions = positions.contiguous()
        slots = meta.slot_mapping.contiguous()
        linear, ops = self.linear.linear, self.ops
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            qkv = linear(ops.rms_norm(x, layer.input_norm, layer.input_eps), layer.qkv, layer.qkv_bias)
            ops.rope_store_kv(qkv, self.num_heads, self.num_kv_heads, positions, self.cos, self.sin, slots,
                              k_cache, v_cache)
            attn = self._attend(qkv[:, : self.q_size].unflatten(1, (self.num_heads, -1)), k_cache, v_cache, meta)
            linear(attn.reshape(tokens, self.q_size), layer.o, out=x, accumulate=True)
            gate_up = linear(ops.rms_norm(x, layer.post_norm, layer.post_eps), layer.gate_up)
            linear(ops.silu_mul(gate_up), layer.down, out=x, accumulate=True)
        return ops.rms_norm(x, self.norm, self.norm_eps)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The attention of the float32 queries q [T, Hq, D] -> [T, Hq, D] float32. Over bfloat16 caches the
        decode rows go to the C++ kernel with float32 queries, as the one-call decode step does (same results),
        the prefill rows to the backend's prefill with float32 queries too: the cpu backend's C++ kernel
        (kernels/paged_prefill_cpu.py: float32, or where vdpbf16ps is chosen queries and softmax weights rounded to
        bfloat16), else the torch reference (widens the gathered K/V and runs in float32)."""
        if k_cache.dtype == q.dtype:
            return self.attention.attend(q, k_cache, v_cache, meta)
        if self.attention.cpu_decode_kernel is None:  # a backend that takes queries of the caches' dtype only
            return self.attention.attend(q.to(k_cache.dtype), k_cache, v_cache, meta).float()
        split = meta.num_prefill_tokens
        out = torch.empty_like(q)
        if split:
            out[:split] = self.attention.prefill(q[:split], k_cache, v_cache, meta)
        if split < q.shape[0]:
            out[split:] = self.attention.decode(q[split:], k_cache, v_cache, meta)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] float32 -> logits [N, vocab] float32."""
        return self.linear.linear(hidden.contiguous(), self.head)
