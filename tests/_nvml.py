"""NVML stood in beneath nvidia-ml-py: pynvml's own Python code runs (argument marshalling,
its return-code checks, its NVMLError classes); only libnvidia-ml's C functions are
replaced, by Python callables that write their out-arguments through the ctypes pointers
pynvml passes, as the library does, and return NVML's codes (nvml.h: 0 success,
2 invalid argument, 3 not supported). Values are an H100 SXM's as nvidia-smi -q shows them."""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass

import pynvml

SUCCESS, INVALID_ARGUMENT, NOT_SUPPORTED = 0, 2, 3
_HANDLE0 = 0x7000  # handles are opaque pointers to the caller


@dataclass
class Gpu:
    memory_total: int = 85_520_809_984  # "80 GB" H100: 81559 MiB
    ecc_uncorrected: int | None = 0  # None: a board without ECC (NOT_SUPPORTED)
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # corrected, uncorrected, pending, failed
    clocks_event_reasons: int = 0x1  # nvmlClocksEventReasonGpuIdle
    temperature: int = 31
    slowdown_temperature: int = 87
    persistence: int = 1
    mig: tuple[int, int] = (0, 0)


def _out(pointer, value) -> None:
    pointer._obj.value = value  # ctypes.byref(x)._obj is x


class Library:
    """The C functions pynvml looks up by name (``getattr(nvmlLib, name)``); a name not here is
    NVML_ERROR_FUNCTION_NOT_FOUND, as with an older driver."""

    def __init__(self, gpus: list[Gpu]):
        self.gpus, self.calls = gpus, []

    def _gpu(self, handle) -> Gpu | None:
        index = ctypes.cast(handle, ctypes.c_void_p).value - _HANDLE0
        return self.gpus[index] if 0 <= index < len(self.gpus) else None

    def nvmlInitWithFlags(self, flags):
        return SUCCESS

    def nvmlShutdown(self):
        return SUCCESS

    def nvmlErrorString(self, code):
        return {2: b"Invalid Argument", 3: b"Not Supported"}.get(getattr(code, "value", code), b"Unknown Error")

    def nvmlDeviceGetCount_v2(self, count):
        _out(count, len(self.gpus))
        return SUCCESS

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        if not 0 <= index.value < len(self.gpus):
            return INVALID_ARGUMENT
        pointer = ctypes.c_void_p(_HANDLE0 + index.value)
        ctypes.memmove(ctypes.addressof(handle._obj), ctypes.addressof(pointer), ctypes.sizeof(pointer))
        return SUCCESS

    def nvmlDeviceGetMemoryInfo(self, handle, memory):
        gpu = self._gpu(handle)
        memory._obj.total, memory._obj.free, memory._obj.used = gpu.memory_total, gpu.memory_total - 2**29, 2**29
        return SUCCESS

    def nvmlDeviceGetTotalEccErrors(self, handle, error_type, counter_type, count):
        gpu = self._gpu(handle)
        if gpu.ecc_uncorrected is None:
            return NOT_SUPPORTED
        _out(count, gpu.ecc_uncorrected if error_type.value == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 0)
        return SUCCESS

    def nvmlDeviceGetRemappedRows(self, handle, corrected, uncorrected, pending, failed):
        rows = self._gpu(handle).remapped_rows
        if rows is None:
            return NOT_SUPPORTED
        for pointer, value in zip((corrected, uncorrected, pending, failed), rows, strict=True):
            _out(pointer, value)
        return SUCCESS

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle, pending):
        _out(pending, 0)
        return SUCCESS

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle, reasons):
        _out(reasons, self._gpu(handle).clocks_event_reasons)
        return SUCCESS

    def nvmlDeviceGetTemperature(self, handle, sensor, temperature):
        _out(temperature, self._gpu(handle).temperature)
        return SUCCESS

    def nvmlDeviceGetTemperatureThreshold(self, handle, threshold, temperature):
        gpu = self._gpu(handle)
        if threshold.value != pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
            return NOT_SUPPORTED
        _out(temperature, gpu.slowdown_temperature)
        return SUCCESS

    def nvmlDeviceGetPersistenceMode(self, handle, mode):
        _out(mode, self._gpu(handle).persistence)
        return SUCCESS

    def nvmlDeviceGetMigMode(self, handle, current, pending):
        _out(current, self._gpu(handle).mig[0])
        _out(pending, self._gpu(handle).mig[1])
        return SUCCESS


@contextlib.contextmanager
def nvml_standin(gpus: list[Gpu]):
    """pynvml, with ``gpus`` behind it, for the duration (and as it was after)."""
    saved = pynvml.nvmlLib
    pynvml.nvmlLib = Library(gpus)
    pynvml._nvmlGetFunctionPointer_cache.clear()
    try:
        yield pynvml
    finally:
        pynvml.nvmlLib = saved
        pynvml._nvmlGetFunctionPointer_cache.clear()
