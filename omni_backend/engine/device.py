"""The engine's device: which one, binding it to every thread that launches work, and its memory.

CUDA keeps a *current device* per host thread, and OpenAI-Triton launches its kernels on the current device's
current stream (not on the device of the tensors it is given), so a `cuda:1` engine whose threads leave the
current device at 0 would launch kernels with device-1 pointers into device 0's context. The engine therefore
binds its device (`torch.cuda.set_device`) on every thread that builds, captures or steps it: the thread that
builds the engine, and the engine loop (omni_backend/stages/llm/core.py). On CPU binding does nothing.

Host-to-device copies of per-step inputs go through `HostToDeviceStaging`: one page-locked host buffer and one
asynchronous copy, instead of `torch.tensor(list).to(device)` per input, each of which stages through pageable
memory and makes the host wait for the copy.
"""

from __future__ import annotations

import torch


class Device:
    """One engine device.

    Args:
        name: "cpu", "cuda" or "cuda:N" ("cuda" means the current device, made explicit here so that every
            thread binds the same one).

    Raises:
        ValueError: not a CPU or CUDA device name.
    """

    def __init__(self, name: str):
        device = torch.device(name)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"the engine runs on cpu or cuda[:N], got {name!r}")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.torch_device = device

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    def bind_thread(self) -> None:
        """Make this device current on the calling thread. CUDA: the current device. CPU: torch's thread count
        (`torch.set_num_threads` sets the calling thread's OpenMP team, which the C++ kernels' parallel regions
        use; a thread that has run no torch parallel op would otherwise have OpenMP's default, every core)."""
        if self.is_cuda:
            torch.cuda.set_device(self.torch_device)
        else:
            torch.set_num_threads(torch.get_num_threads())

    def memory_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes (`cudaMemGetInfo`, all processes counted). CUDA only."""
        return torch.cuda.mem_get_info(self.torch_device)

    def release_cached_memory(self) -> None:
        """Return the caching allocator's unused blocks to the device (after an out-of-memory error)."""
        if self.is_cuda:
            torch.cuda.empty_cache()

    def __repr__(self) -> str:
        return f"Device({str(self.torch_device)!r})"


class HostToDeviceStaging:
    """One int64 host buffer (pinned on CUDA) and its device twin; `upload` sends several arrays in one copy.

    Args:
        capacity: int64 elements the buffer holds.
        device: where the arrays go. On CPU the host buffer itself is handed out (no copy).
    """

    def __init__(self, capacity: int, device: Device):
        self.capacity = capacity
        self.device = device
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=device.is_cuda)
        self._host_np = self.host.numpy()
        self._device_buffer = (torch.empty(capacity, dtype=torch.int64, device=device.torch_device)
                               if device.is_cuda else self.host)
        self._copied = torch.cuda.Event() if device.is_cuda else None

    def upload(self, arrays: list[list[int]]) -> list[torch.Tensor]:
        """Pack `arrays` into the buffer, copy them to the device; returns one int64 device view per array.

        The views stay valid until the next `upload`.

        Raises:
            ValueError: the arrays hold more than `capacity` elements.
        """
        total = sum(len(a) for a in arrays)
        if total > self.capacity:
            raise ValueError(f"step inputs of {total} integers exceed the staging buffer of {self.capacity}")
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy out of the host buffer is done
        offset = 0
        for array in arrays:
            self._host_np[offset:offset + len(array)] = array
            offset += len(array)
        if self._copied is not None:
            self._device_buffer[:total].copy_(self.host[:total], non_blocking=True)
            self._copied.record()
        views, offset = [], 0
        for array in arrays:
            views.append(self._device_buffer[offset:offset + len(array)])
            offset += len(array)
        return views
