"""The model registry (omni_backend/engine/models/registry.py): every class it names loads and fits its column, a
multimodal checkpoint's language model is the text architecture of its text config's model_type, reading the
table imports neither torch nor transformers, and an architecture without a C++ CPU step runs the generic path
(transformers' greedy tokens), never the Llama C++ step."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from omni_backend import checkpoints
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.models import registry
from omni_backend.engine.models.llama import LlamaForCausalLM
from omni_backend.engine.models.llama_cpu import CpuLlamaForward
from omni_backend.engine.models.registry import Architecture
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.stages.hf_prompt import ProcessorPrompt


@pytest.mark.parametrize("name", list(registry.ARCHITECTURES))
def test_every_class_the_registry_names_loads_and_fits_its_column(name):
    architecture = registry.ARCHITECTURES[name]
    assert architecture.name == name
    if architecture.model is not None:
        assert issubclass(registry.load(architecture.model), LlamaForCausalLM)
        assert architecture.model_type or architecture.multimodal  # a text row, or one that runs its own model
    if architecture.cpu_step is not None:
        assert registry.load(architecture.cpu_step) is CpuLlamaForward
    assert architecture.multimodal == (architecture.processor is not None)
    # every kind with an encoder has a placeholder; video is read by the image encoder
    assert set(architecture.placeholders) - {"video"} == set(architecture.encoders)
    assert "video" not in architecture.placeholders or "image" in architecture.encoders
    for kind, reference in architecture.encoders.items():
        encoder = registry.load(reference)
        assert issubclass(encoder, torch.nn.Module) and encoder.checkpoint_prefixes, reference
        assert kind in ("image", "audio")
    if architecture.processor is not None:
        processor = registry.load(architecture.processor)
        kinds = processor.kinds if isinstance(processor.kinds, frozenset) else {processor.kind}
        assert issubclass(processor, ProcessorPrompt) and kinds == set(architecture.placeholders)


def test_a_multimodal_language_model_is_the_text_architecture_of_its_model_type():
    llava = registry.lookup("LlavaForConditionalGeneration")
    assert registry.language_model(llava, "llama").name == "LlamaForCausalLM"
    assert registry.language_model(llava, "qwen2").name == "Qwen2ForCausalLM"
    qwen2 = registry.lookup("Qwen2ForCausalLM")
    assert registry.language_model(qwen2, "anything") is qwen2  # a text architecture runs its own model
    with pytest.raises(ValueError, match="a 'mistral' model, which no registered text architecture runs "
                                         r"\(model types: llama, qwen2\)"):
        registry.language_model(llava, "mistral")


def test_reading_the_table_imports_neither_torch_nor_transformers(tmp_path):
    """Preprocess reads it (omni_backend/stages/media_spec.py), so the lazy references must stay lazy."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2AudioForConditionalGeneration"]}))
    code = ("import sys; from omni_backend import checkpoints; a = checkpoints.multimodal_architecture(sys.argv[1]); "
            "print(a.name, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["Qwen2AudioForConditionalGeneration", "[]"]


def test_an_architecture_without_a_cpu_step_runs_the_generic_path(tiny_qwen2_path, tmp_path, monkeypatch):
    """A tiny Qwen2 checkpoint registered under another name whose row names no CPU step: float32 on the CPU, where
    Qwen2 itself runs the C++ step (test_greedy_matches_hf.py), it runs its torch modules and gives transformers'
    greedy tokens; the Llama C++ step is never built."""
    folder = tmp_path / "generic"
    shutil.copytree(tiny_qwen2_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["TinyGenericForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setitem(registry.ARCHITECTURES, "TinyGenericForCausalLM", Architecture(
        "TinyGenericForCausalLM", model="omni_backend.engine.models.qwen2:Qwen2ForCausalLM", model_type="generic"))

    def never(*args, **kwargs):
        raise AssertionError("the Llama C++ step was built for an architecture without a CPU step")

    monkeypatch.setattr(CpuLlamaForward, "build", never)
    engine = LLMEngine(EngineConfig(model_path=str(folder), dtype="float32", num_kv_blocks=32, max_num_seqs=4,
                                    max_num_batched_tokens=32, max_model_len=128))
    runner = engine.runner
    assert checkpoints.architecture(folder).cpu_step is None and runner.model.cpu_forward is None
    assert runner.matmuls in ("onednn-packed", "torch") and runner.fallback_reason == ""
    prompts = [list(range(200, 237)), [42, 43, 44]]
    ours = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for prompt, out in zip(prompts, ours):
            want = reference.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
            assert out.token_ids == want
    with pytest.raises(ValueError, match="quantization int8 runs in a C\\+\\+ CPU step, which the registry names "
                                         "none for TinyGenericForCausalLM"):
        LLMEngine(EngineConfig(model_path=str(folder), quantization="int8", num_kv_blocks=32, max_model_len=128))
