"""Runs the model for one scheduled batch: owns the weights, the KV cache and the CUDA graphs; prepares a step's
inputs, runs the forward pass (graph replay or eager), samples.

Start-up, in order (each step's reason in its method's docstring):
1. bind the device to this thread, look the checkpoint's architecture up in the model registry
   (`models/registry.py`: the model class, where its weights are, its CPU step), resolve the dtype and the
   attention backend (`attention/selector.py`: its kernels run once against the torch reference, and an automatic
   choice falls back to torch on failure);
2. build the model on the meta device in its final dtype and load the weights straight into device memory; on a
   CPU, run its projections through the C++ kernels of its registry row's CPU step, or oneDNN without one;
3. on a GPU without an explicit KV budget, profile one prefill of `max_num_batched_tokens` tokens and one decode
   at the largest captured batch size, then size the KV cache (`memory.plan_kv_cache`);
4. allocate the KV cache and the block-table pool;
5. on a GPU, compile the attention kernels' shape specialisations where the backend compiles per shape
   (`_warm_up`), and capture decode CUDA graphs where it is graph-safe (triton); the torch backend synchronises
   with the host inside its decode path, so it runs eagerly.

With `tensor_parallel_size` N > 1 this runner is rank 0: it holds its shard of the model (engine/tensor_parallel.py),
starts ranks 1..N-1 before loading it (engine/tp_ranks.py), and every call of its model is replayed by them. The
C++ CPU step cannot shard (its fused decode layer has no all-reduce between projections), so CPU ranks run the
torch modules with oneDNN-packed weights (logged); decode CUDA graphs are not captured across ranks yet, so a GPU
engine with N > 1 needs enforce_eager.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoConfig

from kernels.cpu_library import CpuKernelUnavailable
from omni_backend import checkpoints, paths
from omni_backend.engine import cpu_dtype, cpu_linear
from omni_backend.engine.attention.interface import AttentionMetadata, DecodePlans
from omni_backend.engine.attention.selector import select_attention
from omni_backend.engine.block_manager import BlockManager, BlockTablePool
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.cuda_graphs import DecodeGraphRunner, capture_batch_sizes
from omni_backend.engine.device import Device, HostToDeviceStaging
from omni_backend.engine.hidden_states import record_hidden_states
from omni_backend.engine.memory import GpuMemoryProfile, allocate_kv_cache, kv_block_bytes, plan_kv_cache
from omni_backend.engine.models import registry
from omni_backend.engine.models.llama import LlamaForCausalLM
from omni_backend.engine.prompt_logprobs import record_prompt_logprobs
from omni_backend.engine.sampler import Sampler, SampleResult
from omni_backend.engine.structured_output import apply_grammar_bitmask
from omni_backend.engine.scheduler import ScheduledBatch
from omni_backend.engine.sequence import Sequence
from omni_backend.engine.step_inputs import StepInputs, dummy_step, host_step, staging_capacity, upload_step
from omni_backend.engine.tensor_parallel import Shard
from omni_backend.engine.tp_ranks import DummyCall, RankSpec, StepCall, TensorParallelRanks, free_tcp_address
from omni_backend.ops.hardware import select_dtype

logger = logging.getLogger(__name__)

# Shapes whose Triton specialisations `_warm_up` compiles: (prefill sequences, decode sequences). Triton
# specialises integer arguments equal to 1 or divisible by 16 and pointers aligned to 16 bytes, so the prefill
# kernel needs 1, 2 and 16 sequences, and a decode part after 1 or 4 prefill rows starts its context lengths
# at an unaligned or an aligned offset.
WARM_UP_SHAPES = ((1, 0), (2, 0), (16, 0), (1, 1), (4, 1))
WARM_UP_PREFILL_TOKENS = 16  # per prefill sequence in a warm-up step


class ModelRunner:
    """Owns the model weights, the KV cache, the block-table pool and the CUDA graphs (see the module docstring).

    Attributes:
        architecture: the checkpoint's row of the model registry; language_model: the row whose model class and
            CPU step run its language model (`registry.language_model`).
        attention: the attention backend every layer calls (`attention/selector.py`).
        attention_backend: its name, "cpu", "torch" or "triton"; attention_reason: why it was chosen.
        matmuls: what runs the projections and the output head: "cpu-kernels-float32" / "cpu-kernels-int8" /
            "cpu-kernels-bfloat16" (the C++ kernels of kernels/linear_cpu.py, through the CPU step the registry
            names; bfloat16 where the CPU has AVX512-BF16), "onednn-packed" (CPU: float16, bfloat16 without
            AVX512-BF16, or a model without a CPU step), "torch" (GPUs, and CPUs where neither is available).
        matmul_kernel: the C++ step's microkernel (`CpuLlamaForward.kernel`), "" when the C++ step does not run.
        fallback_reason: why the attention backend or the matmuls are not the ones chosen first ("" when they
            are; both reasons joined by "; ").
        dtype: the torch dtype of weights and KV cache; dtype_reason: why (configured, by device, or measured:
            `cpu_dtype.choose`).
        graph_runner: the decode CUDA graphs, None when decode runs eagerly (CPU, enforce_eager, torch backend).
        kv_plan: the KV cache's size and how it was decided (`memory.KVCachePlan`); memory_profile: what a GPU
            engine measured before sizing it (None on CPU or with an explicit size); graph_pool_bytes: what
            capturing the CUDA graphs added to the reserved device memory (0 without graphs).
        shard: this runner's tensor-parallel rank (0) and the rank count; num_q_heads, num_kv_heads: the heads
            it holds; ranks: the other ranks (None with one).

    Raises (constructor):
        ValueError: unsupported architecture, max_model_len beyond the model, a KV budget without one block,
            quantization "int8" for a model without a CPU step, or a tensor_parallel_size the model or devices
            cannot take (more ranks than KV heads or GPUs; GPU ranks without enforce_eager).
        RuntimeError: a tensor-parallel rank failed to start (its reason in the message).
        RuntimeError: an explicitly requested attention backend fails its self-test.
        kernels.cpu_library.CpuKernelUnavailable: the "cpu" attention backend was requested explicitly, or
            quantization "int8", and the C++ kernels cannot be built here.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = Device(str(config.torch_device))
        self.device.bind_thread()
        self.shard = Shard(0, config.tensor_parallel_size)
        self.ranks: TensorParallelRanks | None = None
        if not self.device.is_cuda:
            # the engine's threads are split over its ranks, which share this machine's cores
            torch.set_num_threads(max(1, (config.cpu_threads or torch.get_num_threads()) // self.shard.size))
            logger.info("CPU engine: %d torch thread(s)%s", torch.get_num_threads(),
                        " per tensor-parallel rank" if self.shard.size > 1 else "")
        elif self.shard.size > 1 and not config.enforce_eager:
            raise ValueError(f"tensor_parallel_size {self.shard.size} on a GPU: decode CUDA graphs are not captured "
                             "across ranks yet; set enforce_eager true")
        self.architecture = checkpoints.architecture(config.model_path)  # before transformers reads the config
        if config.talker:
            self.architecture = registry.talker(self.architecture)
        checkpoint_config = AutoConfig.from_pretrained(config.model_path)
        self.language_model = registry.language_model(self.architecture,
                                                      checkpoint_config.get_text_config().model_type)
        # the C++ CPU step cannot shard (see the module docstring)
        self.cpu_step = self.language_model.cpu_step if self.shard.size == 1 else None
        self.model_class = registry.load(self.language_model.model)
        hf_config = self.model_class.language_model_config(checkpoint_config, self.architecture.multimodal)
        self.hf_config = hf_config
        self.dtype, self.dtype_reason, self._bf16_onednn = self._resolve_dtype(config, hf_config)
        heads = self.shard.heads(hf_config.num_attention_heads, hf_config.num_key_value_heads)
        self.num_q_heads, self.num_kv_heads = heads.num_q, heads.num_kv
        self.head_dim = checkpoints.head_dim(hf_config)
        max_positions = min(config.max_model_len, getattr(hf_config, "max_position_embeddings", 1 << 20))
        if config.max_model_len > max_positions:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {max_positions} positions")
        choice = select_attention(config.attention_backend, self.device.torch_device, self.num_q_heads,
                                  self.num_kv_heads, self.head_dim, self.dtype, config.block_size,
                                  str(paths.cache_dir() / "kernels"))
        self.attention = choice.backend
        self.attention_backend, self.attention_reason = choice.backend.name, choice.reason
        self.fallback_reason = choice.fallback_reason
        logger.info("architecture %s (language model: %s's); dtype %s (%s); device %s", self.architecture.name,
                    self.language_model.name, self.dtype, self.dtype_reason, self.device.torch_device)
        self.sampler = Sampler()
        self.num_eager_steps = 0
        self.num_step_sequences = 0  # sequences in the steps run, summed (over the steps: the mean batch size)
        self.graph_runner: DecodeGraphRunner | None = None
        self.graph_pool_bytes = 0
        self._graph_sizes = capture_batch_sizes(config.max_num_seqs)
        self._decode_plan = DecodePlans(self.attention, self._graph_sizes, self.num_q_heads, self.num_kv_heads,
                                        self.head_dim, config.max_blocks_per_seq * config.block_size,
                                        self.device.torch_device)
        self.staging = HostToDeviceStaging(staging_capacity(config.max_num_batched_tokens, config.max_num_seqs),
                                           self.device)
        try:
            self._set_up(max_positions)
        except BaseException:
            self.close()
            raise

    def _set_up(self, max_positions: int) -> None:
        """Start-up steps 2-5 (the module docstring), the other tensor-parallel ranks started first."""
        config, hf_config = self.config, self.hf_config
        if self.shard.size > 1:
            self.ranks = self._start_ranks(max_positions)
        self.model = self._build_model(max_positions)
        if self.ranks is not None:
            self.ranks.wait_ready()
        capture = self._graphs_wanted()
        # rank 0 holds the most KV heads (tensor_parallel.Shard.span), so its block size bounds every rank's
        block_bytes = kv_block_bytes(hf_config, config.block_size, self.dtype, self.num_kv_heads)
        profile = None
        if self.device.is_cuda and config.num_kv_blocks is None and not config.kv_cache_bytes:
            profile = self._profile_gpu_memory(capture)
        plan = plan_kv_cache(block_bytes, num_kv_blocks=config.num_kv_blocks, kv_cache_bytes=config.kv_cache_bytes,
                             gpu=profile, gpu_memory_utilization=config.gpu_memory_utilization)
        self.kv_plan, self.memory_profile, self.num_blocks = plan, profile, plan.num_blocks
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB): %s", plan.num_blocks, config.block_size,
                    plan.bytes / 2**20, plan.reason)
        if plan.num_blocks * config.block_size < config.max_model_len:
            logger.warning("KV cache holds %d tokens, less than max_model_len %d: requests longer than the cache "
                           "(e.g. without max_tokens) will be refused", plan.num_blocks * config.block_size,
                           config.max_model_len)
        self.kv_caches = self._allocate_kv_cache(plan.num_blocks)
        self.block_table_pool = BlockTablePool(config.max_num_seqs, config.max_blocks_per_seq, self.device)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, self.block_table_pool,
                                          config.enable_prefix_caching)
        logger.info("prefix caching %s", "on" if config.enable_prefix_caching else "off (enable_prefix_caching)")

        if self.device.is_cuda and self.attention.compiles_per_shape:
            self._warm_up()
        if capture:
            self._capture(profile)

    # --- start-up -------------------------------------------------------------------------------------------

    def _resolve_dtype(self, config: EngineConfig, hf_config) -> tuple[torch.dtype, str, bool]:
        """(dtype, why, whether bfloat16 runs on oneDNN rather than the C++ step). An explicit dtype is obeyed;
        quantization computes in float32; "auto" on a CPU with native bfloat16 and a model with a C++ CPU step
        is decided by measurement (`cpu_dtype.choose`, cached per CPU), elsewhere by the device
        (`ops.hardware.select_dtype`)."""
        if config.quantization != "none":
            return torch.float32, f"quantization {config.quantization} computes in float32", False
        dtype = select_dtype(config.dtype, self.device.torch_device)
        if config.dtype != "auto":
            return dtype, "configured", False
        if self.device.is_cuda or dtype != torch.bfloat16 or self.cpu_step is None:
            return dtype, "auto: by device", False
        choice = cpu_dtype.choose(cpu_dtype.LayerShape.of(hf_config), config.max_num_seqs,
                                  paths.cache_dir() / "kernels", paths.cache_dir())
        return choice.dtype, choice.reason, choice.path == "bfloat16-onednn"

    def _build_model(self, max_positions: int) -> LlamaForCausalLM:
        """The registry's model class (this rank's shard of it), built and loaded (`LlamaForCausalLM.build`)
        in its final dtype on the engine's device, then its CPU matmuls chosen."""
        model = self.model_class.build(self.hf_config, self.attention, max_positions, self.shard, self.dtype,
                                       self.device.torch_device, self.config.model_path,
                                       self.architecture.weight_prefixes)
        self.matmuls, self.matmul_kernel = "torch", ""
        if not self.device.is_cuda:
            self._use_cpu_matmuls(model)
        return model.eval()

    def _use_cpu_matmuls(self, model: LlamaForCausalLM) -> None:
        """The CPU step's matmuls (`matmuls`): for float32 and bfloat16 the C++ kernels through the CPU step the
        registry names for the model (models/llama_cpu.py; int8 panels with quantization "int8", bfloat16 panels
        and KV cache for bfloat16); where they cannot be built (bfloat16: a CPU without AVX512-BF16), a WARNING,
        the reason in `fallback_reason`, and oneDNN's packed weights as for float16 and for a model without a CPU
        step; unpacked torch weights where oneDNN cannot pack the dtype either.

        Raises:
            CpuKernelUnavailable: quantization "int8" and the C++ kernels cannot be built.
            ValueError: quantization "int8" for a model without a CPU step.
        """
        quantization = self.config.quantization
        step = self.cpu_step
        if step is None and self.shard.size > 1:
            logger.info("CPU matmuls: tensor_parallel_size %d: the C++ CPU step cannot shard (its fused decode "
                        "layer has no all-reduce), so every rank runs the torch modules", self.shard.size)
        elif step is None:
            if quantization != "none":
                raise ValueError(f"quantization {quantization} runs in a C++ CPU step, which the registry names "
                                 f"none for {self.language_model.name}")
            logger.info("CPU matmuls: %s has no C++ CPU step, its torch modules run", self.language_model.name)
        elif self.dtype == torch.float32 or (self.dtype == torch.bfloat16 and not self._bf16_onednn):
            weight_format = "bfloat16" if self.dtype == torch.bfloat16 else \
                "int8" if quantization == "int8" else "float32"
            try:
                forward = registry.load(step).build(model, paths.cache_dir() / "kernels", weight_format)
            except CpuKernelUnavailable as exc:
                if quantization != "none":
                    raise
                logger.warning("CPU matmuls: the C++ kernels cannot be built here, using oneDNN: %s", exc)
                self.fallback_reason = "; ".join(filter(None, [self.fallback_reason, f"cpu matmul kernels: {exc}"]))
            else:
                model.use_cpu_kernels(forward)
                self.matmuls, self.matmul_kernel = f"cpu-kernels-{forward.weight_format}", forward.kernel
                logger.info("CPU matmuls: C++ kernels, %s weights (%.0f MiB packed, %s microkernel)",
                            forward.weight_format, forward.weight_bytes / 2**20, forward.kernel)
                return
        if cpu_linear.packing_available(self.dtype):
            model.pack_for_cpu(self.config.max_num_seqs)
            self.matmuls = "onednn-packed"
            logger.info("CPU matmuls: oneDNN weights packed for %d rows", self.config.max_num_seqs)
        else:
            logger.warning("CPU matmuls: oneDNN cannot pack %s weights with this torch on this CPU, they stay "
                           "unpacked (slower decode steps)", self.dtype)

    def _graphs_wanted(self) -> bool:
        """Whether decode runs through CUDA graphs: on a GPU, with a graph-safe attention backend (triton), unless
        enforce_eager."""
        if not self.device.is_cuda:
            return False
        if self.config.enforce_eager:
            logger.info("CUDA graphs off (enforce_eager): decode runs eagerly")
            return False
        if not self.attention.graph_safe:
            logger.warning("attention backend %s on %s is not CUDA-graph safe (its decode path waits for the "
                           "device to size its gather): decode runs eagerly, with a kernel launch per op",
                           self.attention_backend, self.device.torch_device)
            return False
        return True

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return allocate_kv_cache(self.hf_config.num_hidden_layers, num_blocks, self.config.block_size,
                                 self.num_kv_heads, self.head_dim, self.dtype, self.device.torch_device)

    def _start_ranks(self, max_positions: int) -> TensorParallelRanks:
        """Ranks 1..N-1 started (tp_ranks.py) on the next GPUs after this engine's, or on this CPU.

        Raises:
            ValueError: fewer GPUs from this engine's on than ranks.
        """
        size, device = self.shard.size, self.device.torch_device
        if self.device.is_cuda:
            first = device.index if device.index is not None else torch.cuda.current_device()
            if first + size > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size {size} from cuda:{first} needs GPUs up to "
                                 f"cuda:{first + size - 1}; this machine has {torch.cuda.device_count()}")
            devices = tuple(f"cuda:{first + rank}" for rank in range(size))
        else:
            devices = ("cpu",) * size
        spec = RankSpec(
            self.language_model.model, self.hf_config, max_positions, self.architecture.weight_prefixes,
            self.config.model_path, self.dtype, self.attention_backend, str(paths.cache_dir() / "kernels"),
            self.config.block_size, self.config.max_num_seqs, self.config.max_blocks_per_seq,
            staging_capacity(self.config.max_num_batched_tokens, self.config.max_num_seqs), self.head_dim,
            tuple(self._graph_sizes), not self.device.is_cuda and cpu_linear.packing_available(self.dtype),
            torch.get_num_threads(), devices, free_tcp_address())
        return TensorParallelRanks(spec)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing with one rank); the runner takes no steps after it."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    @torch.inference_mode()
    def _profile_gpu_memory(self, graphs: bool) -> GpuMemoryProfile:
        """Measure this engine's peak device memory before the KV cache exists.

        Runs, on a temporary cache just large enough: one prefill of min(max_num_batched_tokens, max_model_len)
        tokens with logits and sampler-sized temporaries for max_num_seqs rows (the largest step), and, when
        graphs will be captured, one eager decode at the largest batch size, whose activations the graph pool
        will hold. Also compiles the prefill kernel for one sequence.
        """
        config, device = self.config, self.device.torch_device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        tokens = min(config.max_num_batched_tokens, config.max_model_len)
        caches = self._allocate_kv_cache(-(-tokens // config.block_size) + 1)
        hidden = self._dummy_forward(tokens, 1, 0, caches)
        rows = min(config.max_num_seqs, tokens)
        logits = self.model.compute_logits(hidden[-rows:])
        probs = logits.softmax(-1)  # the sampler's [rows, vocab] float32 temporaries
        probs.topk(min(64, probs.shape[-1]))
        del hidden, logits, probs
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_reserved(device)
        graph_pool = 0
        if graphs:
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._dummy_forward(0, 0, config.max_num_seqs, caches)
            torch.cuda.synchronize(device)
            graph_pool = torch.cuda.max_memory_allocated(device) - before
            peak = max(peak, torch.cuda.max_memory_reserved(device))
        del caches
        torch.cuda.empty_cache()
        free, total = self.device.memory_info()
        return GpuMemoryProfile(total=total, free=free, peak_torch=peak,
                                weights=torch.cuda.memory_allocated(device), graph_pool=graph_pool)

    def _dummy_forward(self, prefill_tokens: int, prefills: int, decodes: int, caches) -> torch.Tensor:
        """Hidden states of a step that writes nothing (`step_inputs.dummy_step`) on `caches`, the other ranks
        running it too."""
        if self.ranks is not None:
            self.ranks.send(DummyCall(prefill_tokens, prefills, decodes, caches[0][0].shape[0]))
        input_ids, positions, meta = dummy_step(prefill_tokens, prefills, decodes, self.config.max_blocks_per_seq,
                                                self._decode_plan, self.device.torch_device)
        return self.model(input_ids, positions, caches, meta)

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Compile the Triton kernels' specialisations (WARM_UP_SHAPES) now, not on the first requests."""
        for prefills, decodes in WARM_UP_SHAPES:
            tokens = prefills * WARM_UP_PREFILL_TOKENS
            if prefills + decodes <= self.config.max_num_seqs and tokens + decodes <= self.config.max_num_batched_tokens:
                self._dummy_forward(tokens, prefills, decodes, self.kv_caches)
        torch.cuda.synchronize(self.device.torch_device)

    def _capture(self, profile: GpuMemoryProfile | None) -> None:
        device = self.device.torch_device
        before = torch.cuda.memory_reserved(device)
        width = self.model.embed_tokens.weight.shape[1] if self.model.decodes_from_embeds else None
        self.graph_runner = DecodeGraphRunner(self._decode_forward, self.config.max_num_seqs,
                                              self.config.max_blocks_per_seq, device, embed_width=width,
                                              embed_dtype=self.dtype)
        with torch.inference_mode():
            self.graph_runner.capture_all()
        grown = self.graph_pool_bytes = torch.cuda.memory_reserved(device) - before
        logger.info("captured CUDA graphs for decode batch sizes %s (split-KV partitions %s); the graph pool took "
                    "%.1f MiB", self.graph_runner.batch_sizes,
                    [self._decode_plan(size)[0] for size in self.graph_runner.batch_sizes], grown / 2**20)
        if profile is not None and grown > profile.graph_pool + 64 * 2**20:
            logger.warning("the CUDA-graph pool took %.1f MiB, more than the %.1f MiB the KV budget set aside",
                           grown / 2**20, profile.graph_pool / 2**20)

    # --- one step ---------------------------------------------------------------------------------------------

    def _decode_forward(self, input_ids, positions, slot_mapping, context_lens, block_tables,
                        input_embeds=None) -> torch.Tensor:
        """A decode-only forward pass over these [b] inputs (what the CUDA graphs capture per batch size)."""
        splits, workspace = self._decode_plan(input_ids.shape[0])
        meta = AttentionMetadata(slot_mapping, 0, None, None, None, context_lens, block_tables, splits, workspace)
        return self.model(input_ids, positions, self.kv_caches, meta, input_embeds=input_embeds)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [T, hidden] of the step (decode-only steps replay a CUDA graph where one fits)."""
        self.num_step_sequences += inputs.num_seqs
        tables = self.block_table_pool.tables.index_select(0, inputs.pool_rows)
        embeds = inputs.input_embeds(self.model.embed_tokens)
        if inputs.is_decode_only and self.graph_runner is not None:
            if embeds is None and self.graph_runner.input_embeds is not None:
                embeds = self.model.embed_tokens(inputs.input_ids)
            hidden = self.graph_runner.run(inputs.input_ids, inputs.positions, inputs.slot_mapping,
                                           inputs.context_lens, tables, embeds)
            if hidden is not None:
                return hidden
        self.num_eager_steps += 1
        meta = inputs.attention_metadata(tables, self._decode_plan)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta, input_embeds=embeds)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SampleResult | None]:
        """Run one step; returns the sequences that sampled a token (in order) and their samples.

        Sequences that ask for their hidden states get this step's rows (engine/hidden_states.py). The sequences'
        computed-token counts advance only once the whole step (forward and sampling) has succeeded, so a step that raises (a CUDA out-of-memory error) can be scheduled again as it was; then the
        blocks they filled are offered to the prefix cache.
        """
        host, sampled = host_step(batch, self.block_manager.block_size)
        inputs = upload_step(host, self.staging, sampled)
        if self.ranks is not None:  # the host arrays: no rank waits for a copy back from this device
            self.ranks.send(StepCall(host, [seq.block_table for seq in batch.seqs], self.num_blocks))
        hidden = self._forward(inputs)
        if any(seq.params.prompt_logprobs is not None for seq in batch.seqs[:batch.num_prefills]):
            record_prompt_logprobs(batch, hidden, self.model.compute_logits)
        if any(seq.params.return_hidden_states for seq in batch.seqs):
            record_hidden_states(batch, inputs.input_ids, hidden, self.model.embed_tokens)
        result = None
        if inputs.sampled:
            rows = hidden if inputs.is_decode_only else hidden[inputs.logit_rows]
            logits = self.model.compute_logits(rows)
            apply_grammar_bitmask(logits, [seq.grammar for seq in inputs.sampled])
            result = self.sampler(logits, inputs.sampled)
        for seq, count in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += count
            self.block_manager.register_computed_blocks(seq)
        return inputs.sampled, result

    def release_step_memory(self) -> None:
        """Give the caching allocator's free blocks back to the device (after an out-of-memory step)."""
        self.device.release_cached_memory()
