"""Power- and temperature-aware admission for an engine loop.

The engine loop calls `Governor.tick(now)` once per iteration. At most every `interval_s` it takes one NVML
reading of the engine's GPU and makes at most one adjustment:

- power above the threshold (default `power_fraction` of the enforced power limit): the sequences per step
  limit drops by one step (`step_fraction` of max_num_seqs, at least 1) down to `min_num_seqs`;
- power below threshold - hysteresis: it rises by one step back up to max_num_seqs; in between it holds;
- temperature at or above the critical one (default the GPU's own slowdown threshold, else 85 C): new
  requests are refused (`admitting` False) while admitted ones finish; admission resumes below
  critical - `temp_hysteresis_c`.

Without NVML (no library or driver: CPU machines) or when the GPU does not report power, it logs once
"governor disabled: <reason>", stays in state DISABLED (gauge 0) and never limits anything.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass

from omni_backend.ops.hardware import GpuInfo, GpuReading, Nvml, NvmlUnavailable
from omni_backend.settings import SettingGroup, setting

logger = logging.getLogger(__name__)

DEFAULT_CRITICAL_TEMP_C = 85.0


class GovernorState(enum.IntEnum):
    """Value of the governor-state gauge."""

    DISABLED = 0
    NORMAL = 1
    POWER_LIMITED = 2  # fewer sequences per step than max_num_seqs
    NOT_ADMITTING = 3  # critical temperature: new requests refused


@dataclass
class GovernorConfig(SettingGroup):
    """Thresholds, each a setting (omni_backend/settings.py) of the llm stage under the name `governor_<field>`;
    None: derived from the GPU (see the module docstring)."""

    power_threshold_w: float | None = setting(None, "lower sequences per step above this draw, W; empty: "
                                              "power_fraction x the enforced power limit", kind=float, low=0.0,
                                              low_open=True, optional=True)
    power_fraction: float = setting(0.9, "the power threshold as a fraction of the enforced power limit", low=0.0,
                                    low_open=True, high=1.0)
    hysteresis_w: float | None = setting(None, "restore sequences only below threshold - this, W; empty: 5 % of the "
                                         "power limit", kind=float, low=0.0, optional=True)
    critical_temp_c: float | None = setting(None, "refuse new requests at or above this GPU temperature, C; empty: "
                                            "the GPU's slowdown threshold, else 85", kind=float, optional=True)
    temp_hysteresis_c: float = setting(5.0, "admit again below the critical temperature - this, C", low=0.0)
    min_num_seqs: int = setting(1, "the fewest sequences per step the governor goes down to", low=1)
    step_fraction: float = setting(0.25, "one adjustment, as a fraction of max_num_seqs (at least one sequence)",
                                   low=0.0, low_open=True, high=1.0)
    interval_s: float = setting(0.5, "seconds between NVML readings (NVML averages power over about a second; one "
                                "adjustment per reading gives the GPU time to respond)", low=0.0)
    retry_after_s: int = setting(10, "seconds refused clients are told to wait (Retry-After)", low=0)

    PREFIX = "governor_"  # the settings' names: governor_<field>


class Governor:
    """Decides sequences per step and admission from NVML readings of one GPU.

    Args:
        max_num_seqs: the engine's largest batch (the limit the governor restores to).
        config: thresholds.
        nvml: an open `Nvml`, or None when NVML is unavailable (then `disabled_reason` says why).
        gpu_index: NVML index of the engine's GPU.
        disabled_reason: why there is no NVML (logged once).
    """

    def __init__(self, max_num_seqs: int, config: GovernorConfig | None = None, nvml: Nvml | None = None,
                 gpu_index: int = 0, disabled_reason: str = "NVML unavailable"):
        self.config = config or GovernorConfig()
        self.max_num_seqs = max_num_seqs
        self.num_seqs = max_num_seqs
        self.admitting = True
        self.reading: GpuReading | None = None
        self.gpu: GpuInfo | None = None
        self.nvml = nvml
        self.gpu_index = gpu_index
        self._next_sample = 0.0
        if nvml is not None:
            try:
                self.gpu = nvml.info(gpu_index)
                self.reading = nvml.read(gpu_index)  # fails here, not in the loop, when power is not reported
            except NvmlUnavailable as exc:
                self.gpu, disabled_reason = None, str(exc)
        if self.gpu is None:
            self.nvml = None
            logger.warning("governor disabled: %s", disabled_reason)
            return
        c, gpu = self.config, self.gpu
        self.power_threshold_w = c.power_threshold_w if c.power_threshold_w is not None else (
            c.power_fraction * gpu.power_limit_w)
        self.hysteresis_w = c.hysteresis_w if c.hysteresis_w is not None else 0.05 * gpu.power_limit_w
        self.critical_temp_c = c.critical_temp_c if c.critical_temp_c is not None else (
            gpu.slowdown_temp_c or DEFAULT_CRITICAL_TEMP_C)
        self.step = max(1, math.ceil(c.step_fraction * max_num_seqs))
        logger.warning("governor on %s (GPU %d): power threshold %.0f W (restore below %.0f W), critical "
                       "temperature %.0f C, %d..%d sequences per step", gpu.name, gpu_index, self.power_threshold_w,
                       self.power_threshold_w - self.hysteresis_w, self.critical_temp_c, c.min_num_seqs,
                       max_num_seqs)

    @classmethod
    def for_device(cls, device, max_num_seqs: int, config: GovernorConfig | None = None,
                   nvml_module=None) -> "Governor":
        """A governor for the GPU an engine on `device` uses (NVML from `hardware.open_nvml`)."""
        from omni_backend.ops.hardware import nvml_index, open_nvml
        try:
            nvml = open_nvml(nvml_module)
            return cls(max_num_seqs, config, nvml, nvml_index(device, nvml))
        except NvmlUnavailable as exc:
            return cls(max_num_seqs, config, None, disabled_reason=str(exc))

    @property
    def enabled(self) -> bool:
        return self.nvml is not None

    @property
    def state(self) -> GovernorState:
        if not self.enabled:
            return GovernorState.DISABLED
        if not self.admitting:
            return GovernorState.NOT_ADMITTING
        return GovernorState.POWER_LIMITED if self.num_seqs < self.max_num_seqs else GovernorState.NORMAL

    def tick(self, now: float) -> int:
        """Sample if `interval_s` has passed since the last reading; returns the sequences-per-step limit."""
        if self.nvml is None or now < self._next_sample:
            return self.num_seqs
        self._next_sample = now + self.config.interval_s
        try:
            reading = self.nvml.read(self.gpu_index)
        except NvmlUnavailable as exc:  # lost the GPU's readings: stop governing rather than act on stale data
            logger.warning("governor disabled: %s", exc)
            self.nvml, self.num_seqs, self.admitting = None, self.max_num_seqs, True
            return self.num_seqs
        self.update(reading)
        return self.num_seqs

    def update(self, reading: GpuReading) -> None:
        """Apply one reading (at most one step of sequences per step, and the admission rule)."""
        before = self.state
        self.reading = reading
        if reading.power_w > self.power_threshold_w:
            self.num_seqs = max(self.config.min_num_seqs, self.num_seqs - self.step)
        elif reading.power_w < self.power_threshold_w - self.hysteresis_w:
            self.num_seqs = min(self.max_num_seqs, self.num_seqs + self.step)
        if reading.temperature_c >= self.critical_temp_c:
            self.admitting = False
        elif reading.temperature_c < self.critical_temp_c - self.config.temp_hysteresis_c:
            self.admitting = True
        if self.state is not before:
            logger.warning("governor: %s -> %s (%.0f W, %.0f C, %d sequences per step)", before.name,
                           self.state.name, reading.power_w, reading.temperature_c, self.num_seqs)

    def refusal(self) -> str | None:
        """Why a new request is refused now (the GPU is at its critical temperature), None while admitting; the
        llm stage asks for each new request and answers NOT_ADMITTING with Retry-After `config.retry_after_s`."""
        if self.admitting:
            return None
        temperature = self.reading.temperature_c if self.reading else float("nan")
        return (f"not admitting new requests: GPU temperature {temperature:.0f} C is at or above the critical "
                f"{self.critical_temp_c:.0f} C; retry after {self.config.retry_after_s} s")
