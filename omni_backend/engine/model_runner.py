"""Runs the model for one scheduled batch: builds inputs, owns the KV cache, replays CUDA graphs, samples."""

from __future__ import annotations

import logging

import torch
from transformers import AutoConfig

from kernels.paged_decode_cpu import CpuKernelUnavailable
from omni_backend import paths
from omni_backend.engine.attention import AttentionMetadata, PagedAttention
from omni_backend.engine.block_manager import BlockManager, BlockTablePool
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.cuda_graphs import DecodeGraphRunner
from omni_backend.engine.models.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM
from omni_backend.engine.sampler import Sampler, SampleResult
from omni_backend.engine.scheduler import ScheduledBatch
from omni_backend.engine.sequence import Sequence
from omni_backend.ops.hardware import select_attention_backend, select_dtype

logger = logging.getLogger(__name__)


def kv_block_bytes(hf_config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, K and V: 2 * layers * block_size * kv_heads * head_dim * size."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * hf_config.num_hidden_layers * block_size * hf_config.num_key_value_heads * head_dim * element


class ModelRunner:
    """Owns the model weights, the KV cache, the block-table pool and the CUDA graphs.

    Raises (constructor):
        ValueError: unsupported architecture, or a cache too small for one max-length sequence.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.torch_device
        hf_config = AutoConfig.from_pretrained(config.model_path)
        architecture = (hf_config.architectures or ["?"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {architecture}; supported: {SUPPORTED_ARCHITECTURES}")
        self.hf_config = hf_config
        self.dtype = select_dtype(config.dtype, self.device)
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        attention = self._make_attention(config.attention_backend)
        max_positions = min(config.max_model_len, getattr(hf_config, "max_position_embeddings", 1 << 20))
        if config.max_model_len > max_positions:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {max_positions} positions")
        with torch.device("meta"):
            model = LlamaForCausalLM(hf_config, attention, max_positions)
        self.model = model.to_empty(device=self.device)
        self.model.place_rope_cache(self.device)
        self.model.load_weights(config.model_path)
        self.model.to(self.dtype).eval()

        self.num_blocks = self._num_kv_blocks()
        shape = (self.num_blocks, config.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(hf_config.num_hidden_layers)]
        self.block_table_pool = BlockTablePool(config.max_num_seqs, config.max_blocks_per_seq, self.device)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, self.block_table_pool)
        self.sampler = Sampler()
        self.graph_runner: DecodeGraphRunner | None = None
        self.num_eager_steps = 0
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graph_runner = DecodeGraphRunner(self._decode_forward, config.max_num_seqs,
                                                  config.max_blocks_per_seq, self.device)
            with torch.inference_mode():
                self.graph_runner.capture_all()
            logger.info("captured CUDA graphs for decode batch sizes %s", self.graph_runner.batch_sizes)

    def _make_attention(self, requested: str) -> PagedAttention:
        """The attention backend `select_attention_backend` picks; an automatic "cpu" whose C++ kernel cannot be
        built here falls back to "torch", with a warning that says why (the omni_attention_backend metric then
        reports "torch"). Sets `self.attention_backend`.

        Raises:
            CpuKernelUnavailable: "cpu" was requested explicitly and cannot be built.
        """
        self.attention_backend, reason = select_attention_backend(requested, self.device)
        scale = self.head_dim ** -0.5
        try:
            attention = PagedAttention(self.attention_backend, scale=scale,
                                       kernel_build_dir=str(paths.cache_dir() / "kernels"))
        except CpuKernelUnavailable as exc:
            if requested != "auto":
                raise
            logger.warning("attention backend cpu disabled, using torch: %s", exc)
            self.attention_backend, reason = "torch", "auto: the C++ decode kernel cannot be built here"
            attention = PagedAttention("torch", scale=scale)
        logger.info("attention backend: %s (%s); dtype %s", self.attention_backend, reason, self.dtype)
        return attention

    def _num_kv_blocks(self) -> int:
        config = self.config
        per_block = kv_block_bytes(self.hf_config, config.block_size, self.dtype)
        if config.num_kv_blocks is not None:
            blocks = config.num_kv_blocks
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            blocks = int(free * config.gpu_memory_utilization) // per_block
        else:
            blocks = config.kv_cache_bytes // per_block
        if blocks < 1:
            raise ValueError(f"KV cache budget holds no block of {per_block} bytes")
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB)", blocks, config.block_size,
                    blocks * per_block / 2**20)
        if blocks * config.block_size < config.max_model_len:
            logger.warning("KV cache holds %d tokens, less than max_model_len %d: requests longer than the cache "
                           "(e.g. without max_tokens) will be refused", blocks * config.block_size,
                           config.max_model_len)
        return blocks

    def _decode_forward(self, input_ids, positions, slot_mapping, context_lens, block_tables) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping, 0, None, None, None, context_lens, block_tables)
        return self.model(input_ids, positions, self.kv_caches, meta)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SampleResult | None]:
        """Run one step; returns the sequences that sampled a token (in order) and their samples."""
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        context_lens: list[int] = []
        query_start = [0]
        embed_rows: list[torch.Tensor] = []  # flattened token index of each replaced embedding
        embed_values: list[torch.Tensor] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        bm = self.block_manager
        for seq, count in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            end = start + count
            if seq.prompt_embeds is not None and start < seq.num_prompt_tokens:
                offsets, values = seq.prompt_embeds.in_range(start, end)
                embed_rows.append(offsets + len(token_ids))
                embed_values.append(values)
            token_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(bm.slot(seq, p) for p in range(start, end))
            rows.append(seq.pool_row)
            context_lens.append(end)
            query_start.append(query_start[-1] + count)
            if end == len(seq):
                logit_rows.append(len(token_ids) - 1)
                sampled.append(seq)

        device = self.device
        ids_t = torch.tensor(token_ids, dtype=torch.int64).to(device, non_blocking=True)
        pos_t = torch.tensor(positions, dtype=torch.int64).to(device, non_blocking=True)
        slots_t = torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True)
        rows_t = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        ctx_t = torch.tensor(context_lens, dtype=torch.int32).to(device, non_blocking=True)
        tables = self.block_table_pool.tables.index_select(0, rows_t)
        p = batch.num_prefills
        num_prefill_tokens = query_start[p]

        hidden = None
        if p == 0 and self.graph_runner is not None:  # decodes only: no prompt embeddings
            hidden = self.graph_runner.run(ids_t, pos_t, slots_t, ctx_t, tables)
        if hidden is None:
            self.num_eager_steps += 1
            meta = AttentionMetadata(
                slot_mapping=slots_t,
                num_prefill_tokens=num_prefill_tokens,
                prefill_query_start_loc=torch.tensor(query_start[:p + 1], dtype=torch.int32).to(device) if p else None,
                prefill_context_lens=ctx_t[:p] if p else None,
                prefill_block_tables=tables[:p] if p else None,
                decode_context_lens=ctx_t[p:] if p < len(rows) else None,
                decode_block_tables=tables[p:] if p < len(rows) else None,
            )
            embeds = None
            if embed_rows:
                embeds = self.model.embed_tokens(ids_t)
                rows_idx = torch.cat(embed_rows).to(device)
                embeds[rows_idx] = torch.cat(embed_values).to(device=device, dtype=embeds.dtype)
            hidden = self.model(ids_t, pos_t, self.kv_caches, meta, input_embeds=embeds)
        for seq, count in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += count
        if not sampled:
            return sampled, None
        logits = self.model.compute_logits(hidden[torch.tensor(logit_rows, device=device)])
        return sampled, self.sampler(logits.cpu() if device.type != "cpu" else logits, sampled)
