"""The front door's `stage_endpoints` setting (OMNI_STAGE_ENDPOINTS) without a server: what it accepts and refuses at
start, where each backend's calls go, and a stage whose server does not listen: 503 naming the stage at once, and
readiness naming it. (With real servers: tests/serving/test_separate_stages_server.py.)"""

import asyncio

import pytest

from omni_backend.launch.ports import free_ports
from omni_backend.serving import errors
from omni_backend.serving.__main__ import parse_args
from omni_backend.serving.config import ServingConfig
from omni_backend.serving.front_door import FrontDoor
from omni_backend.stages.tts_options import SpeechOptions


def test_endpoints_are_read_and_each_backend_uses_its_own():
    config = ServingConfig.from_env({"OMNI_STAGE_ENDPOINTS": "tts=speech-host:8001, diffusion=[::1]:9001",
                                     "OMNI_TRITON_GRPC": "llm-host:8001"})
    assert config.stage_endpoints == {"tts": "speech-host:8001", "diffusion": "[::1]:9001"}
    door = FrontDoor(config)
    assert (door.speech.grpc_url, door.images.grpc_url) == ("speech-host:8001", "[::1]:9001")
    assert door.voice.grpc_url == "llm-host:8001" and door.pipelines["omni_chat"].grpc_url == "llm-host:8001"
    assert sorted(door.separate) == ["diffusion", "tts"]
    unset = FrontDoor(ServingConfig.from_env({"OMNI_TRITON_GRPC": "llm-host:8001"}))
    assert (unset.speech.grpc_url, unset.images.grpc_url, unset.separate) == ("llm-host:8001", "llm-host:8001", {})


@pytest.mark.parametrize("value, message", [
    ("tts=host", "setting stage_endpoints must be empty or comma-separated stage=host:port"),
    ("tts=host:8001,", "setting stage_endpoints must be empty or comma-separated stage=host:port"),
    ("tts:host:8001", "setting stage_endpoints must be empty or comma-separated stage=host:port"),
    ("llm=host:8001", "unknown stage 'llm'; the stages that can run on a server of their own: diffusion, tts"),
    ("tts=a:1,tts=b:2", "stage 'tts' is given twice"),
])
def test_malformed_values_and_unknown_stages_are_refused_at_start(value, message, capsys):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ServingConfig.from_env({"OMNI_STAGE_ENDPOINTS": value})
    with pytest.raises(SystemExit) as exited:
        parse_args(["--stage-endpoints", value])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_the_flag_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("OMNI_STAGE_ENDPOINTS", "tts=env-host:8001")
    assert parse_args([]).stage_endpoints == {"tts": "env-host:8001"}
    assert parse_args(["--stage-endpoints", "diffusion=flag-host:8001"]).stage_endpoints == {
        "diffusion": "flag-host:8001"}
    assert parse_args(["--stage-endpoints", ""]).stage_endpoints == {}


def test_a_stage_whose_server_is_down_fails_its_requests_with_503_naming_it():
    (port,) = free_ports(1)  # nothing listens there
    where = f"127.0.0.1:{port}"
    door = FrontDoor(ServingConfig(stage_endpoints={"tts": where, "diffusion": where}))

    async def run():
        try:
            with pytest.raises(errors.OpenAIError) as speech:
                await door.speech.speak("Hello.", SpeechOptions())
            with pytest.raises(errors.OpenAIError) as limits:
                await door.images.limits()
            with pytest.raises(errors.OpenAIError) as image:
                await door.images.generate({"prompt": "a cat", "width": 64, "height": 64, "steps": 1,
                                            "guidance_scale": 1.0, "seed": 0})
            return speech.value, limits.value, image.value, await door.stage_problems()
        finally:
            await door.close()

    speech, limits, image, problems = asyncio.run(run())
    for error, stage in ((speech, "tts"), (limits, "diffusion"), (image, "diffusion")):
        assert (error.status, error.code, error.retry_after) == (503, "service_unavailable", 1)
        assert error.message.startswith(f"the {stage} stage is unavailable (its tritonserver at {where}): ")
    assert sorted(problems) == ["diffusion", "tts"]
    assert problems["tts"].startswith(f"the tritonserver at {where} does not answer: ")
