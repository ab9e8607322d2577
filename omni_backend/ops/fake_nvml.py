"""A stand-in for the `pynvml` module: one or more simulated GPUs whose readings tests set.

Implements only the pynvml functions `hardware.Nvml` calls, with pynvml's units (power in mW) and error type.
Values are plain attributes of `FakeGpu`; `FakeNvml.from_file(path)` instead re-reads a JSON file at every
reading, so a test can change what a running tritonserver's llm stage sees (`OMNI_NVML_FAKE=<path>`):

    {"power_w": 120, "temperature_c": 55, "power_limit_w": 300, "slowdown_temp_c": 90}

Keys are `FakeGpu` fields; missing keys keep their defaults. `FakeNvml(missing=True)` behaves like a machine
without the NVML library (nvmlInit raises NVMLError_LibraryNotFound, as pynvml does on this CPU machine).
`cuda_driver_version` is the driver's CUDA as NVML encodes it (1000 * major + 10 * minor: 12080 is CUDA 12.8).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace

NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_CLOCK_SM = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_LIBRARY_NOT_FOUND = 12


class NVMLError(Exception):
    """Same shape as pynvml.NVMLError: `value` is the NVML return code."""

    _MESSAGES = {NVML_ERROR_NOT_SUPPORTED: "Not Supported",
                 NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found"}

    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self._MESSAGES.get(self.value, f"NVML error {self.value}")


@dataclass
class FakeGpu:
    """One simulated GPU (defaults: an H100-like board at idle)."""

    name: str = "Fake GPU"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    compute_capability: tuple[int, int] = (9, 0)
    memory_bytes: int = 80 * 2**30
    power_limit_w: float = 700.0
    slowdown_temp_c: float | None = 90.0
    power_w: float = 100.0
    temperature_c: float = 40.0
    sm_clock_mhz: float = 1980.0


class FakeNvml:
    """pynvml-compatible module over `gpus` (default one FakeGpu) and a driver supporting CUDA 13.0 (13000)."""

    NVMLError = NVMLError
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    NVML_CLOCK_SM = NVML_CLOCK_SM

    def __init__(self, gpus: list[FakeGpu] | None = None, missing: bool = False, path: Path | str | None = None,
                 cuda_driver_version: int = 13000):
        self.gpus = gpus if gpus is not None else [FakeGpu()]
        self.cuda_driver_version = cuda_driver_version
        self.missing = missing
        self.path = Path(path) if path is not None else None
        self.initialized = False
        self.reads = 0  # power readings taken (tests check sampling)

    @classmethod
    def from_file(cls, path: Path | str) -> "FakeNvml":
        fake = cls(path=path)
        fake._reload()
        return fake

    def _reload(self) -> None:
        if self.path is None:
            return
        values = json.loads(self.path.read_text())
        known = {f.name for f in fields(FakeGpu)}
        for key, value in values.items():
            if key in known:
                setattr(self.gpus[0], key, tuple(value) if key == "compute_capability" else value)

    def _gpu(self, handle) -> FakeGpu:
        if not self.initialized:
            raise NVMLError(9)  # NVML_ERROR_UNINITIALIZED
        return self.gpus[handle]

    def nvmlInit(self) -> None:
        if self.missing:
            raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        if not self.initialized:
            raise NVMLError(9)  # NVML_ERROR_UNINITIALIZED
        return self.cuda_driver_version

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.gpus):
            raise NVMLError(2)  # NVML_ERROR_INVALID_ARGUMENT
        return index

    def nvmlDeviceGetName(self, handle) -> str:
        return self._gpu(handle).name

    def nvmlDeviceGetUUID(self, handle) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetCudaComputeCapability(self, handle) -> tuple[int, int]:
        return tuple(self._gpu(handle).compute_capability)

    def nvmlDeviceGetMemoryInfo(self, handle):
        total = self._gpu(handle).memory_bytes
        return SimpleNamespace(total=total, free=total, used=0)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle) -> int:
        return int(self._gpu(handle).power_limit_w * 1000)

    def nvmlDeviceGetTemperatureThreshold(self, handle, threshold) -> int:
        value = self._gpu(handle).slowdown_temp_c
        if threshold != NVML_TEMPERATURE_THRESHOLD_SLOWDOWN or value is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return int(value)

    def nvmlDeviceGetPowerUsage(self, handle) -> int:
        self._reload()
        self.reads += 1
        return int(self._gpu(handle).power_w * 1000)

    def nvmlDeviceGetTemperature(self, handle, sensor) -> int:
        return int(self._gpu(handle).temperature_c)

    def nvmlDeviceGetClockInfo(self, handle, clock_type) -> int:
        return int(self._gpu(handle).sm_clock_mhz)
