"""A decode-only step of the Llama-family layer (float32 activations; float32, int8 or bfloat16 weights; a float32
or bfloat16 KV cache) in one C++ call (``cpu_decode_step.cpp``): the CPU counterpart of a captured CUDA graph, built
on first use (``kernels/cpu_library.py``) and called through ctypes.
Only the architectures whose model registry row names ``CpuLlamaForward`` as their CPU step run it
(``omni_backend/engine/models/registry.py``); its attention is the kernel the attention backend offers for it
(``cpu_decode_kernel``, the cpu backend's).

Why: a decode step of SmolLM2-135M is 30 layers x 9 kernel calls; through Python each costs its argument checks, a
ctypes call and an output allocation, about 30 % of a batch-1 step (int8: 6 of 20 ms, measured with
scripts/bench_cpu_step.py). This library calls the same kernels (``linear_cpu``, ``cpu_ops``, ``paged_decode_cpu``,
through their own libraries' entry points) in the same order, so its results are bit-identical to the per-op path of
``omni_backend/engine/models/llama_cpu.py``, and releases the GIL for the whole step.

The model (`DecodeStepModel`) is described once: packed weights, norms, RoPE tables and the KV caches (their
pointers: the tensors must stay alive and in place, as the engine's do). A step takes the decode rows'
embeddings, positions, cache slots, block tables and context lengths.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu_library import CpuLibrary, check_cpu_tensor

_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c++17"]
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _PTR) for name in ("linear_f32", "linear_i8", "linear_bf16", "rms_norm", "rope_store_kv",
                                          "silu_mul", "paged_decode")]


class _Projection(ctypes.Structure):
    _fields_ = [("panels", _PTR), ("scales", _PTR), ("bias", _PTR), ("n", _I64), ("k", _I64), ("bf16", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection), ("down", _Projection),
                ("input_norm", _PTR), ("post_norm", _PTR), ("input_eps", ctypes.c_float),
                ("post_eps", ctypes.c_float), ("k_cache", _PTR), ("v_cache", _PTR)]


class _Model(ctypes.Structure):
    _fields_ = [("kernels", _Kernels), ("num_layers", _I64), ("hidden", _I64), ("num_heads", _I64),
                ("num_kv_heads", _I64), ("head_dim", _I64), ("intermediate", _I64), ("num_blocks", _I64),
                ("block_size", _I64), ("max_positions", _I64), ("attention_scale", ctypes.c_float),
                ("final_eps", ctypes.c_float), ("cos", _PTR), ("sin", _PTR), ("final_norm", _PTR),
                ("layers", ctypes.POINTER(_Layer))]


_SIGNATURES = {
    "decode_step_scratch_floats": ([ctypes.POINTER(_Model), _I64], _I64),
    "decode_step_f32": ([ctypes.POINTER(_Model), _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR], _I64),
}


def _address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


# decode_step_f32's refusals: it returns 1000 * layer + one of these (cpu_decode_step.cpp)
_REFUSALS = {1: "a position or slot out of range", 2: "a context needing blocks outside its block table or the cache"}


class CpuDecodeStep(CpuLibrary):
    """The built library (`kernels.cpu_library.CpuLibrary`: built in ``build_dir`` on first use).

    Raises:
        kernels.cpu_library.CpuKernelUnavailable: the library cannot be built or loaded here.
    """

    SOURCE = Path(__file__).with_name("cpu_decode_step.cpp")
    FLAGS = _FLAGS
    SIGNATURES = _SIGNATURES

    def describe(self, forward, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> "DecodeStepModel":
        """The step's description of `forward` (an `omni_backend.engine.models.llama_cpu.CpuLlamaForward`) over
        these KV caches (float32 or bfloat16 ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, one
        pair per layer, all of one dtype).

        Raises:
            ValueError: caches that are not one contiguous float32 or bfloat16 CPU pair per layer of one shape and
                dtype (block_size,
                num_kv_heads and head_dim at least 1), or weights, norms and RoPE tables whose shapes do not fit the
                model's sizes.
        """
        return DecodeStepModel(self, forward, kv_caches)


class DecodeStepModel:
    """A model described for `CpuDecodeStep` (see `CpuDecodeStep.describe`); holds the tensors it points at (not
    `forward` itself, which holds this description).

    Attributes:
        cache_pointer: the first layer's K cache address, to tell whether a step's caches are the described ones.
    """

    def __init__(self, library: CpuDecodeStep, forward, kv_caches):
        if not kv_caches or len(kv_caches) != len(forward.layers):
            raise ValueError(f"{len(kv_caches)} cache pairs for {len(forward.layers)} layers")
        shape = tuple(kv_caches[0][0].shape)
        if len(shape) != 4 or min(shape[1:]) < 1:  # the step divides by block_size (paged decode's block count)
            raise ValueError(f"KV caches must be [num_blocks, block_size, num_kv_heads, head_dim] with block_size, "
                             f"num_kv_heads and head_dim at least 1, got {shape}")
        cache_dtype = torch.bfloat16 if kv_caches[0][0].dtype == torch.bfloat16 else torch.float32
        for pair in kv_caches:
            for name, cache in zip(("k_cache", "v_cache"), pair):
                check_cpu_tensor(name, cache, cache_dtype, shape)
        num_blocks, block_size, num_kv_heads, head_dim = shape
        hidden, num_heads = forward.norm.shape[0], forward.num_heads
        if num_kv_heads != forward.num_kv_heads:
            raise ValueError(f"caches hold {num_kv_heads} KV heads, the model {forward.num_kv_heads}")
        max_positions = forward.cos.shape[0]
        check_cpu_tensor("cos", forward.cos, torch.float32, (max_positions, head_dim))
        check_cpu_tensor("sin", forward.sin, torch.float32, (max_positions, head_dim))
        check_cpu_tensor("final norm", forward.norm, torch.float32, (hidden,))
        intermediate = forward.layers[0].down.in_features
        linear, ops, decode = forward.linear, forward.ops, forward.attention.cpu_decode_kernel
        keep = [forward.cos, forward.sin, forward.norm]  # what the description points at

        def projection(name, packed, n, k, bias=None) -> _Projection:
            if (packed.out_features, packed.in_features) != (n, k):
                raise ValueError(f"{name} is [{packed.out_features}, {packed.in_features}], the model needs [{n}, {k}]")
            linear.check_packed(packed)
            if bias is not None:
                check_cpu_tensor(f"{name} bias", bias, torch.float32, (n,))
            keep.extend(t for t in (packed.panels, packed.scales, bias) if t is not None)
            return _Projection(packed.panels.data_ptr(), None if packed.scales is None else packed.scales.data_ptr(),
                               None if bias is None else bias.data_ptr(), n, k, int(packed.format == "bfloat16"))

        layers = (_Layer * len(forward.layers))()
        qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
        for i, (entry, layer, (k_cache, v_cache)) in enumerate(zip(layers, forward.layers, kv_caches)):
            entry.qkv = projection(f"layer {i} qkv", layer.qkv, qkv_width, hidden, layer.qkv_bias)
            entry.o = projection(f"layer {i} o", layer.o, hidden, num_heads * head_dim)
            entry.gate_up = projection(f"layer {i} gate_up", layer.gate_up, 2 * intermediate, hidden)
            entry.down = projection(f"layer {i} down", layer.down, hidden, intermediate)
            for name, norm in (("input norm", layer.input_norm), ("post-attention norm", layer.post_norm)):
                check_cpu_tensor(f"layer {i} {name}", norm, torch.float32, (hidden,))
            entry.input_norm, entry.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            entry.input_eps, entry.post_eps = layer.input_eps, layer.post_eps
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            keep.extend((layer.input_norm, layer.post_norm, k_cache, v_cache))
        bf16_cache = cache_dtype == torch.bfloat16
        # linear_i8 only where a weight is int8 (its library loads on first int8 use; the step never calls it else)
        int8 = any(entry.qkv.scales or entry.o.scales or entry.gate_up.scales or entry.down.scales
                   for entry in layers)
        kernels = _Kernels(*(_address(built.entry_point(name)) if name else None for built, name in (
            (linear, "linear_f32"), (linear, "linear_i8" if int8 else None), (linear, "linear_bf16"),
            (ops, "rms_norm_f32"),
            (ops, "rope_store_kv_f32_bf16" if bf16_cache else "rope_store_kv_f32"), (ops, "silu_mul_f32"),
            (decode, "paged_decode_f32_bf16" if bf16_cache else "paged_decode_f32"))))
        self._library = library
        self._keep = keep
        self._layers = layers
        self.hidden = hidden
        self._model = _Model(kernels, len(forward.layers), hidden, num_heads, num_kv_heads, head_dim, intermediate,
                             num_blocks, block_size, max_positions, forward.attention.scale, forward.norm_eps,
                             forward.cos.data_ptr(), forward.sin.data_ptr(), forward.norm.data_ptr(), layers)
        self._scratch = torch.empty(0, dtype=torch.float32)  # grown to the largest batch seen
        self.cache_pointer = kv_caches[0][0].data_ptr()

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """One decode step: x ``[B, hidden]`` float32 (the rows' embeddings; overwritten), positions and
        slot_mapping int64 ``[B]``, block_tables int32 ``[B, max_blocks]`` (unit stride in columns), context_lens
        int32 ``[B]`` (with the new token), all on the CPU -> hidden ``[B, hidden]`` float32 after the final norm;
        writes each row's K/V into the caches at its slot.

        Raises:
            ValueError: tensors outside this contract, or a row whose position, slot or block table is out of
                range (the step's results are then undefined; the caller fails the step).
        """
        batch = x.shape[0]
        check_cpu_tensor("x", x, torch.float32, (batch, self.hidden))
        check_cpu_tensor("positions", positions, torch.int64, (batch,))
        check_cpu_tensor("slot_mapping", slot_mapping, torch.int64, (batch,))
        check_cpu_tensor("context_lens", context_lens, torch.int32, (batch,))
        if block_tables.dtype != torch.int32 or block_tables.device.type != "cpu" or block_tables.dim() != 2 \
                or block_tables.shape[0] != batch or block_tables.stride(1) != 1:
            raise ValueError(f"block_tables must be an int32 CPU [{batch}, max_blocks] tensor with unit column "
                             f"stride, got {block_tables.dtype} {tuple(block_tables.shape)} on {block_tables.device}")
        out = torch.empty((batch, self.hidden), dtype=torch.float32)
        if batch == 0:
            return out
        floats = self._library.entry_point("decode_step_scratch_floats")(ctypes.byref(self._model), batch)
        if self._scratch.numel() < floats:
            self._scratch = torch.empty(floats, dtype=torch.float32)
        failed = self._library.entry_point("decode_step_f32")(
            ctypes.byref(self._model), x.data_ptr(), batch, positions.data_ptr(), slot_mapping.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1], context_lens.data_ptr(),
            self._scratch.data_ptr(), out.data_ptr())
        if failed >= 0:
            layer, reason = divmod(failed, 1000)
            raise ValueError(f"decode step refused at layer {layer}: {_REFUSALS[reason]}")
        return out
