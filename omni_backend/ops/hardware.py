"""Device capabilities that decide dtypes and kernels, and the GPU inventory and readings (NVML).

Rules (by capability, never by model or device name): bf16 needs compute capability >= 8.0 (Ampere; NVIDIA
CUDA C Programming Guide, "Arithmetic Instructions"), fp16 below; OpenAI-Triton kernels need a CUDA device of
capability >= 7.0 (Triton's documented minimum) or the interpreter (TRITON_INTERPRET=1). On CPU the default
is bfloat16 where the CPU has native bf16 matrix math (AMX-BF16 or AVX512-BF16 in /proc/cpuinfo; measured
here: a 1024-token SmolLM2 prefill step about 5x faster than float32), float32 elsewhere. Greedy-equality
tests pin float32.

GPU inventory and readings come from NVML through nvidia-ml-py (`pynvml`). `Nvml` takes any module with
pynvml's functions, so tests pass `omni_backend.ops.fake_nvml.FakeNvml`; `open_nvml()` picks the real one,
or the fake when `OMNI_NVML_FAKE` names a JSON file of readings (a test and demo hook, see fake_nvml.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

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


def select_attention_backend(requested: str, device: torch.device, capability=_QUERY) -> tuple[str, str]:
    """Resolve "auto"/"cpu"/"torch"/"triton" to a backend name and the reason for the choice.

    "cpu" (the CPU default) is a C++ decode kernel built on first use (kernels/paged_decode_cpu.py); whether it
    builds is only known then, so the model runner falls back to "torch" when an automatic "cpu" cannot be built.
    `capability` as in `select_dtype`.

    Raises:
        ValueError: "triton" requested where the kernels cannot run, or "cpu" requested for a CUDA device.
    """
    if capability is _QUERY:
        capability = compute_capability(device)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    triton_ok = (capability is not None and capability >= (7, 0)) or (capability is None and interpreted)
    if requested == "triton":
        if not triton_ok:
            raise ValueError("attention_backend=triton needs a CUDA device with capability >= 7.0 "
                             "or TRITON_INTERPRET=1 on CPU")
        return "triton", "requested"
    if requested == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend=cpu runs on CPU tensors, the engine's device is {device}")
        return "cpu", "requested"
    if requested == "torch":
        return "torch", "requested"
    if capability is not None and triton_ok:
        return "triton", f"auto: CUDA capability {capability[0]}.{capability[1]}"
    if capability is not None:
        return "torch", f"auto: CUDA capability {capability[0]}.{capability[1]} below 7.0"
    return "cpu", "auto: CPU device (C++ paged decode kernel; Triton kernels only under TRITON_INTERPRET=1)"


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


def runtime_versions() -> dict[str, str]:  # TEMPORARY until the gpu-install branch lands
    import triton
    return {"torch": torch.__version__, "cuda_runtime": torch.version.cuda or "", "cuda_driver": "",
            "triton": triton.__version__}


def resolve_device(requested: str) -> str:  # TEMPORARY until the gpu-install branch lands
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested
