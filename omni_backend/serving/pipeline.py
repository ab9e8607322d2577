"""The chat pipeline over Triton gRPC, driven stage by stage: the front door's own way through the stages that
the `omni_chat` entry point (omni_backend/stages/entry_points.py) runs inside Triton.

Why not one stream to `omni_chat`: the front door needs what happens between the stages (the prompt's token count
and text before the first token, a 400 before the HTTP status goes out, media encoded concurrently, the llm stage's
heartbeat watched while a stream waits), and a client's disconnect cancels the gRPC stream to `llm` directly (its
response sender reports `is_cancelled`, the engine aborts the sequence). So the front door runs the entry point's
steps itself, the models its config names (its `preprocess_model`, `llm_model` and `postprocess_model` parameters):

    preprocess  one unary call: prompt + settings -> token ids + sampling params (errors carry a gRPC status)
    llm         one gRPC stream per request, cancelled when the HTTP client goes away
    postprocess one unary call per llm response that carries logprobs (logprob ids -> token strings/bytes);
                the stage passes everything else through unchanged, so a response without logprobs skips
                the round trip (one per token per request: at concurrency 32 they took CPU from the engine)

The wiring (which model is which step, the tensors each takes and gives, the preprocess input types, the context
length) is read from Triton's model configs, not hard-coded; tensors go from step to step by name.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from omni_backend import tensor_names as T
from omni_backend.engine.config import EngineConfig
from omni_backend.operator_key import ADMIN_KEY_HEADER
from omni_backend.serving.errors import (OpenAIError, call_failed, dead_stage, from_triton, internal, invalid,
                                         unavailable)
from omni_backend.serving.triton_client import TritonGrpcUser, infer_to_completion, numeric_array
from omni_backend.settings import config_parameters, parse_field
from omni_backend.stages.entry_points import Steps
from omni_backend.stages.media_encoder import encoder_calls, splice_embeddings
from omni_backend.stages.postprocess import carries_logprobs
from omni_backend.vocabulary import BY_PARAM


@dataclass
class StepWiring:
    """One step: its model and how its tensors map to the pipeline's tensor names."""

    model: str
    inputs: dict[str, str]  # step input -> pipeline tensor
    outputs: dict[str, str]  # step output -> pipeline tensor


@dataclass
class PipelineInfo:
    """What the front door learned about one served model from Triton.

    Attributes:
        name: the entry point's name (the OpenAI `model` id).
        preprocess, llm, postprocess: the steps (postprocess may be None).
        input_types: preprocess input name -> Triton datatype ("BYTES", "INT32", ...).
        max_model_len: longest prompt + completion in tokens (the llm's `max_model_len` parameter).
        created: when the front door first saw it (Unix seconds), for `/v1/models`.
    """

    name: str
    preprocess: StepWiring
    llm: StepWiring
    postprocess: StepWiring | None
    input_types: dict[str, str]
    max_model_len: int | None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def accepts_token_ids(self) -> bool:
        return T.PROMPT_TOKEN_IDS in self.input_types


@dataclass
class Prepared:
    """A request after preprocess: the tensors the llm takes, and what the prompt was."""

    tensors: dict[str, np.ndarray]
    prompt_tokens: int
    prompt_text: str
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # llm inputs not from preprocess (prompt_embeds)


@dataclass
class Step:
    """One response of the pipeline (one text delta when streaming, the whole text otherwise).

    Attributes:
        text: the text delta (the whole text when not streaming).
        finish_reason: None until the last Step, then "stop", "length" or "abort".
        prompt_tokens, completion_tokens: cumulative token counts.
        logprobs, prompt_logprobs: postprocess's logprob entries, None when not asked for.
        cached_tokens: prompt tokens whose KV the llm stage's prefix cache supplied (0 without a hit, or from a
            pipeline whose wiring does not carry `cached_tokens`).
        rows: the thinker's `hidden_states` and `input_embeds` [k, H] of a request that asked for them (a spoken
            answer in the model's own voice, serving/voiced.py), else empty.
    """

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict] | None
    prompt_logprobs: list[dict] | None = None
    cached_tokens: int = 0
    rows: dict[str, np.ndarray] = field(default_factory=dict)


WATCH_INTERVAL_S = 1.0  # how often a request waiting on the llm stream checks the stage's heartbeat

def _datatype(config_type: str) -> str:
    name = config_type.removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def _scalar(array: np.ndarray | None, default=None):
    if array is None:
        return default
    value = np.asarray(array).reshape(-1)[0]
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value.item()


class TritonPipeline(TritonGrpcUser):
    """One served model: a chat entry point of preprocess -> decoupled llm [-> postprocess] on a Triton server.

    Args:
        grpc_url: Triton's gRPC endpoint, `host:port`.
        model: the entry point's name.
        watch: a StageWatch (serving/metrics.py); while a request waits on the llm stream, the llm stage's
            heartbeat is checked every WATCH_INTERVAL_S seconds and a silent stage ends the request with 503.
    """

    def __init__(self, grpc_url: str, model: str = "omni_chat", watch=None):
        super().__init__(grpc_url)
        self.model = model
        self.watch = watch  # a serving.metrics.StageWatch: ends streams of a stage that died (None: no watch)
        self._info: PipelineInfo | None = None
        self._lock = asyncio.Lock()
        # unary stages whose last call found their stub dead (Triton's message): `ready()` is False while any is
        # here. This Triton build restarts no stub and keeps the model READY; a failed call is the first sign
        # a request sees (the stage's heartbeat goes stale about 3 s after the death, whether or not a request
        # comes); a later successful call to the stage clears it.
        self.down_stages: dict[str, str] = {}

    async def ready(self) -> bool:
        """True when Triton answers, the entry point is ready and no unary stage was found dead (`down_stages`)."""
        if self.down_stages:
            return False
        try:
            return bool(await self.client.is_server_ready() and await self.client.is_model_ready(self.model))
        except (InferenceServerException, grpc.RpcError, OSError):
            return False

    async def info(self) -> PipelineInfo:
        """The pipeline's wiring, read from Triton once and kept.

        Raises:
            OpenAIError: 503 when Triton cannot be asked; 500 when the model is not a pipeline we can drive.
        """
        if self._info is None:
            async with self._lock:
                if self._info is None:
                    self._info = await self._discover()
        return self._info

    async def _config(self, model: str) -> dict:
        try:
            return (await self.client.get_model_config(model, as_json=True))["config"]
        except InferenceServerException as exc:
            raise unavailable(f"cannot read the config of model '{model}' from Triton: {exc.message()}") from None

    async def _discover(self) -> PipelineInfo:
        config = await self._config(self.model)
        try:
            steps = Steps.from_parameters(config_parameters(config))
        except ValueError as exc:
            raise internal(f"model '{self.model}' is not a chat entry point: {exc}") from None
        if steps.media or steps.tts:
            raise internal(f"model '{self.model}' is not a text chat entry point (preprocess -> llm [-> postprocess])")
        preprocess, llm = await self._config(steps.preprocess), await self._config(steps.llm)
        if not llm.get("model_transaction_policy", {}).get("decoupled"):
            raise internal(f"the llm step of model '{self.model}', '{steps.llm}', is not decoupled")
        to_llm = [name for name in _names(preprocess, "output") if name in _names(llm, "input")]
        postprocess = None
        from_llm = _names(llm, "output")
        if steps.postprocess is not None:
            config = await self._config(steps.postprocess)
            from_llm = _names(config, "input")
            postprocess = StepWiring(steps.postprocess, _same(from_llm), _same(_names(config, "output")))
            from_llm += [n for n in (T.HIDDEN_STATES, T.INPUT_EMBEDS) if n in _names(llm, "output")]  # for a voice
        parameters = config_parameters(llm) or config_parameters(preprocess)
        max_model_len = parse_field(EngineConfig, "max_model_len", parameters.get("max_model_len")) \
            if parameters.get("max_model_len") else None
        input_types = {i["name"]: _datatype(i["data_type"]) for i in preprocess.get("input", [])}
        return PipelineInfo(self.model, StepWiring(steps.preprocess, _same(_names(preprocess, "input")), _same(to_llm)),
                            StepWiring(steps.llm, _same(to_llm), _same(from_llm)), postprocess, input_types,
                            max_model_len)

    async def prepare(self, text: str, token_ids: list[int] | None, settings: dict, prompt_field: str,
                      request_id: str = "", template: dict[str, bool | str] | None = None) -> Prepared:
        """Run preprocess on one prompt.

        Args:
            text: the prompt text (a plain prompt, or the messages as preprocess's JSON array); "" with token ids.
            token_ids: a prompt given as token ids (sent as `prompt_token_ids`), or None.
            settings: SamplingParams attribute -> value (`omni_backend.vocabulary` names), the settings given;
                without max_tokens preprocess takes the rest of the context.
            prompt_field: the request field holding the prompt ("messages" or "prompt"), for error messages.
            template: chat template inputs given (preprocess's BOOL inputs `add_generation_prompt`,
                `continue_final_message`, the request fields of the same names; its `tools` JSON).

        Raises:
            OpenAIError: 400 for bad input (the field named as the client knows it), 503 when Triton is
                unavailable, 500 otherwise.
        """
        info = await self.info()
        values = [(T.TEXT_INPUT, text, prompt_field)]
        if token_ids is not None:
            if not info.accepts_token_ids:
                raise invalid("this model does not take prompts as token ids", prompt_field)
            values.append((T.PROMPT_TOKEN_IDS, token_ids, prompt_field))
        values += [(BY_PARAM[param].tensor, value, BY_PARAM[param].openai[0]) for param, value in settings.items()]
        values += [(name, value, name) for name, value in (template or {}).items()]
        by_tensor = {tensor: name for name, tensor in info.preprocess.inputs.items()}
        inputs = []
        for name, value, field_name in values:
            stage_name = by_tensor.get(name, name)
            datatype = info.input_types.get(stage_name)
            if datatype is None:
                raise internal(f"model '{info.preprocess.model}' has no input '{stage_name}'")
            items = value if isinstance(value, (list, tuple)) else [value]
            if datatype == "BYTES":
                try:
                    array = np.array([str(v).encode("utf-8") for v in items], dtype=np.object_)
                except UnicodeEncodeError:  # JSON allows unpaired surrogates ("\ud800"); UTF-8 does not
                    raise invalid(f"{field_name} is not valid Unicode (it holds an unpaired surrogate)",
                                  field_name) from None
            else:
                array = numeric_array(items, datatype, field_name)
            tensor = grpcclient.InferInput(stage_name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        try:
            result = await infer_to_completion(self.client, info.preprocess.model, inputs, request_id=request_id)
        except InferenceServerException as exc:
            raise self._unary_error(info.preprocess.model, exc, prompt_field) from None
        self.down_stages.pop(info.preprocess.model, None)
        tensors = {name: result.as_numpy(name) for name in info.preprocess.outputs}
        ids = result.as_numpy(T.INPUT_IDS)
        prompt_tokens = int(ids.size) if ids is not None else 0
        prompt_text = _scalar(result.as_numpy(T.PROMPT_TEXT), "")
        extra = {}
        if result.as_numpy(T.MEDIA_PARTS) is not None:
            extra = await self._encode_media(result, prompt_field, request_id)
        return Prepared(tensors, prompt_tokens, prompt_text, extra=extra)

    async def _encode_media(self, result, prompt_field: str, request_id: str) -> dict[str, np.ndarray]:
        """Run every image/audio of a preprocessed request through its encoder stage, one Triton request per
        item, all at once (the encoders' dynamic batchers merge concurrent items, also across client requests).

        Returns:
            the llm's `prompt_embeds` [k, hidden] and `prompt_embed_positions` [k] (preprocess's placeholder
            positions, in the same order as the parts).
        """
        parts = json.loads(_scalar(result.as_numpy(T.MEDIA_PARTS)))
        if not parts:  # preprocess sends empty media outputs for text-only requests
            return {}
        try:
            calls = encoder_calls(parts, result.as_numpy(T.PIXEL_VALUES), result.as_numpy(T.INPUT_FEATURES))
        except ValueError as exc:
            raise internal(str(exc)) from None
        requests = []
        for call in calls:
            tensors = []
            for name, array in call.inputs.items():
                tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
                tensor.set_data_from_numpy(array)
                tensors.append(tensor)
            requests.append(infer_to_completion(self.client, call.model, tensors, request_id=request_id))
        try:
            results = await asyncio.gather(*requests)
        except InferenceServerException as exc:
            raise self._unary_error("encoder", exc, prompt_field) from None
        for call in calls:
            self.down_stages.pop(call.model, None)
        try:
            return splice_embeddings(parts, result.as_numpy(T.MEDIA_POSITIONS), calls,
                                     [r.as_numpy(T.EMBEDDINGS) for r in results])
        except ValueError as exc:
            raise internal(str(exc)) from None

    async def generate(self, prepared: Prepared, prompt_field: str, request_id: str = "") -> AsyncIterator[Step]:
        """Stream one request through llm (and postprocess); the last Step has a finish_reason.

        Closing the iterator (or cancelling the task consuming it) before the last Step cancels the gRPC
        stream, which makes the llm stage abort the sequence and free its KV blocks.

        Raises:
            OpenAIError: from the stream (classified by message) or from postprocess.
        """
        info = await self.info()
        from_preprocess = {tensor: name for name, tensor in info.preprocess.outputs.items()}
        inputs = []
        for llm_input, tensor_name in info.llm.inputs.items():
            array = prepared.tensors[from_preprocess[tensor_name]]
            if array is None:  # an optional output this preprocess did not send (prompt_positions without media)
                continue
            tensor = grpcclient.InferInput(llm_input, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        for name, array in prepared.extra.items():
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)

        async def one_request():
            yield {"model_name": info.llm.model, "inputs": inputs, "request_id": request_id}

        stream = self.client.stream_infer(one_request())
        finished = False
        try:
            while (item := await self._next_response(stream, info.llm.model)) is not None:
                result, error = item
                if error is not None:
                    finished = True  # the server ended this request itself
                    raise from_triton(error.message(), None, prompt_field)
                outputs = {}
                for name, tensor in info.llm.outputs.items():
                    array = result.as_numpy(name)
                    if array is not None:
                        outputs[tensor] = array
                rows = {name: outputs[name] for name in (T.HIDDEN_STATES, T.INPUT_EMBEDS) if name in outputs}
                if info.postprocess is not None:
                    if carries_logprobs(outputs):
                        outputs = await self._postprocess(info.postprocess, outputs, prompt_field, request_id)
                    else:
                        outputs = _passed_through(info.postprocess, outputs)
                step = self._step(outputs)
                step.rows = rows
                finished = bool(step.finish_reason)
                yield step
                if finished:
                    return
            finished = True
            raise internal(f"the {info.llm.model} stream ended before its final response")
        except grpc.aio.AioRpcError as exc:
            finished = True
            raise call_failed(exc.code().name, exc.details(), info.llm.model) from None
        finally:
            if not finished:
                stream.cancel()

    async def reset_prefix_cache(self, admin_key: str) -> int:
        """Make the llm stage drop every cached prompt prefix: its `reset_prefix_cache` input, with `admin_key` in
        the request parameter `omni-admin-key` (the stage takes only tritonserver's operator key). With several
        instances of the llm model (one per GPU) the request reaches one of them.

        Returns:
            the number of cached KV blocks dropped.

        Raises:
            OpenAIError: the stage's refusal (400 naming `omni-admin-key` when tritonserver's operator key is not
                `admin_key`), 503 when Triton or the stage is unavailable, 500 otherwise.
        """
        info = await self.info()
        flag = grpcclient.InferInput(T.RESET_PREFIX_CACHE, [1], "BOOL")
        flag.set_data_from_numpy(np.array([True]))

        async def one_request():
            yield {"model_name": info.llm.model, "inputs": [flag], "parameters": {ADMIN_KEY_HEADER: admin_key}}

        stream = self.client.stream_infer(one_request())
        answered = False
        try:
            item = await self._next_response(stream, info.llm.model)
            answered = True
        except grpc.aio.AioRpcError as exc:
            answered = True
            raise call_failed(exc.code().name, exc.details(), info.llm.model) from None
        finally:
            if not answered:
                stream.cancel()
        if item is None:
            raise internal(f"the {info.llm.model} stream ended before its answer to reset_prefix_cache")
        result, error = item
        if error is not None:
            raise from_triton(error.message(), None, None, lambda name: name)
        dropped = result.as_numpy(T.DROPPED_BLOCKS)
        if dropped is None:
            raise internal(f"the {info.llm.model} stage answered reset_prefix_cache without dropped_blocks")
        return int(_scalar(dropped))

    async def _next_response(self, stream, model: str):
        """The stream's next (result, error), or None at its end.

        Triton 2.51 never ends the streams of a Python stage whose stub process died (nor marks the model
        unready), so while waiting, the stage's heartbeat is checked every WATCH_INTERVAL_S seconds.

        Raises:
            OpenAIError: 503 when the stage has not published a heartbeat for STALE_AFTER_S seconds.
        """
        pending = asyncio.ensure_future(stream.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=WATCH_INTERVAL_S if self.watch else None)
                if done:
                    try:
                        return pending.result()
                    except StopAsyncIteration:
                        return None
                silent_s = await self.watch.silent(model)
                if silent_s is not None:
                    raise unavailable(f"the {model} stage stopped responding (no heartbeat for {silent_s:.0f} s: "
                                      "its process died or hangs)")
        finally:
            if not pending.done():
                pending.cancel()

    async def _postprocess(self, step: StepWiring, outputs: dict, prompt_field: str, request_id: str) -> dict:
        inputs = []
        for name, tensor_name in step.inputs.items():
            array = outputs.get(tensor_name)
            if array is None:
                continue
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        try:
            result = await infer_to_completion(self.client, step.model, inputs, request_id=request_id)
        except InferenceServerException as exc:
            raise self._unary_error(step.model, exc, prompt_field) from None
        self.down_stages.pop(step.model, None)
        return {tensor: result.as_numpy(name) for name, tensor in step.outputs.items()}

    def _unary_error(self, model: str, exc: InferenceServerException, prompt_field: str) -> OpenAIError:
        """`errors.from_triton` for a unary stage's failure; a dead stub also marks its stage down (see __init__)."""
        stage = dead_stage(exc.message())
        if stage is not None:
            self.down_stages[stage or model] = exc.message()
        return from_triton(exc.message(), exc.status(), prompt_field)

    @staticmethod
    def _step(outputs: dict) -> Step:
        return Step(
            text=_scalar(outputs.get(T.TEXT_OUTPUT), ""),
            finish_reason=_scalar(outputs.get(T.FINISH_REASON), "") or None,
            prompt_tokens=int(_scalar(outputs.get(T.PROMPT_TOKENS), 0)),
            completion_tokens=int(_scalar(outputs.get(T.COMPLETION_TOKENS), 0)),
            logprobs=_json_list(outputs, T.OUTPUT_LOGPROBS),
            prompt_logprobs=_json_list(outputs, T.PROMPT_TOKEN_LOGPROBS),
            cached_tokens=int(_scalar(outputs.get(T.CACHED_TOKENS), 0)),
        )


def _names(config: dict, kind: str) -> list[str]:
    """The names of a model config's tensors of `kind` ("input" or "output")."""
    return [tensor["name"] for tensor in config.get(kind, [])]


def _same(names: list[str]) -> dict[str, str]:
    """The wiring of tensors that keep their names from step to step."""
    return {name: name for name in names}


def _passed_through(postprocess: StepWiring, outputs: dict) -> dict:
    """What postprocess returns for a response without logprobs: each input, under its output's tensor name."""
    return {postprocess.outputs[name]: outputs[postprocess.inputs[name]] for name in postprocess.outputs
            if postprocess.inputs.get(name) in outputs}


def _json_list(outputs: dict, name: str) -> list[dict] | None:
    """The postprocess stage's logprob entries in output `name`, None when absent or "" (not asked for).

    Raises:
        OpenAIError: 500 for output that is not valid JSON.
    """
    text = _scalar(outputs.get(name), "")
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError as exc:
        raise internal(f"{name} is not valid JSON: {exc.msg}") from None
