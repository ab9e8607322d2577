"""Triton glue for the audio_encoder stage (dynamic batching); the encoder: omni_backend/stages/media_encoder.py."""

from omni_backend.stages.media_encoder import EncoderModel


class TritonPythonModel(EncoderModel):
    KIND = "audio"
