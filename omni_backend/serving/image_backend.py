"""The `text2image` ensemble over gRPC (diffusion with dynamic batching -> png_encode;
omni_backend/stages/diffusion.py), with the diffusion stage's limits read from its config on Triton, so the front
door and the stage give the same answers."""

from __future__ import annotations

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from omni_backend import tensor_names as T
from omni_backend.serving import errors
from omni_backend.settings import config_parameters
from omni_backend.serving.triton_client import TritonGrpcUser, infer_to_completion, numeric_array
from omni_backend.stages.diffusion import ImageLimits

ENSEMBLE = "text2image"
STAGE = "diffusion"  # also its name in the front door's `stage_endpoints` setting
# The diffusion stage's tensors -> the OpenAI /v1/images/generations fields.
_STAGE_FIELDS = {T.WIDTH: "size", T.HEIGHT: "size"}  # the stage's tensors -> the OpenAI field


class ImageBackend(TritonGrpcUser):
    """The text2image ensemble over gRPC, with the diffusion stage's limits read from its config."""

    def __init__(self, grpc_url: str):
        super().__init__(grpc_url)
        self._limits: ImageLimits | None = None

    async def limits(self) -> ImageLimits:
        if self._limits is None:
            try:
                config = (await self.client.get_model_config(STAGE, as_json=True))["config"]
            except InferenceServerException as exc:
                raise errors.server_unavailable(exc.message(), (STAGE, self.grpc_url)) from None
            parameters = config_parameters(config)
            self._limits = ImageLimits.from_strings(parameters)
        return self._limits

    async def generate(self, values: dict) -> tuple[bytes, int]:
        """One image: (PNG bytes, seed used).

        Raises:
            OpenAIError: 400 naming the field for the stage's INVALID_ARG; 503 naming the stage when its
                tritonserver is unavailable (down: gRPC fails the call at once); 503/500 otherwise.
        """
        inputs = []
        for name, datatype, value in (
            (T.PROMPT, "BYTES", values["prompt"].encode("utf-8")), (T.WIDTH, "INT32", values["width"]),
            (T.HEIGHT, "INT32", values["height"]), (T.STEPS, "INT32", values["steps"]),
            (T.GUIDANCE_SCALE, "FP32", values["guidance_scale"]), (T.SEED, "INT64", values["seed"]),
        ) + (((T.NEGATIVE_PROMPT, "BYTES", values["negative_prompt"].encode("utf-8")),)
             if values.get("negative_prompt") is not None else ()):
            if datatype == "BYTES":
                array = np.array([[value]], dtype=np.object_)
            else:  # a value beyond the tensor's type is a 400 (numpy would wrap a seed or steps into range)
                array = numeric_array([value], datatype, _STAGE_FIELDS.get(name, name)).reshape(1, 1)
            tensor = grpcclient.InferInput(name, [1, 1], datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        try:
            result = await infer_to_completion(self.client, ENSEMBLE, inputs)  # never cancelled: see there
        except InferenceServerException as exc:
            raise errors.from_triton(exc.message(), exc.status(), None, lambda name: _STAGE_FIELDS.get(name, name),
                                     (STAGE, self.grpc_url)) from None
        return bytes(result.as_numpy(T.PNG).reshape(-1)[0]), int(result.as_numpy(T.USED_SEED).reshape(-1)[0])
