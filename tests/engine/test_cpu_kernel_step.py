"""The CPU engine's float32 step through the C++ kernels (models/llama_cpu.py), its weight-only int8 mode and its
bfloat16 step (AVX512-BF16 / AMX): int8 greedy tokens equal transformers' on the same dequantized weights (on VNNI
CPUs also through the kernel's 15-bit activations, which these prompts' tokens do not see), bfloat16
logits stay within the bf16 rounding of transformers' float32 ones; decode steps in one C++ call equal the
per-op path bit for bit; the fallback where the kernels cannot be built says why; int8 is refused where it cannot
run."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from kernels.cpu_decode_step import DecodeStepModel
from kernels.cpu_library import CpuKernelUnavailable, cpu_features
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")
HAS_BF16 = "avx512_bf16" in cpu_features().split()

def _config(path: str, **overrides) -> EngineConfig:
    settings = dict(model_path=path, dtype="float32", kv_cache_bytes=32 << 20, max_num_batched_tokens=64,
                    max_model_len=256)
    return EngineConfig(**{**settings, **overrides})


def _hf_on_the_engines_int8_weights(model_path: str, engine: LLMEngine):
    """transformers' model with every projection and the output head replaced by what the engine's int8 panels
    multiply by (q * s, dequantized), the input embeddings left in float32 as the engine keeps them."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untie from the input table
    missing, unexpected = model.load_state_dict(engine.runner.model.cpu_forward.dequantized_weights(), strict=False)
    assert not unexpected and all("norm" in name or "embed_tokens" in name or "bias" in name for name in missing)
    return model


@pytest.mark.parametrize("model_fixture", ["smollm2_path", "tiny_qwen2_path"])
def test_int8_greedy_equals_transformers_on_the_dequantized_weights(model_fixture, request):
    model_path = request.getfixturevalue(model_fixture)
    engine = LLMEngine(_config(model_path, quantization="int8"))
    assert engine.runner.matmuls == "cpu-kernels-int8" and engine.runner.dtype == torch.float32
    forward = engine.runner.model.cpu_forward
    assert forward.head.format == "int8" and all(layer.qkv.format == "int8" for layer in forward.layers)
    tokenizer = engine.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
               for q in ("What is the capital of France?", "Name three colors.", "Why is the sky blue?")]
    new_tokens = 10
    ours = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0))
    reference = _hf_on_the_engines_int8_weights(model_path, engine)
    with torch.no_grad():
        for prompt, out in zip(prompts, ours):
            want = reference.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
            if want and want[-1] == reference.generation_config.eos_token_id:
                want = want[:-1]  # the engine reports EOS as finish_reason "stop", not as a token
            assert out.token_ids == want
    if model_fixture == "smollm2_path":  # the real model still answers
        paris = engine.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=0.0))[0]
        assert "Paris" in paris.text
    # int8 codes are a quarter of the float32 panels, plus a float32 scale and minimum per 32 weights (0.3125)
    floats = LLMEngine(_config(model_path)).runner.model.cpu_forward
    assert forward.weight_bytes < 0.33 * floats.weight_bytes


@pytest.mark.skipif(not HAS_BF16, reason="this CPU has no AVX512-BF16")
def test_bfloat16_step_stays_close_to_float32_transformers(smollm2_path):
    """SmolLM2 in bfloat16 through the C++ step (bf16 panels, bf16 KV cache, float32 norms, softmax and residual
    stream) against transformers in float32 on the same, bf16-rounded, weights: every greedy token is
    transformers' top-1 and its logprob within 0.05 of transformers' (what rounding each projection's input and
    the K/V to bf16 costs: 0.004 measured on this project's AMX Xeon; a wrong cache or rounding mode is far out)."""
    engine = LLMEngine(_config(smollm2_path, dtype="bfloat16"))
    assert engine.runner.matmuls == "cpu-kernels-bfloat16"
    assert all(k.dtype == torch.bfloat16 for k, _ in engine.runner.kv_caches)
    forward = engine.runner.model.cpu_forward
    packed = [forward.head] + [w for layer in forward.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(w.format == "bfloat16" for w in packed)
    tokenizer = engine.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    ours = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, logprobs=0))[0]
    assert "Paris" in ours.text
    reference = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.bfloat16).float().eval()
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + ours.token_ids])).logits[0, len(prompt) - 1 : -1]
    want = torch.log_softmax(logits.double(), -1)
    chosen = want[torch.arange(len(ours.token_ids)), torch.tensor(ours.token_ids)]
    assert torch.equal(want.argmax(-1), torch.tensor(ours.token_ids)), "greedy tokens are transformers' top-1"
    got = torch.tensor([lp.logprob for lp in ours.logprobs], dtype=torch.float64)
    assert (got - chosen).abs().max() < 0.05, f"logprobs differ by {(got - chosen).abs().max():.3g}"


def test_without_a_compiler_float32_falls_back_to_onednn_and_int8_is_refused(tiny_qwen2_path, tmp_path,
                                                                             monkeypatch, caplog):
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path))  # nothing built yet
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with caplog.at_level(logging.WARNING, logger="omni_backend.engine.model_runner"):
        engine = LLMEngine(_config(tiny_qwen2_path))
    assert engine.runner.matmuls in ("onednn-packed", "torch")
    assert "CPU matmuls: the C++ kernels cannot be built here, using oneDNN: no C++ compiler" in caplog.text
    assert "cpu matmul kernels: no C++ compiler" in engine.runner.fallback_reason
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0] \
        .completion_tokens == 2
    with pytest.raises(CpuKernelUnavailable, match="no C\\+\\+ compiler"):
        LLMEngine(_config(tiny_qwen2_path, quantization="int8"))


def test_int8_is_refused_where_it_cannot_run(tiny_qwen2_path):
    with pytest.raises(ValueError, match="computes in float32"):
        _config(tiny_qwen2_path, quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="quantization must be one of none, int8"):
        _config(tiny_qwen2_path, quantization="fp8")
    with pytest.raises(ValueError, match="runs on CPU engines only"):
        _config(tiny_qwen2_path, quantization="int8", device="cuda")


@pytest.mark.parametrize("quantization,dtype", [("none", "float32"), ("int8", "float32"), ("none", "bfloat16")])
def test_decode_steps_in_one_call_equal_the_per_op_path(tiny_qwen2_path, quantization, dtype, monkeypatch):
    """kernels/cpu_decode_step runs a decode-only step in one C++ call; its tokens and logprobs equal those of the
    same engine running every kernel from Python, bit for bit (prefill and mixed steps stay op by op); bfloat16:
    bf16 panels and KV cache, float32 queries read it in both."""
    if dtype == "bfloat16" and not HAS_BF16:
        pytest.skip("this CPU has no AVX512-BF16")
    calls = []
    original = DecodeStepModel.__call__
    monkeypatch.setattr(DecodeStepModel, "__call__", lambda self, *a: calls.append(len(a[0])) or original(self, *a))
    prompts = [list(range(200, 237)), list(range(500, 505)), [42, 43]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    results = []
    for fused in (True, False):
        engine = LLMEngine(_config(tiny_qwen2_path, quantization=quantization, dtype=dtype, max_num_seqs=4,
                                   max_num_batched_tokens=16))
        assert engine.runner.matmuls == f"cpu-kernels-{'int8' if quantization == 'int8' else dtype}"
        if not fused:
            engine.runner.model.cpu_forward.decode_step = None
        outputs = engine.generate(prompts, params)
        results.append([[(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs] for o in outputs])
        if fused:
            assert calls and max(calls) == len(prompts), "decode-only steps ran in one call, all rows together"
            fused_calls = len(calls)
    assert len(calls) == fused_calls, "the per-op engine never called it"
    assert results[0] == results[1]


def test_the_one_call_decode_step_refuses_rows_out_of_range(tiny_qwen2_path):
    engine = LLMEngine(_config(tiny_qwen2_path))
    runner = engine.runner
    forward = runner.model.cpu_forward
    step = forward.decode_step.describe(forward, runner.kv_caches)
    hidden = runner.hf_config.hidden_size

    def run(position, slot, block):
        tables = torch.full((1, 4), block, dtype=torch.int32)
        return step(torch.zeros(1, hidden), torch.tensor([position]), torch.tensor([slot]), tables,
                    torch.tensor([1], dtype=torch.int32))

    assert run(0, 0, 0).shape == (1, hidden)
    with pytest.raises(ValueError, match="layer 0: a position or slot out of range"):
        run(forward.cos.shape[0], 0, 0)
    with pytest.raises(ValueError, match="layer 0: a position or slot out of range"):
        run(0, runner.num_blocks * runner.config.block_size, 0)
    with pytest.raises(ValueError, match="layer 0: a context needing blocks outside"):
        run(0, 0, runner.num_blocks)
    with pytest.raises(ValueError, match="x must be a contiguous torch.float32 CPU tensor"):
        step(torch.zeros(1, hidden + 1), torch.tensor([0]), torch.tensor([0]), torch.zeros(1, 4, dtype=torch.int32),
             torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="positions must be a contiguous torch.int64 CPU tensor"):
        step(torch.zeros(1, hidden), torch.tensor([0], device="meta"), torch.tensor([0]),
             torch.zeros(1, 4, dtype=torch.int32), torch.tensor([1], dtype=torch.int32))
    empty = step(torch.zeros(0, hidden), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                 torch.zeros(0, 4, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    assert empty.shape == (0, hidden)
    with pytest.raises(ValueError, match="0 cache pairs"):
        forward.decode_step.describe(forward, [])
    with pytest.raises(ValueError, match=r"block_size, num_kv_heads and head_dim at least 1, got \(\d+, 0, 2, "):
        forward.decode_step.describe(forward, [(c[:, :0], v[:, :0]) for c, v in runner.kv_caches])  # 0 would divide
    with pytest.raises(ValueError, match=r"cos must be .* of shape"):  # caches of another head_dim than the tables
        forward.decode_step.describe(forward, [(c[..., :-2].contiguous(), c[..., :-2].contiguous())
                                               for c, _ in runner.kv_caches])
