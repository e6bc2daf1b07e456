"""What the GPU's clocks and power did while something was timed, read from NVML through ctypes
(the driver's libnvidia-ml, present wherever a CUDA driver is; no Python binding needed).

An H200 under a sustained MoE layer sits at its software power cap (NOTES, 2026-12-03, call 7:
throttle reason 0x4, 615-695 W, SM clock 930-1455 MHz), while short bursts run at up to 1980 MHz.
A time means little without the clock it ran at, so timings carry these readings: the SM clock
and power sampled during the timed replays, the throttle reasons seen, and the energy per replay
from the board's energy counter (millijoules, so only windows of tens of milliseconds or more
resolve it).
"""
from __future__ import annotations

import ctypes
import statistics
import threading
import time

NVML_CLOCK_SM = 1
SAMPLE_S = 0.02  # the sampler's period; NVML's power reading itself averages over a longer window
# clock-event (throttle) reason bits, nvml.h
REASONS = {0x1: "gpu_idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal",
           0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}


def reason_names(bits: int) -> list[str]:
    """The NVML clock-event reasons set in `bits`, by name (unknown bits as hex)."""
    names = [n for b, n in REASONS.items() if bits & b]
    rest = bits & ~sum(REASONS)
    return names + ([hex(rest)] if rest else [])


def gpu_uuid(device) -> str | None:
    """A torch CUDA device's UUID as nvidia-smi -L and NVML spell it ("GPU-..."), None where torch
    does not say."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return None if uuid is None else f"GPU-{uuid}".replace("GPU-GPU-", "GPU-")


class Nvml:
    """One GPU's NVML handle. `open` returns None where NVML cannot be loaded or the GPU not found
    (a CPU machine, a container without the driver library): readings are then left out, never
    invented."""

    def __init__(self, lib, handle):
        self._lib, self._h = lib, handle

    @classmethod
    def open(cls, uuid: str | None = None, index: int | None = None) -> "Nvml | None":
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                return None
            h = ctypes.c_void_p()
            rc = (lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(h)) if uuid else
                  lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index or 0), ctypes.byref(h)))
            return cls(lib, h) if rc == 0 else None
        except (OSError, AttributeError):
            return None

    @classmethod
    def of_torch_device(cls, device) -> "Nvml | None":
        """The NVML handle of a torch CUDA device, found by its UUID (indices differ where
        CUDA_VISIBLE_DEVICES reorders or hides GPUs)."""
        return cls.open(uuid=gpu_uuid(device))

    def _uint(self, fn, *args, wide=False):
        v = ctypes.c_ulonglong() if wide else ctypes.c_uint()
        return v.value if getattr(self._lib, fn)(self._h, *args, ctypes.byref(v)) == 0 else None

    def energy_mj(self) -> int | None:
        return self._uint("nvmlDeviceGetTotalEnergyConsumption", wide=True)

    def sm_mhz(self) -> int | None:
        return self._uint("nvmlDeviceGetClockInfo", ctypes.c_int(NVML_CLOCK_SM))

    def power_w(self) -> float | None:
        mw = self._uint("nvmlDeviceGetPowerUsage")
        return None if mw is None else mw / 1e3

    def reasons(self) -> int | None:
        for fn in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            if hasattr(self._lib, fn):  # the older name is deprecated in newer drivers
                return self._uint(fn, wide=True)
        return None

class Sampler:
    """Samples a reader's SM clock, power and throttle reasons every `period` seconds on a thread,
    and its energy counter at start and stop, while the caller's block runs:

        with Sampler(nvml) as s:
            ... timed work ...
        s.summary(replays)  # {"window_s", "sm_mhz", "power_w", "reasons", "counter_w", "replays", "mj_per_replay"}
    """

    def __init__(self, reader, period: float = SAMPLE_S):
        self.reader, self.period = reader, period
        self.clocks: list[int] = []
        self.powers: list[float] = []
        self.bits = 0
        self._stop = threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period)

    def _sample(self):
        mhz, w, bits = self.reader.sm_mhz(), self.reader.power_w(), self.reader.reasons()
        if mhz is not None:
            self.clocks.append(mhz)
        if w is not None:
            self.powers.append(w)
        self.bits |= bits or 0

    def __enter__(self):
        self._e0, self._t0 = self.reader.energy_mj(), time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()  # at least one reading, however short the block
        self._e1, self._t1 = self.reader.energy_mj(), time.perf_counter()
        return False

    def summary(self, replays: int | None = None) -> dict:
        out = {"window_s": round(self._t1 - self._t0, 4)}
        if self.clocks:
            out["sm_mhz"] = statistics.median(self.clocks)
            out["sm_mhz_min"] = min(self.clocks)
        if self.powers:
            out["power_w"] = round(statistics.median(self.powers), 1)
        out["reasons"] = reason_names(self.bits)
        if self._e0 is not None and self._e1 is not None and out["window_s"] > 0:
            # the counter's mean power over the window: NVML's power reading averages over about a
            # second and lags a change of load (NOTES, 2026-12-03, seventeenth session, call 1)
            out["counter_w"] = round((self._e1 - self._e0) / 1e3 / out["window_s"], 1)
            if replays:
                out["replays"] = replays
                out["mj_per_replay"] = round((self._e1 - self._e0) / replays, 4)
        return out
