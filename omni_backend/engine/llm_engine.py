"""The engine's step loop: admit requests, schedule, run the model, sample, detokenize, emit outputs."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer, GenerationConfig

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.detokenizer import IncrementalDetokenizer
from omni_backend.engine.hidden_states import take_hidden_rows
from omni_backend.engine.limits import check_context_length
from omni_backend.engine.model_runner import ModelRunner
from omni_backend.engine.sampling_params import InvalidSamplingParam, SamplingParams
from omni_backend.engine.scheduler import ScheduledBatch, Scheduler
from omni_backend.engine.sequence import InputAddends, PromptEmbeds, PromptPositions, Sequence
from omni_backend.engine.structured_output import GUIDE_FIELD, GrammarCompiler, matcher

logger = logging.getLogger(__name__)

NON_FINITE_LOGITS = "the model produced non-finite logits (NaN or Inf) for this request"
GRAMMAR_WAIT_S = 0.005  # the longest a step with nothing to run waits for a grammar being compiled


@dataclass
class TokenLogprob:
    """Logprob of a token (natural log; None for a prompt's first token) and the top alternatives as (token_id,
    logprob)."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """What a request produced since its previous output.

    Attributes:
        text: released text delta (the whole text for non-streamed requests).
        token_ids: generated token ids in this delta (stop tokens excluded).
        finish_reason: None while running, else "stop", "length", "abort" or "error" (the engine could not go on
            with this request alone; `error` says why).
        prompt_tokens, completion_tokens: cumulative counts (tokens).
        logprobs: one entry per token of `token_ids` when requested, else empty.
        prompt_logprobs: one entry per prompt token (the first with logprob None) in the request's first output
            when params.prompt_logprobs asks, else None.
        first_scheduled_time, first_token_time: `time.monotonic()` when the request first ran in a step and
            when its first token was sampled (None until then); for metrics.
        cached_tokens: prompt tokens whose KV the prefix cache supplied when the request was first admitted
            (tokens; 0 before admission or without a hit).
        error: why the request ended with finish_reason "error", else None.
        error_field: the SamplingParams attribute at fault when that error is the request's own (a guide that does
            not compile, or not in time; `error` then says what is wrong with it), else None.
        hidden_states, input_embeds: for a request with `params.return_hidden_states`, the last-layer hidden
            states and layer-0 input embeddings [k, hidden] float32 of the next k token positions (the prompt's
            first, from position 0; then each generated token fed back: engine/hidden_states.py); else None.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0
    error: str | None = None
    hidden_states: torch.Tensor | None = None
    input_embeds: torch.Tensor | None = None
    error_field: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def followed_by(self, later: "RequestOutput") -> "RequestOutput":
        """This delta and the same request's next one as a single delta (text and tokens joined, the later
        finish reason and cumulative counts). Raises ValueError for another request's output."""
        if later.request_id != self.request_id:
            raise ValueError(f"cannot join outputs of {self.request_id} and {later.request_id}")
        return RequestOutput(
            self.request_id, self.text + later.text, self.token_ids + later.token_ids, later.finish_reason,
            later.prompt_tokens, later.completion_tokens, self.logprobs + later.logprobs,
            self.first_scheduled_time if self.first_scheduled_time is not None else later.first_scheduled_time,
            self.first_token_time if self.first_token_time is not None else later.first_token_time,
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            later.cached_tokens, later.error, _joined(self.hidden_states, later.hidden_states),
            _joined(self.input_embeds, later.input_embeds), later.error_field,
        )


class _RequestState:
    """Engine-side bookkeeping next to a Sequence: detokenizer (None for a talker: its tokens are no text) and
    not-yet-emitted tokens."""

    def __init__(self, seq: Sequence, detokenizer: IncrementalDetokenizer | None):
        self.seq = seq
        self.detokenizer = detokenizer
        self.pending_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []
        self.text = ""  # accumulated text of non-streamed requests
        self.prompt_logprobs_sent = False


class LLMEngine:
    """Continuous-batching LLM engine over a paged KV cache. Not thread-safe: one thread drives `step`.

    A talker engine (`config.talker`) emits token ids without text and stops only at its requests'
    `stop_token_ids` (the folder's tokenizer and end-of-text ids are its thinker's).

    Attributes:
        stalled: the last step found nothing to run although requests are held (each waits for an input row:
            `Sequence.inputs_ready`); the engine loop then sleeps until a message comes.
        out_of_service: why the engine takes no more steps (None while it does): a step of an engine with
            tensor-parallel ranks failed, so the ranks are out of step or gone; only a restart brings it back.

    Raises (constructor): what ModelRunner raises.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)  # first: it names an unsupported architecture
        try:  # the folder's tokenizer files may still fail: then stop the tensor-parallel ranks started
            self.tokenizer = None if config.talker else AutoTokenizer.from_pretrained(config.model_path)
            self.eos_token_ids = set() if config.talker else self._eos_token_ids(config.model_path)
            # a talker reads codec ids, never text: it has no tokenizer to compile grammars against
            self.grammars = None if config.talker else GrammarCompiler(
                self.tokenizer, self.runner.model.embed_tokens.num_embeddings, sorted(self.eos_token_ids))
        except BaseException:
            self.runner.close()
            raise
        self.scheduler = Scheduler(self.runner.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.stalled = False
        self.out_of_service: str | None = None
        # requests whose grammar is compiling: (its future, when it was asked for), in arrival order
        self.awaiting_grammar: dict[str, tuple[concurrent.futures.Future, float]] = {}
        self.requests: dict[str, _RequestState] = {}
        self.num_steps = 0
        self.num_oom_recoveries = 0  # steps retried after a device out-of-memory error
        self._offline_ids = itertools.count()

    def _eos_token_ids(self, model_path: str) -> set[int]:
        ids: set[int] = set()
        try:
            eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:
            eos = None
        for value in (eos, self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(value)
        return ids

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (engine/tp_ranks.py; nothing with one rank). Call it once
        no step runs any more."""
        self.runner.close()

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def hidden_size(self) -> int:
        """Width of the model's input embeddings (a `prompt_embeds` row)."""
        return self.runner.model.embed_tokens.weight.shape[1]

    def make_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      prompt_embeds: PromptEmbeds | None = None,
                      prompt_positions: PromptPositions | None = None,
                      input_addends: InputAddends | None = None) -> Sequence:
        """A request checked against this engine, as the Sequence `add_sequence` queues. It reads only what never
        changes after construction, so another thread than the engine loop's may call it (the llm stage does, to
        refuse a request before it is queued).

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, prompt embeddings of the wrong shape
                or at positions outside the prompt, M-RoPE position ids for a model without M-RoPE or of the wrong
                shape or range (`PromptPositions.check`), input addends of another width than the model's input
                embeddings, or more tokens than the whole KV cache holds.
            ContextLengthExceeded: prompt + max_tokens over max_model_len.
        """
        num_prompt_tokens = len(prompt_token_ids)
        if num_prompt_tokens < 1:
            raise ValueError("prompt must contain at least one token")
        vocab = self.runner.model.embed_tokens.num_embeddings
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {min(prompt_token_ids)}.."
                             f"{max(prompt_token_ids)}")
        if prompt_embeds is not None:
            prompt_embeds.check(num_prompt_tokens, self.hidden_size)
        check_context_length(self.config.max_model_len, num_prompt_tokens, params.max_tokens)
        if prompt_positions is not None:
            model = self.runner.model
            if model.position_rows == 1:
                raise ValueError(f"prompt_positions are M-RoPE ids; {self.runner.language_model.name} takes a "
                                 f"token's index as its position")
            prompt_positions.check(num_prompt_tokens, params.max_tokens, model.max_positions)
        if input_addends is not None and input_addends.width != self.hidden_size:
            raise ValueError(f"input addends must be {self.hidden_size} wide (the model's input embeddings), got "
                             f"{input_addends.width}")
        total = num_prompt_tokens + params.max_tokens
        cache_tokens = self.runner.num_blocks * self.config.block_size
        if total > cache_tokens:
            raise ValueError(f"request needs {total} tokens of KV cache, the whole cache holds {cache_tokens}")
        return Sequence(request_id, prompt_token_ids, params, time.monotonic(), prompt_embeds, prompt_positions,
                        input_addends)

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a request made by `make_sequence`.

        Raises:
            ValueError: a request with this id is already in the engine.
        """
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id}")
        if seq.params.guide_type is None:
            self.scheduler.add(seq)
        elif self.grammars is None:
            raise InvalidSamplingParam(GUIDE_FIELD, "a talker engine decodes codec ids; it takes no grammar")
        else:  # scheduled once its grammar is compiled (`_admit_compiled`)
            future = self.grammars.submit(seq.params.guide_type, seq.params.guide)
            self.awaiting_grammar[seq.request_id] = (future, time.monotonic())
        detok = None if self.tokenizer is None else \
            IncrementalDetokenizer(self.tokenizer, seq.token_ids[:seq.num_prompt_tokens], seq.params.stop)
        self.requests[seq.request_id] = _RequestState(seq, detok)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt_embeds: PromptEmbeds | None = None,
                    prompt_positions: PromptPositions | None = None,
                    input_addends: InputAddends | None = None) -> None:
        """`add_sequence(make_sequence(...))`: queue a request; `prompt_embeds` replaces the token embeddings at
        given prompt positions; `prompt_positions` are the prompt's M-RoPE ids (models that read them);
        `input_addends` are added to its generated tokens' embeddings (a talker's).

        Raises:
            what `make_sequence` and `add_sequence` raise.
        """
        self.add_sequence(self.make_sequence(request_id, prompt_token_ids, params, prompt_embeds, prompt_positions,
                                             input_addends))

    def extend_inputs(self, request_id: str, rows: torch.Tensor | None, tail: torch.Tensor | None = None) -> None:
        """Give a held request more input addend rows [k, width] and, with `tail`, its last ones
        (`InputAddends.extend` / `finish`); nothing for a request no longer held (it ended).

        Raises:
            ValueError: a request without input addends, or rows `InputAddends` refuses.
        """
        state = self.requests.get(request_id)
        if state is None:
            return
        addends = state.seq.input_addends
        if addends is None:
            raise ValueError(f"request {request_id} takes no input addends")
        if rows is not None and rows.shape[0]:
            addends.extend(rows)
        if tail is not None:
            addends.finish(tail)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; returns its final output, None if unknown."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        self.awaiting_grammar.pop(request_id, None)
        self.scheduler.finish(state.seq, "abort")
        return self._emit(state, final=True)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs for requests with new text or that finished.

        A step that runs out of device memory frees what it held and is retried by the next steps with half the
        token budget (see scheduler.py); no request fails for it unless the budget is down to one token. A request
        whose logits come out non-finite (NaN or Inf) ends alone, with finish_reason "error"; the others go on.

        Raises:
            torch.OutOfMemoryError: a one-token step still runs out of memory.
            Exception: what a step of an engine with tensor-parallel ranks raises (out of memory included): the
                engine is then out of service (`out_of_service`), since the ranks cannot be brought back in step
                (one may wait in an all-reduce of the failed step, or be dead).
            RuntimeError: the engine is out of service (every later call).
        """
        if self.out_of_service is not None:
            raise RuntimeError(f"the llm engine is out of service: {self.out_of_service}")
        outputs = self._admit_compiled() if self.awaiting_grammar else []
        batch = self.scheduler.schedule()
        self.stalled = batch.empty and bool(self.requests) and not self.awaiting_grammar
        if batch.empty:
            if self.awaiting_grammar:  # nothing else to run: wait a little for a compile rather than spin
                concurrent.futures.wait([f for f, _ in self.awaiting_grammar.values()], timeout=GRAMMAR_WAIT_S,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
            return outputs
        self.num_steps += 1
        try:
            sampled, result = self.runner.execute(batch)
        except torch.OutOfMemoryError as exc:
            if self.runner.ranks is not None or not self._recover_from_out_of_memory(batch):
                self._note_failed_step(exc)
                raise
            return outputs
        except Exception as exc:
            self._note_failed_step(exc)
            raise
        self.scheduler.step_succeeded()
        if result is None:
            return outputs
        now = time.monotonic()
        failed = set(result.failed)
        for row, seq in enumerate(sampled):
            state = self.requests[seq.request_id]
            if row in failed:
                outputs.append(self._fail(state, NON_FINITE_LOGITS))
                continue
            token = result.token_ids[row]
            if seq.grammar is not None and not seq.grammar.accept_token(token):
                outputs.append(self._fail(state, f"the sampled token {token} does not fit the request's grammar"))
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.token_ids.append(token)
            reason = self._check_stop(state, token, result.logprobs[row])
            if reason is None and seq.grammar is not None and seq.grammar.is_terminated():
                reason = "stop"
            if reason is not None:
                self.scheduler.finish(seq, reason)
            output = self._emit(state, final=reason is not None)
            if output is not None:
                outputs.append(output)
        return outputs

    def _fail(self, state: _RequestState, error: str, field: str | None = None) -> RequestOutput:
        """End the request now with finish_reason "error" and `error` (`field`: the request's own setting at
        fault, see RequestOutput.error_field); its final output."""
        if field is None:
            logger.error("request %s: %s; ending it with an error", state.seq.request_id, error)
        self.scheduler.finish(state.seq, "error")
        output = self._emit(state, final=True)
        output.error, output.error_field = error, field
        return output

    def _recover_from_out_of_memory(self, batch: ScheduledBatch) -> bool:
        """After `batch` ran out of device memory: free what it held and halve the token budget; False when the
        budget is down to one token (the step cannot be made smaller)."""
        self.runner.release_step_memory()
        if not self.scheduler.shrink_token_budget():
            return False
        self.num_oom_recoveries += 1
        logger.warning("out of device memory in a step of %d tokens (%d sequences): retrying with a token budget "
                       "of %d for a while", batch.total_tokens, len(batch.seqs), self.scheduler.token_budget)
        return True

    def _note_failed_step(self, exc: Exception) -> None:
        """A failed step takes an engine with tensor-parallel ranks out of service: the others may be waiting in
        the step's all-reduces, or dead."""
        if self.runner.ranks is not None:
            self.out_of_service = f"a tensor-parallel step failed ({type(exc).__name__}: {exc})"

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar is ready, each with a matcher of its own; end those whose guide
        did not compile, or not within `grammar_compile_timeout_s`, with an error naming the guide."""
        outputs = []
        timeout = self.config.grammar_compile_timeout_s
        for request_id, (future, asked) in list(self.awaiting_grammar.items()):
            state = self.requests[request_id]
            params = state.seq.params
            if not future.done():
                if time.monotonic() - asked > timeout:
                    del self.awaiting_grammar[request_id]
                    self.grammars.forget(params.guide_type, params.guide)
                    outputs.append(self._fail(state, f"did not compile within {timeout:g} s "
                                              "(grammar_compile_timeout_s)", GUIDE_FIELD))
                continue
            del self.awaiting_grammar[request_id]
            error = future.exception()
            if isinstance(error, InvalidSamplingParam):
                outputs.append(self._fail(state, error.problem, error.field))
                continue
            if error is not None:
                outputs.append(self._fail(state, f"compiling its grammar failed: {error!r}"))
                continue
            state.seq.grammar = matcher(future.result())
            self.scheduler.add(state.seq)
        return outputs

    def _check_stop(self, state: _RequestState, token: int, logprob) -> str | None:
        seq, params = state.seq, state.seq.params
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return "stop"
        state.pending_ids.append(token)
        if logprob is not None:
            state.pending_logprobs.append(TokenLogprob(token, logprob[0], logprob[1]))
        if state.detokenizer is not None and state.detokenizer.add_token(token):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.config.max_model_len:
            return "length"
        return None

    def _emit(self, state: _RequestState, final: bool) -> RequestOutput | None:
        seq = state.seq
        delta = state.detokenizer.release(final) if state.detokenizer is not None else ""
        if not seq.params.stream:
            state.text += delta
            if not final:
                return None
            delta = state.text
        elif not final and not delta and not seq.hidden_rows and state.detokenizer is not None:
            return None  # hold ids until they produce visible text (incomplete UTF-8 or possible stop string)
        hidden, embeds = take_hidden_rows(seq)
        output = RequestOutput(seq.request_id, delta, state.pending_ids, seq.finish_reason if final else None,
                               seq.num_prompt_tokens, seq.num_output_tokens, state.pending_logprobs,
                               seq.first_scheduled_time, seq.first_token_time, self._prompt_logprobs(state),
                               seq.num_cached_tokens or 0, hidden_states=hidden, input_embeds=embeds)
        state.pending_ids = []
        state.pending_logprobs = []
        if final:
            del self.requests[seq.request_id]
        return output

    @staticmethod
    def _prompt_logprobs(state: _RequestState) -> list[TokenLogprob] | None:
        """The prompt's logprobs for the request's first output (None after it, or when not asked for)."""
        seq = state.seq
        if seq.params.prompt_logprobs is None or state.prompt_logprobs_sent:
            return None
        state.prompt_logprobs_sent = True
        return [TokenLogprob(token, logprob, top) for token, logprob, top in seq.prompt_logprobs]

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Offline batch generation: run all prompts to completion; returns one final output per prompt."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        finals: dict[str, RequestOutput] = {}
        ids = [f"offline-{next(self._offline_ids)}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params_list):
            self.add_request(request_id, prompt, SamplingParams(**{**p.__dict__, "stream": False}))
        while self.has_unfinished():
            for output in self.step():
                if output.finished:
                    finals[output.request_id] = output
        return [finals[i] for i in ids]


def _joined(first: torch.Tensor | None, second: torch.Tensor | None) -> torch.Tensor | None:
    """Rows of two consecutive outputs as one tensor (either may be None)."""
    if first is None or second is None:
        return second if first is None else first
    return torch.cat([first, second])
