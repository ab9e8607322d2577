"""omni_backend: stages, LLM engine and serving front door for omni-modality models on Triton."""
