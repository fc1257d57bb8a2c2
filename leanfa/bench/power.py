"""SM clock and board power sampled through NVML in a background thread.

Wrap a timed loop in ``with NvmlSampler(device) as s: ...`` and read ``s.summary()``: the
median SM clock (MHz) and median board power (W) over the samples taken while the loop
ran, plus the clock-event (throttle) reasons seen. Power is the driver's instantaneous
reading (``NVML_FI_DEV_POWER_INSTANT``) where the driver has it, else
``nvmlDeviceGetPowerUsage`` (a short moving average on recent drivers). A sampler that
cannot start NVML (no ``pynvml``, no driver) records nothing and never fails the run.
"""

from __future__ import annotations

import statistics
import threading
import time

# nvmlClocksEventReason* bits worth naming in a report
_REASONS = {
    0x1: "gpu_idle",
    0x2: "app_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
}

_nvml_ready: bool | None = None


def _nvml():
    """The pynvml module, initialized once; None if NVML is unavailable."""
    global _nvml_ready
    try:
        import pynvml
    except ImportError:
        return None
    if _nvml_ready is None:
        try:
            pynvml.nvmlInit()
            _nvml_ready = True
        except Exception:
            _nvml_ready = False
    return pynvml if _nvml_ready else None


def nvml_handle(device_index: int = 0):
    """The NVML handle of torch's CUDA device ``device_index`` (matched by UUID, so
    ``CUDA_VISIBLE_DEVICES`` reordering is handled); None if NVML is unavailable."""
    nv = _nvml()
    if nv is None:
        return None
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        return nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else "GPU-" + uuid)
    except Exception:
        pass
    try:
        import torch

        return nv.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device_index))
    except Exception:
        pass
    try:
        return nv.nvmlDeviceGetHandleByIndex(device_index)
    except Exception:
        return None


def sm_clock_mhz(device_index: int = 0) -> int | None:
    """The SM clock of torch's CUDA device ``device_index`` now, in MHz; None if NVML is unavailable."""
    nv, h = _nvml(), nvml_handle(device_index)
    if nv is None or h is None:
        return None
    try:
        return nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
    except Exception:
        return None


def device_info(device_index: int = 0) -> dict:
    """Driver version, power limit and max SM clock, as far as NVML tells."""
    nv, h = _nvml(), nvml_handle(device_index)
    info: dict = {}
    if nv is None or h is None:
        return info
    for key, fn in (
        ("driver", lambda: nv.nvmlSystemGetDriverVersion()),
        ("power_limit_w", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0),
        ("max_sm_clock_mhz", lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)),
        ("nvml_name", lambda: nv.nvmlDeviceGetName(h)),
    ):
        try:
            val = fn()
            info[key] = val.decode() if isinstance(val, bytes) else val
        except Exception:
            pass
    return info


def _field_value(nv, v) -> float:
    """The number in an nvmlFieldValue_t, whatever its value type."""
    member = {
        getattr(nv, "NVML_VALUE_TYPE_DOUBLE", 0): "dVal",
        getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_INT", 1): "uiVal",
        getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_LONG", 2): "ulVal",
        getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", 3): "ullVal",
        getattr(nv, "NVML_VALUE_TYPE_SIGNED_LONG_LONG", 4): "sllVal",
        getattr(nv, "NVML_VALUE_TYPE_SIGNED_INT", 5): "siVal",
    }.get(int(v.valueType), "uiVal")
    return float(getattr(v.value, member))


class NvmlSampler:
    """Samples SM clock (MHz), power (W) and throttle reasons every ``period_s``."""

    def __init__(self, device_index: int = 0, period_s: float = 0.005):
        self.period_s = period_s
        self._nv = _nvml()
        self._h = nvml_handle(device_index) if self._nv is not None else None
        self.clocks: list[float] = []
        self.powers: list[float] = []
        self.reasons = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._instant = self._probe_instant_power()

    @property
    def available(self) -> bool:
        return self._h is not None

    def _probe_instant_power(self) -> bool:
        nv, h = self._nv, self._h
        if h is None or not hasattr(nv, "NVML_FI_DEV_POWER_INSTANT"):
            return False
        try:
            v = nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_POWER_INSTANT])[0]
            return v.nvmlReturn == 0
        except Exception:
            return False

    def _power_w(self) -> float:
        nv, h = self._nv, self._h
        if self._instant:
            v = nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_POWER_INSTANT])[0]
            if v.nvmlReturn == 0:
                return _field_value(nv, v) / 1000.0  # mW
        return nv.nvmlDeviceGetPowerUsage(h) / 1000.0

    def _sample_once(self) -> None:
        nv, h = self._nv, self._h
        try:
            self.clocks.append(float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)))
            self.powers.append(self._power_w())
        except Exception:
            return
        try:
            fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                nv.nvmlDeviceGetCurrentClocksThrottleReasons
            self.reasons |= int(fn(h))
        except Exception:
            pass

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample_once()
            time.sleep(self.period_s)

    def start(self) -> "NvmlSampler":
        if self.available:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._sample_once()  # at least one sample, even for a very short loop

    def __enter__(self) -> "NvmlSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def summary(self) -> dict:
        """Median SM clock and power over the samples (None where nothing was sampled)."""
        out = summarize(self.clocks, self.powers, self.reasons)
        out["power_source"] = "nvml-instant" if self._instant else "nvml-average"
        return out


def summarize(clocks, powers, reasons: int = 0) -> dict:
    return {
        "sm_clock_mhz": statistics.median(clocks) if clocks else None,
        "sm_clock_min_mhz": min(clocks) if clocks else None,
        "power_w": statistics.median(powers) if powers else None,
        "power_max_w": max(powers) if powers else None,
        "nvml_samples": len(clocks),
        "clock_reasons": [name for bit, name in _REASONS.items() if reasons & bit],
    }
