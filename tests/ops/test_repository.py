"""Rendering the model repository templates with settings (no server)."""

import pytest

from omni_backend import paths, repository
from omni_backend.repository import Settings, render_config, render_repository


def test_defaults_are_absolute_and_documented_values():
    settings = Settings.load(environ={})
    assert settings.llm_model_path == str(paths.models_dir() / "SmolVLM-SmolLM2-135M-Instruct")
    assert settings.llm_model_path.startswith("/")
    assert (settings.max_model_len, settings.max_num_seqs, settings.block_size) == (2048, 32, 16)
    assert settings.kv_cache_bytes == 0  # the device's default: 512 MiB on CPU, the utilisation share on a GPU
    assert (settings.dtype, settings.attention_backend) == ("auto", "auto")
    assert settings.max_queued_requests == 256
    assert (settings.enforce_eager, settings.gpu_memory_utilization) == (False, 0.75)
    # the GPU stages' shares leave room for CUDA contexts: llm + two encoders + diffusion < 1
    assert settings.gpu_memory_utilization + 2 * settings.encoder_gpu_memory_fraction \
        + settings.diffusion_gpu_memory_fraction <= 0.92


def test_environment_then_overrides():
    settings = Settings.load({"max_num_seqs": 4}, environ={"OMNI_MAX_MODEL_LEN": "512", "OMNI_MAX_NUM_SEQS": "8"})
    assert (settings.max_model_len, settings.max_num_seqs) == (512, 4)
    assert Settings.load(environ={"OMNI_MAX_QUEUED_REQUESTS": "0"}).max_queued_requests == 0  # 0: no limit


@pytest.mark.parametrize("overrides, fragment", [
    ({"max_model_length": 5}, "unknown repository setting"),
    ({"max_model_len": 0}, "setting max_model_len must be an integer >= 1, got 0"),
    ({"kv_cache_bytes": "lots"}, "setting kv_cache_bytes must be an integer >= 0, got 'lots'"),
    ({"max_queued_requests": -1}, "setting max_queued_requests must be an integer >= 0, got -1"),
    ({"gpu_memory_utilization": "1.5"}, "setting gpu_memory_utilization must be a number in \\(0, 1\\], got '1.5'"),
    ({"diffusion_gpu_memory_fraction": 0}, "setting diffusion_gpu_memory_fraction must be a number in \\(0, 1\\]"),
    ({"enforce_eager": "maybe"}, "setting enforce_eager must be true or false, got 'maybe'"),
    ({"device": "gpu"}, "setting device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    ({"quantization": "int8", "dtype": "bfloat16"}, "quantization int8 computes in float32"),
    ({"governor_power_fraction": "2"}, "setting governor_power_fraction must be a number in \\(0, 1\\]"),
])
def test_bad_settings_are_rejected(overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        Settings.load(overrides, environ={})


def test_llm_instance_group_follows_the_device_setting():
    assert repository.llm_instance_group("cpu") == "{ count: 1 kind: KIND_CPU }"
    assert repository.llm_instance_group("cuda") == "{ count: 1 kind: KIND_GPU }"  # one engine per GPU
    assert repository.llm_instance_group("cuda:2") == "{ count: 1 kind: KIND_GPU gpus: [ 2 ] }"
    assert repository.llm_instance_group("auto", cuda_available=lambda: True) == "{ count: 1 kind: KIND_GPU }"
    assert repository.llm_instance_group("auto", cuda_available=lambda: False) == "{ count: 1 kind: KIND_CPU }"
    # tensor parallel on GPUs: one instance whose engine spawns its ranks on the GPUs from the device setting's on
    assert repository.llm_instance_group("cuda", tensor_parallel_size=2) == "{ count: 1 kind: KIND_MODEL }"
    assert repository.llm_instance_group("cpu", tensor_parallel_size=2) == "{ count: 1 kind: KIND_CPU }"


def test_gpu_settings_are_rendered_into_the_llm_and_gpu_stage_configs(tmp_path):
    out = tmp_path / "repo"
    render_repository(out, models=["llm", "vision_encoder", "diffusion"], device="cuda:1", enforce_eager="true",
                      gpu_memory_utilization=0.6, kv_cache_bytes=1 << 30, encoder_gpu_memory_fraction=0.03)
    llm = (out / "llm" / "config.pbtxt").read_text()
    assert "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 1 ] } ]" in llm
    for key, value in (("enforce_eager", "true"), ("gpu_memory_utilization", "0.6"), ("kv_cache_bytes", "1073741824"),
                       ("device", "cuda:1")):
        assert f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}' in llm
    assert 'key: "gpu_memory_fraction" value: { string_value: "0.03" }' in (
        out / "vision_encoder" / "config.pbtxt").read_text()
    assert 'key: "gpu_memory_fraction" value: { string_value: "0.08" }' in (
        out / "diffusion" / "config.pbtxt").read_text()


def test_render_config_substitutes_and_escapes():
    settings = Settings.load({"llm_model_path": '/models/a "quoted" dir'}, environ={})
    text = render_config('# ${...} is left alone\nvalue: "${llm_model_path}" n: ${max_model_len}', settings)
    assert text == '# ${...} is left alone\nvalue: "/models/a \\"quoted\\" dir" n: 2048'
    with pytest.raises(ValueError, match=r"x.pbtxt: unknown placeholder \$\{nope\}"):
        render_config("${nope}", settings, "x.pbtxt")


def test_render_repository(tmp_path):
    out = tmp_path / "repo"
    assert render_repository(out, kv_cache_bytes=1 << 20, max_queued_requests=7)
    names = sorted(p.name for p in out.iterdir())
    # every template but voice: the default checkpoint has no talker
    assert names == [name for name in repository.model_names() if name != "voice"]
    assert {"preprocess", "llm", "postprocess", "omni_chat", "voice"} <= set(repository.model_names())
    for name in names:
        config = (out / name / "config.pbtxt").read_text()
        assert "${" not in config.replace("${...}", "")
        assert (out / name / "1").is_dir()
    assert (out / "preprocess" / "1" / "model.py").read_text() == (
        paths.MODEL_REPOSITORY_TEMPLATES / "preprocess" / "1" / "model.py").read_text()
    llm_config = (out / "llm" / "config.pbtxt").read_text()
    assert '"1048576"' in llm_config
    assert 'key: "max_queued_requests" value: { string_value: "7" }' in llm_config
    assert not render_repository(out, kv_cache_bytes=1 << 20, max_queued_requests=7)  # unchanged: left alone
    assert render_repository(out, models=["preprocess"])  # a subset replaces the folder
    assert sorted(p.name for p in out.iterdir()) == ["preprocess"]
    with pytest.raises(ValueError, match="no such model"):
        render_repository(out, models=["nope"])


def test_the_voice_stage_is_rendered_and_named_only_for_a_checkpoint_with_a_talker(tmp_path):
    """A Qwen2.5-Omni folder with its voices (spk_dict.pt) gets the voice model and omni_speech's voice_model;
    without them, or for the default checkpoint, neither (unless a list of models names voice)."""
    omni = tmp_path / "omni"
    omni.mkdir()
    (omni / "config.json").write_text('{"architectures": ["Qwen2_5OmniForConditionalGeneration"]}')
    template = (paths.MODEL_REPOSITORY_TEMPLATES / "omni_speech" / "config.pbtxt").read_text()
    line = 'parameters { key: "voice_model" value: { string_value: "%s" } }'
    assert line % "" in render_config(template, Settings(llm_model_path=str(omni)))  # no spk_dict.pt: no voices
    assert "voice" not in repository.served_models(Settings(llm_model_path=str(omni)))
    (omni / "spk_dict.pt").write_bytes(b"")
    assert line % "voice" in render_config(template, Settings(llm_model_path=str(omni)))
    assert line % "" in render_config(template, Settings.load(environ={}))
    assert repository.served_models(Settings(llm_model_path=str(omni))) == repository.model_names()
    assert "voice" not in repository.served_models(Settings.load(environ={}))
    render_repository(tmp_path / "repo", llm_model_path=str(omni))
    assert (tmp_path / "repo" / "voice" / "config.pbtxt").is_file()
    render_repository(tmp_path / "repo", models=["voice"])  # named: rendered (it answers UNAVAILABLE)
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["voice"]
    voice = render_config((paths.MODEL_REPOSITORY_TEMPLATES / "voice" / "config.pbtxt").read_text(),
                          Settings(llm_model_path=str(omni), talker_max_num_seqs=3, code2wav_num_steps=4))
    assert f'key: "model_path" value: {{ string_value: "{omni}" }}' in voice
    assert 'key: "talker_max_num_seqs" value: { string_value: "3" }' in voice
    assert 'key: "code2wav_num_steps" value: { string_value: "4" }' in voice
