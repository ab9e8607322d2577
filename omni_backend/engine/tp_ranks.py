"""The ranks of a tensor-parallel engine: rank 0 (the engine's own process) starts the others and makes them run
every call of its model with it.

nano-vllm's scheme (its `ModelRunner`: rank 0 schedules and sends each call to the other ranks; the ranks meet at
the all-reduces), written here for this engine:
- rank 0 starts ranks 1..N-1 as spawned processes (`multiprocessing` "spawn": no forked copy of a process that
  holds threads, CUDA state or Triton's stub); all join one `torch.distributed` process group over
  tcp://127.0.0.1 (gloo on CPU, NCCL on CUDA; rank r on cuda:(i + r) for an engine on cuda:i), then each loads its
  shard of the weights (engine/tensor_parallel.py) and says it is ready;
- before each call of its model rank 0 sends it (`send`), pickled, down a pipe to each rank: a step as its host
  arrays and block tables (`StepCall`: what rank 0 uploads itself, so nothing is copied back from its device), a
  GPU profiling or warm-up call as its shape (`DummyCall`). nano-vllm writes its calls to shared memory and wakes
  each rank with an event; a pipe per rank costs a copy and also tells a rank that rank 0 is gone. Each rank
  uploads the call, runs the same forward on its own KV cache, as many blocks as rank 0's cache for that call
  (its own KV heads only), and the ranks meet at the all-reduces. Only rank 0 computes logits and samples: the
  other ranks build no output head.

A rank that has exited fails rank 0's next call at once: its end of the pipe closed with it, so `send` fails
(rank 0 ignores SIGPIPE, as every Python process and Triton's Python stub do, and gets the error). A failed step
leaves the ranks out of step, so the engine takes no step after one (`LLMEngine.out_of_service`).

Shutdown: `close` asks every rank to stop, joins it, terminates one that does not exit within STOP_WAIT_S and
destroys the process group. The ranks are daemonic (multiprocessing terminates them when rank 0's interpreter
exits); a rank waiting for a call exits when its pipe closes (rank 0 killed); one blocked in an all-reduce fails
when its peer's connection drops, or after COLLECTIVE_TIMEOUT.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from omni_backend.engine.attention.interface import DecodePlans
from omni_backend.engine.attention.selector import select_attention
from omni_backend.engine.device import Device, HostToDeviceStaging
from omni_backend.engine.memory import allocate_kv_cache
from omni_backend.engine.models import registry
from omni_backend.engine.step_inputs import HostStep, block_tables, dummy_step, upload_step
from omni_backend.engine.tensor_parallel import Shard

logger = logging.getLogger(__name__)

# The longest a rank waits for its peers at the process group's start or in one all-reduce: far above one layer's
# compute on the slowest rank (seconds for a long CPU prefill chunk), and a failed peer still surfaces in minutes.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
STOP_WAIT_S = 10.0  # a rank asked to stop exits at once; past this it is terminated


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds its shard from (rank 0 resolved it: dtype, attention backend, devices).

    Attributes:
        model: "module:Class" of the language model (its registry row); hf_config: its transformers config.
        max_positions: RoPE table rows; prefixes: where the checkpoint keeps the language model's tensors.
        devices: the device of each rank ("cpu", or "cuda:N"); threads: torch threads of a CPU rank.
        pack: whether the projections run through oneDNN-packed weights (`LlamaForCausalLM.pack_for_cpu`), as
            rank 0's do; head_dim: the model's; capture_sizes: the decode batch-size buckets of split-KV plans.
        staging_capacity: int64 elements of one step's inputs (`step_inputs.staging_capacity`).
        init_method: the process group's rendezvous (tcp://127.0.0.1:<port>).
    """

    model: str
    hf_config: object
    max_positions: int
    prefixes: tuple[str, ...]
    model_path: str
    dtype: torch.dtype
    attention_backend: str
    kernel_dir: str
    block_size: int
    max_num_seqs: int
    max_blocks_per_seq: int
    staging_capacity: int
    head_dim: int
    capture_sizes: tuple[int, ...]
    pack: bool
    threads: int
    devices: tuple[str, ...]
    init_method: str

    @property
    def size(self) -> int:
        """The number of ranks, rank 0 included."""
        return len(self.devices)


def free_tcp_address() -> str:
    """tcp://127.0.0.1:<a port free now> for the process group's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


def _join_group(spec: RankSpec, rank: int) -> None:
    backend = "nccl" if spec.devices[rank].startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=spec.init_method, world_size=spec.size, rank=rank,
                            timeout=COLLECTIVE_TIMEOUT)


@dataclass
class StepCall:
    """A step as the other ranks run it: its host arrays, its sequences' block tables (block ids, in order) and
    the block count of rank 0's KV cache."""

    step: HostStep
    block_tables: list[list[int]]
    num_blocks: int


@dataclass
class DummyCall:
    """A step that writes nothing (`step_inputs.dummy_step`: rank 0's GPU profiling and warm-up) on a KV cache of
    `num_blocks` blocks."""

    prefill_tokens: int
    prefills: int
    decodes: int
    num_blocks: int


class _Rank:
    """A rank > 0: its shard of the model, its KV cache and split-KV plans; replays rank 0's calls."""

    def __init__(self, spec: RankSpec, shard: Shard, device: torch.device):
        config = spec.hf_config
        heads = shard.heads(config.num_attention_heads, config.num_key_value_heads)
        choice = select_attention(spec.attention_backend, device, heads.num_q, heads.num_kv, spec.head_dim,
                                  spec.dtype, spec.block_size, spec.kernel_dir)
        self.model = registry.load(spec.model).build(config, choice.backend, spec.max_positions, shard, spec.dtype,
                                                     device, spec.model_path, spec.prefixes,
                                                     head=False).eval()
        if spec.pack:
            self.model.pack_for_cpu(spec.max_num_seqs)
        self.plans = DecodePlans(choice.backend, spec.capture_sizes, heads.num_q, heads.num_kv, spec.head_dim,
                                 spec.max_blocks_per_seq * spec.block_size, device)
        self.spec, self.device, self.num_kv_heads = spec, device, heads.num_kv
        self.staging = HostToDeviceStaging(spec.staging_capacity, Device(str(device)))
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def serve(self, pipe) -> None:
        """Replay calls until rank 0 says stop or its end of the pipe closes."""
        while True:
            try:
                kind, call = pickle.loads(pipe.recv_bytes())
            except EOFError:
                return
            if kind == "stop":
                return
            self.replay(call)

    @torch.inference_mode()
    def replay(self, call: StepCall | DummyCall) -> None:
        """Run `call` on this rank's shard; a cache of another block count than the last replaces it (rank 0's
        GPU profiling runs on a temporary cache before the real one)."""
        if not self.kv_caches or self.kv_caches[0][0].shape[0] != call.num_blocks:
            self.kv_caches = []
            self.kv_caches = allocate_kv_cache(self.spec.hf_config.num_hidden_layers, call.num_blocks,
                                               self.spec.block_size, self.num_kv_heads, self.spec.head_dim,
                                               self.spec.dtype, self.device)
        if isinstance(call, DummyCall):
            input_ids, positions, meta = dummy_step(call.prefill_tokens, call.prefills, call.decodes,
                                                    self.spec.max_blocks_per_seq, self.plans, self.device)
            self.model(input_ids, positions, self.kv_caches, meta)
            return
        inputs = upload_step(call.step, self.staging)
        tables = block_tables(call.block_tables, self.spec.max_blocks_per_seq, self.device)
        self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attention_metadata(tables, self.plans),
                   input_embeds=inputs.input_embeds(self.model.embed_tokens))


def _rank_main(spec: RankSpec, rank: int, pipe) -> None:
    """A spawned rank's process: join the group, build the shard, say ready (or why not), replay calls."""
    device = torch.device(spec.devices[rank])
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(spec.threads)
        pipe.send_bytes(pickle.dumps(("joining", None)))
        _join_group(spec, rank)
        worker = _Rank(spec, Shard(rank, spec.size), device)
    except BaseException as exc:
        pipe.send_bytes(pickle.dumps(("failed", f"{type(exc).__name__}: {exc}")))
        raise
    pipe.send_bytes(pickle.dumps(("ready", None)))
    try:
        worker.serve(pipe)
    finally:
        dist.destroy_process_group()


class TensorParallelRanks:
    """Rank 0's side: starts ranks 1..N-1 and joins their process group (the constructor), waits until they are
    ready (`wait_ready`), sends them each call of its model (`send`) and stops them (`close`).

    Raises (constructor, `wait_ready`):
        RuntimeError: a rank failed to start or to build its shard (the message says which and why).
    """

    def __init__(self, spec: RankSpec):
        self.spec = spec
        self._pipes: list = []
        self._processes: list = []
        self._joined = False
        context = multiprocessing.get_context("spawn")
        try:
            for rank in range(1, spec.size):
                ours, theirs = context.Pipe()
                process = context.Process(target=_rank_main, args=(spec, rank, theirs), daemon=True,
                                          name=f"omni-tp-rank{rank}")
                process.start()
                theirs.close()
                self._pipes.append(ours)
                self._processes.append(process)
            # a rank that dies on its way (an import error) ends the wait at once, not at COLLECTIVE_TIMEOUT
            self._expect("joining")
            _join_group(spec, 0)
            self._joined = True
        except BaseException:
            self.close()
            raise
        logger.info("tensor parallel: %d ranks on %s, process group %s", spec.size, ", ".join(spec.devices),
                    dist.get_backend())

    def wait_ready(self) -> None:
        """Block until every rank has built its shard.

        Raises:
            RuntimeError: a rank reported a failure or exited (then every rank is stopped).
        """
        self._expect("ready")

    def _expect(self, message: str) -> None:
        """Receive `message` from every rank; RuntimeError (every rank stopped) for a failure or an exit."""
        for rank, (pipe, process) in enumerate(zip(self._pipes, self._processes), start=1):
            try:
                kind, detail = pickle.loads(pipe.recv_bytes())
            except EOFError:
                process.join(STOP_WAIT_S)
                kind, detail = "failed", f"exited with code {process.exitcode}"
            if kind != message:
                self.close()
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {detail}")

    def send(self, call: StepCall | DummyCall) -> None:
        """Send `call` to every other rank; rank 0 runs it next.

        Raises:
            RuntimeError: a rank has exited (the ranks before it got the call: the engine is out of step, and
                `close` ends them).
        """
        payload = pickle.dumps(("forward", call))
        for rank, (pipe, process) in enumerate(zip(self._pipes, self._processes), start=1):
            try:
                pipe.send_bytes(payload)
            except OSError:  # its end of the pipe closed when it exited
                process.join(STOP_WAIT_S)
                raise RuntimeError(f"tensor-parallel rank {rank} has exited (code {process.exitcode})") from None

    def terminate(self) -> None:
        """Kill the other ranks now, so that a collective rank 0's thread is in fails instead of running on;
        `close` follows once that thread has left it (destroying the group under a live collective is not safe).
        """
        for process in self._processes:
            process.terminate()
        for process in self._processes:
            process.join()

    def close(self) -> None:
        """Stop the ranks (terminating one that does not exit in STOP_WAIT_S) and leave the process group;
        calling it again does nothing."""
        for pipe in self._pipes:
            try:
                pipe.send_bytes(pickle.dumps(("stop", None)))
            except OSError:  # that rank is gone already
                pass
            pipe.close()
        for process in self._processes:
            process.join(STOP_WAIT_S)
            if process.is_alive():
                logger.warning("tensor-parallel rank %s did not stop in %.0f s; terminating it", process.name,
                               STOP_WAIT_S)
                process.terminate()
                process.join()
        self._pipes, self._processes = [], []
        if self._joined:
            dist.destroy_process_group()
            self._joined = False
