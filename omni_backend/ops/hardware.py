"""Device capabilities that decide dtypes and kernels, and the GPU inventory and readings (NVML).

Rules (by capability, never by model or device name): bf16 needs compute capability >= 8.0 (Ampere; NVIDIA
CUDA C Programming Guide, "Arithmetic Instructions"), fp16 below (the attention backend's rules, from the same
capability, are in omni_backend/engine/attention/selector.py). On CPU the default
is bfloat16 where the CPU has native bf16 matrix math (AMX-BF16 or AVX512-BF16 in /proc/cpuinfo; measured
here: a 1024-token SmolLM2 prefill step about 5x faster than float32), float32 elsewhere. Greedy-equality
tests pin float32.

GPU inventory and readings come from NVML through nvidia-ml-py (`pynvml`). `Nvml` takes any module with
pynvml's functions, so tests pass `omni_backend.ops.fake_nvml.FakeNvml`; `open_nvml()` picks the real one,
or the fake when `OMNI_NVML_FAKE` names a JSON file of readings (a test and demo hook, see fake_nvml.py).

Device resolution (`resolve_device`) never falls back silently: "auto" on a machine whose GPUs NVML sees but torch
cannot use logs a WARNING with torch's and the driver's CUDA versions and the fix (the torch flavour to install,
`omni_backend.ops.torch_flavor`), and an explicit "cuda" raises. `runtime_versions` names what runs (torch, its
CUDA, the driver's CUDA, triton and the triton torch declares) for metrics and messages.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import torch

from omni_backend.ops import torch_flavor

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_has_native_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """True when the CPU advertises AMX-BF16 or AVX512-BF16 (Linux /proc/cpuinfo flags)."""
    try:
        with open(cpuinfo_path, encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return any(flag in line.split() for flag in CPU_BF16_FLAGS)
    except OSError:
        return False
    return False


def usable_cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask, as a container's cpuset sets it)."""
    return len(os.sched_getaffinity(0))


def cpu_engine_threads(requested: int, cores: int | None = None) -> int:
    """Torch intra-op threads for a CPU engine step.

    Args:
        requested: threads wanted; 0: automatic.
        cores: usable cores (default: `usable_cpu_cores()`).

    Automatic is one core fewer than usable (at least 1): the engine's OpenMP team waits at a barrier after every
    op for its slowest thread, so when tritonserver, the front door, the response thread or a benchmark client
    takes one of its cores, every op waits for a time slice; measured in docs/benchmarks.md ("CPU threads").
    vLLM's CPU build also leaves a core for its API server.

    Raises:
        ValueError: `requested` < 0.
    """
    if requested < 0:
        raise ValueError(f"cpu_threads must be >= 0, got {requested}")
    if requested:
        return requested
    return max(1, (cores if cores is not None else usable_cpu_cores()) - 1)


def compute_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


_QUERY = object()  # "ask torch for the device's capability"


def select_dtype(requested: str, device: torch.device, capability=_QUERY) -> torch.dtype:
    """Resolve "auto" or a dtype name to a torch dtype valid on `device`.

    `capability` ((major, minor), or None for CPU) overrides the query to torch (tests, NVML inventory).

    Raises:
        ValueError: unknown name, or bfloat16 requested on a GPU below sm80.
    """
    if capability is _QUERY:
        capability = compute_capability(device)
    if requested == "auto":
        if capability is None:
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        return torch.bfloat16 if capability >= (8, 0) else torch.float16
    if requested not in DTYPES:
        raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {requested!r}")
    if requested == "bfloat16" and capability is not None and capability < (8, 0):
        raise ValueError(f"bfloat16 needs compute capability >= 8.0, device has {capability}")
    return DTYPES[requested]


# --- NVML: inventory and readings ----------------------------------------------------------------------------


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here (no library or driver, no such GPU, or a reading the GPU does not support)."""


@dataclass(frozen=True)
class GpuInfo:
    """What a GPU is (read once).

    Attributes:
        index: NVML device index.
        compute_capability: (major, minor).
        memory_bytes: total device memory.
        power_limit_w: enforced power limit (W).
        slowdown_temp_c: temperature at which the GPU starts slowing itself down (C), None if not reported.
    """

    index: int
    name: str
    uuid: str
    compute_capability: tuple[int, int]
    memory_bytes: int
    power_limit_w: float
    slowdown_temp_c: float | None


@dataclass(frozen=True)
class GpuReading:
    """One sample: power draw (W), GPU temperature (C), SM clock (MHz)."""

    power_w: float
    temperature_c: float
    sm_clock_mhz: float


class Nvml:
    """GPU inventory and readings through a pynvml-compatible module.

    Args:
        module: pynvml (default) or a stand-in with the same functions (`fake_nvml.FakeNvml`).

    Raises (constructor):
        NvmlUnavailable: nvmlInit failed (no NVML library or driver: CPU machines).
    """

    def __init__(self, module=None):
        if module is None:
            import pynvml as module
        self.nvml = module
        try:
            module.nvmlInit()
        except module.NVMLError as exc:
            raise NvmlUnavailable(f"NVML unavailable ({exc})") from None
        self._handles: dict[int, object] = {}

    def _call(self, name: str, *args):
        try:
            return getattr(self.nvml, name)(*args)
        except self.nvml.NVMLError as exc:
            raise NvmlUnavailable(f"{name} failed ({exc})") from None

    def device_count(self) -> int:
        return self._call("nvmlDeviceGetCount")

    def _handle(self, index: int):
        if index not in self._handles:
            self._handles[index] = self._call("nvmlDeviceGetHandleByIndex", index)
        return self._handles[index]

    def index_of_uuid(self, uuid: str) -> int:
        """NVML index of the GPU with this UUID ("GPU-..."); raises NvmlUnavailable when none has it."""
        for index in range(self.device_count()):
            if self._call("nvmlDeviceGetUUID", self._handle(index)) == uuid:
                return index
        raise NvmlUnavailable(f"no GPU with UUID {uuid}")

    def info(self, index: int) -> GpuInfo:
        """Name, capability, memory and limits of GPU `index`."""
        nvml, handle = self.nvml, self._handle(index)
        name = self._call("nvmlDeviceGetName", handle)
        try:
            slowdown = float(nvml.nvmlDeviceGetTemperatureThreshold(handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))
        except nvml.NVMLError:  # not reported by every board
            slowdown = None
        return GpuInfo(
            index=index,
            name=name.decode() if isinstance(name, bytes) else name,
            uuid=self._call("nvmlDeviceGetUUID", handle),
            compute_capability=tuple(self._call("nvmlDeviceGetCudaComputeCapability", handle)),
            memory_bytes=int(self._call("nvmlDeviceGetMemoryInfo", handle).total),
            power_limit_w=self._call("nvmlDeviceGetEnforcedPowerLimit", handle) / 1000.0,
            slowdown_temp_c=slowdown,
        )

    def inventory(self) -> list[GpuInfo]:
        return [self.info(i) for i in range(self.device_count())]

    def read(self, index: int) -> GpuReading:
        """Power (NVML reports mW), temperature and SM clock of GPU `index`. Raises NvmlUnavailable."""
        nvml, handle = self.nvml, self._handle(index)
        return GpuReading(
            power_w=self._call("nvmlDeviceGetPowerUsage", handle) / 1000.0,
            temperature_c=float(self._call("nvmlDeviceGetTemperature", handle, nvml.NVML_TEMPERATURE_GPU)),
            sm_clock_mhz=float(self._call("nvmlDeviceGetClockInfo", handle, nvml.NVML_CLOCK_SM)),
        )

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def open_nvml(module=None) -> Nvml:
    """`Nvml` over `module`, else over the fake named by `OMNI_NVML_FAKE` (a JSON file), else over pynvml.

    Raises:
        NvmlUnavailable: NVML cannot be initialised.
    """
    if module is None and os.environ.get("OMNI_NVML_FAKE"):
        from omni_backend.ops.fake_nvml import FakeNvml
        module = FakeNvml.from_file(os.environ["OMNI_NVML_FAKE"])
    return Nvml(module)


def nvml_index(device: torch.device | str, nvml: Nvml) -> int:
    """NVML index of the GPU the engine runs on (matched by UUID when torch can tell; CUDA_VISIBLE_DEVICES
    renumbers CUDA devices but not NVML ones). A CPU engine maps to GPU 0."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    if torch.cuda.is_available():
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        if uuid is not None:
            try:
                return nvml.index_of_uuid(f"GPU-{uuid}")
            except NvmlUnavailable:
                pass
    return device.index or 0


# --- device resolution and runtime versions --------------------------------------------------------------------


@dataclass(frozen=True)
class CudaFacts:
    """What decides whether the engine can run on CUDA (probed by `cuda_facts`, injected by tests).

    Attributes:
        torch_version: torch.__version__.
        torch_cuda: torch.version.cuda ("13.0"), "" for a CPU build.
        cuda_usable: torch.cuda.is_available().
        device_count: torch.cuda.device_count() (0 when CUDA is not usable).
        driver: GPUs NVML sees and the newest CUDA the driver supports; None when NVML is unavailable.
    """

    torch_version: str
    torch_cuda: str
    cuda_usable: bool
    device_count: int
    driver: torch_flavor.Driver | None

    @property
    def nvml_gpus(self) -> int:
        return self.driver.gpus if self.driver else 0

    @property
    def driver_cuda(self) -> str:
        """The driver's CUDA as text ("12.8"), "" when NVML is unavailable."""
        return torch_flavor.version_text(self.driver.cuda) if self.driver else ""


def cuda_facts(nvml_module=None) -> CudaFacts:
    """Probe torch and NVML (the fake named by `OMNI_NVML_FAKE` when set, as `open_nvml` does, else pynvml)."""
    if nvml_module is None and os.environ.get("OMNI_NVML_FAKE"):
        from omni_backend.ops.fake_nvml import FakeNvml
        nvml_module = FakeNvml.from_file(os.environ["OMNI_NVML_FAKE"])
    usable = torch.cuda.is_available()
    return CudaFacts(torch_version=torch.__version__, torch_cuda=torch.version.cuda or "", cuda_usable=usable,
                     device_count=torch.cuda.device_count() if usable else 0,
                     driver=torch_flavor.nvidia_driver(nvml_module))


def _cuda_unusable(facts: CudaFacts) -> str:
    """Why torch cannot use CUDA, with the versions involved and the fix."""
    torch_cuda = facts.torch_cuda or "none (a CPU build)"
    text = (f"torch {facts.torch_version} cannot use CUDA (torch's CUDA: {torch_cuda}; NVML sees "
            f"{facts.nvml_gpus} GPU(s), the NVIDIA driver supports CUDA {facts.driver_cuda or 'unknown'})")
    if facts.nvml_gpus == 0:
        return text
    built = tuple(int(part) for part in facts.torch_cuda.split(".")[:2]) if facts.torch_cuda else None
    if built is None or built > facts.driver.cuda:
        return f"{text}: {torch_flavor.advice(facts.driver)}"
    return (f"{text}: torch's CUDA fits the driver, so check that this process may open the GPU "
            "(CUDA_VISIBLE_DEVICES, the container's --gpus, /dev/nvidia* permissions)")


_DEVICE = re.compile(r"auto|cpu|cuda(?::(\d+))?")


def resolve_device(requested: str, facts: CudaFacts | None = None) -> str:
    """Resolve the llm stage's device setting to "cpu", "cuda" or "cuda:N".

    Args:
        requested: "auto", "cpu", "cuda" or "cuda:N" (N a device index).
        facts: torch/NVML facts (default: `cuda_facts()`; tests inject them).

    "auto" is "cuda" when torch can use CUDA, else "cpu"; when NVML sees a GPU that torch cannot use, it logs a
    WARNING naming torch's version and CUDA, the driver's CUDA and the fix (`OMNI_TORCH_CUDA=<flavour>` and rerun
    scripts/setup.sh), and runs on CPU.

    Raises:
        ValueError: `requested` is not one of the forms above, or cuda:N is beyond torch's device count.
        RuntimeError: "cuda"/"cuda:N" requested and torch cannot use CUDA (the message has the same facts as the
            warning): an explicit GPU request never falls back to CPU.
    """
    match = _DEVICE.fullmatch(requested) if isinstance(requested, str) else None
    if match is None:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {requested!r}")
    if requested == "cpu":
        return "cpu"
    facts = facts or cuda_facts()
    if requested == "auto":
        if facts.cuda_usable:
            return "cuda"
        if facts.nvml_gpus > 0:
            log.warning("device auto runs on CPU: %s", _cuda_unusable(facts))
        return "cpu"
    if not facts.cuda_usable:
        raise RuntimeError(f"device {requested} requested, but {_cuda_unusable(facts)}")
    index = match.group(1)
    if index is not None and int(index) >= facts.device_count:
        raise ValueError(f"device {requested}: torch sees {facts.device_count} CUDA device(s)")
    return requested


def runtime_versions(facts: CudaFacts | None = None) -> dict[str, str]:
    """Versions of what runs, as strings ("" for none), for the runtime-info metric and warning messages.

    Keys: torch, cuda_runtime (torch.version.cuda), cuda_driver (NVML), triton (installed), triton_declared_by_torch
    ("" for the CPU wheel, which declares none). `facts` as in `resolve_device`.
    """
    facts = facts or cuda_facts()
    return {
        "torch": facts.torch_version,
        "cuda_runtime": facts.torch_cuda,
        "cuda_driver": facts.driver_cuda,
        "triton": torch_flavor.installed_version("triton"),
        "triton_declared_by_torch": torch_flavor.triton_declared_by_torch(),
    }
