// One decode-only step of the Llama-family model in one call (float32 activations; the projections' weights float32,
// int8 or bfloat16, the KV cache float32 or bfloat16): every layer's RMSNorm, QKV projection, RoPE
// with the K/V cache write, paged attention, output projection, RMSNorm, gate/up projection, SiLU * up and down
// projection, then the final RMSNorm. The C ABI below is called through ctypes by kernels/cpu_decode_step.py,
// which documents the contract; this file holds only the orchestration. This is the layer of
// omni_backend/engine/models/llama.py: only the architectures whose model registry row names it run it.
//
// It calls the same C functions, in the same order, as the per-op path of omni_backend/engine/models/llama_cpu.py
// (kernels/linear_cpu.cpp, cpu_ops.cpp, paged_decode_cpu.cpp, each built as its own library with its own flags),
// through pointers the wrapper takes from those libraries: the results are bit-identical to that path; what goes
// is Python's per-op cost (argument checks, ctypes calls, tensor allocations), about 30 % of a batch-1 step.

#include <cstdint>

extern "C" {

typedef void (*LinearF32)(const float*, int64_t, int64_t, int64_t, const float*, int64_t, const float*, float*,
                          int64_t, int64_t);
typedef void (*LinearI8)(const float*, int64_t, int64_t, int64_t, const uint8_t*, const float*, int64_t,
                         const float*, float*, int64_t, int64_t);
typedef void (*LinearBf16)(const float*, int64_t, int64_t, int64_t, const uint32_t*, int64_t, const float*, float*,
                           int64_t, int64_t);
typedef void (*RmsNorm)(const float*, int64_t, int64_t, int64_t, const float*, float, float*, int64_t);
typedef int64_t (*RopeStoreKv)(float*, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t*, const float*,
                               const float*, int64_t, const int64_t*, void*, void*, int64_t, int64_t);
typedef void (*SiluMul)(const float*, int64_t, int64_t, int64_t, float*, int64_t);
typedef int64_t (*PagedDecode)(const void*, const void*, const void*, const int32_t*, const int32_t*, void*, int64_t,
                               int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t*, const int64_t*,
                               const int64_t*, int64_t, const int64_t*, float);

// The kernels' entry points (linear_f32 / linear_i8 (linear_int8.cpp) / linear_bf16, rms_norm_f32, rope_store_kv_f32 and
// paged_decode_f32 for float32 caches or their _bf16 forms for bfloat16 ones, silu_mul_f32).
struct StepKernels {
  LinearF32 linear_f32;
  LinearI8 linear_i8;
  LinearBf16 linear_bf16;
  RmsNorm rms_norm;
  RopeStoreKv rope_store_kv;
  SiluMul silu_mul;
  PagedDecode paged_decode;
};

// A packed [n, k] weight: float32 or bfloat16 panels (scales null) or int8 codes (uint8) with their group scales
// and minimums (kernels/linear_int8.cpp); bias may be null.
struct StepProjection {
  const void* panels;
  const float* scales;
  const float* bias;
  int64_t n, k;
  int64_t bf16;  // 1: bfloat16 panels
};

struct StepLayer {
  StepProjection qkv, o, gate_up, down;
  const float* input_norm;
  const float* post_norm;
  float input_eps, post_eps;
  void* k_cache;  // [num_blocks, block_size, num_kv_heads, head_dim], contiguous, the kernels' cache dtype
  void* v_cache;
};

struct StepModel {
  StepKernels kernels;
  int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
  int64_t num_blocks, block_size, max_positions;
  float attention_scale, final_eps;
  const float* cos;  // [max_positions, head_dim]
  const float* sin;
  const float* final_norm;
  const StepLayer* layers;
};

}  // extern "C"

namespace {

void project(const StepKernels& k, const StepProjection& w, const float* x, int64_t rows, float* y, bool accumulate) {
  if (w.bf16)
    k.linear_bf16(x, rows, w.k, w.k, static_cast<const uint32_t*>(w.panels), w.n, w.bias, y, w.n, accumulate);
  else if (w.scales)
    k.linear_i8(x, rows, w.k, w.k, static_cast<const uint8_t*>(w.panels), w.scales, w.n, w.bias, y, w.n, accumulate);
  else
    k.linear_f32(x, rows, w.k, w.k, static_cast<const float*>(w.panels), w.n, w.bias, y, w.n, accumulate);
}

}  // namespace

extern "C" {

// Floats of scratch decode_step_f32 needs for `batch` rows.
int64_t decode_step_scratch_floats(const StepModel* m, int64_t batch) {
  const int64_t qkv = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
  return batch * (m->hidden + qkv + m->num_heads * m->head_dim + 3 * m->intermediate);
}

// x [batch, hidden] (the embeddings of the step's tokens; overwritten: the residual stream) -> out [batch, hidden],
// the hidden states after the final norm. positions, slots [batch] int64; block_tables [batch, table_stride]
// int32 with max_blocks usable columns; context_lens [batch] int32 (including the new token). Returns -1, or
// 1000 * layer + reason for the first check that failed (reason 1: a row's position or slot is out of range,
// 2: a row's context needs blocks outside its table or the cache); the step's results are then undefined.
int64_t decode_step_f32(const StepModel* m, float* x, int64_t batch, const int64_t* positions, const int64_t* slots,
                        const int32_t* block_tables, int64_t table_stride, int64_t max_blocks,
                        const int32_t* context_lens, float* scratch, float* out) {
  const StepKernels& k = m->kernels;
  const int64_t d = m->head_dim, q_size = m->num_heads * d, width = q_size + 2 * m->num_kv_heads * d;
  float* h = scratch;
  float* qkv = h + batch * m->hidden;
  float* attn = qkv + batch * width;
  float* gate_up = attn + batch * q_size;
  float* act = gate_up + batch * 2 * m->intermediate;
  const int64_t q_stride[3] = {width, d, 1};
  const int64_t kv_stride[3] = {m->block_size * m->num_kv_heads * d, m->num_kv_heads * d, d};
  const int64_t out_stride[3] = {q_size, d, 1};
  for (int64_t i = 0; i < m->num_layers; ++i) {
    const StepLayer& layer = m->layers[i];
    k.rms_norm(x, batch, m->hidden, m->hidden, layer.input_norm, layer.input_eps, h, m->hidden);
    project(k, layer.qkv, h, batch, qkv, false);
    if (k.rope_store_kv(qkv, batch, width, m->num_heads, m->num_kv_heads, d, positions, m->cos, m->sin,
                        m->max_positions, slots, layer.k_cache, layer.v_cache, m->num_blocks, m->block_size) >= 0)
      return 1000 * i + 1;
    if (k.paged_decode(qkv, layer.k_cache, layer.v_cache, block_tables, context_lens, attn, batch, m->num_heads,
                       m->num_kv_heads, d, m->block_size, m->num_blocks, max_blocks, q_stride, kv_stride, kv_stride,
                       table_stride, out_stride, m->attention_scale) >= 0)
      return 1000 * i + 2;
    project(k, layer.o, attn, batch, x, true);
    k.rms_norm(x, batch, m->hidden, m->hidden, layer.post_norm, layer.post_eps, h, m->hidden);
    project(k, layer.gate_up, h, batch, gate_up, false);
    k.silu_mul(gate_up, batch, m->intermediate, 2 * m->intermediate, act, m->intermediate);
    project(k, layer.down, act, batch, x, true);
  }
  k.rms_norm(x, batch, m->hidden, m->hidden, m->final_norm, m->final_eps, out, m->hidden);
  return -1;
}

}  // extern "C"
