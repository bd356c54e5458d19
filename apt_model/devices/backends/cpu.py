"""The host CPU: always available, last in the ranking. Memory figures come from psutil.

On the CPU there is no caching allocator: "allocated" and "reserved" are the process's
resident set size (RSS), and the peak is the process's peak RSS.
"""
from __future__ import annotations

import platform
import sys

import psutil
import torch

from apt_model.devices.backend import AVAILABLE, AcceleratorBackend, Detection
from apt_model.devices.registry import register_backend


def cpu_model_name() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux, ``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def peak_rss_bytes() -> int:
    """Peak resident set size of this process, in bytes."""
    info = psutil.Process().memory_info()
    if sys.platform.startswith("linux") or sys.platform == "darwin":
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
    else:
        peak = getattr(info, "peak_wset", info.rss)
    return int(max(peak, info.rss))  # the kernel's high-water mark can lag the current RSS


@register_backend
class CpuBackend(AcceleratorBackend):
    """The host processor."""

    kind = "cpu"
    device_type = "cpu"
    vendor = "host CPU"
    priority = 100
    dist_backend = "gloo"
    visible_devices_env = None

    def detect(self, allow_init: bool = False) -> Detection:
        name = cpu_model_name()
        details = {
            "physical_cores": psutil.cpu_count(logical=False),
            "logical_cores": psutil.cpu_count(logical=True),
            "torch_threads": torch.get_num_threads(),
            "isa": torch.backends.cpu.get_cpu_capability(),
        }
        return Detection(
            AVAILABLE,
            f"{name}, {details['logical_cores']} logical cores, {details['isa']}",
            1,
            (name,),
            details=details,
        )

    def device_name(self, index: int = 0) -> str:
        return cpu_model_name()

    def device_properties(self, index: int = 0) -> dict:
        return {
            "name": cpu_model_name(),
            "total_memory": int(psutil.virtual_memory().total),
            "physical_cores": psutil.cpu_count(logical=False),
            "logical_cores": psutil.cpu_count(logical=True),
            "torch_threads": torch.get_num_threads(),
            "isa": torch.backends.cpu.get_cpu_capability(),
        }

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    def memory_allocated(self, index: int = 0) -> int:
        return int(psutil.Process().memory_info().rss)

    memory_reserved = memory_allocated

    def max_memory_allocated(self, index: int = 0) -> int:
        return peak_rss_bytes()

    def reset_peak_memory_stats(self, index: int = 0) -> None:
        from apt_model.base.errors import FigureUnavailable

        raise FigureUnavailable("the OS keeps the peak RSS for the process lifetime; it cannot be reset")

    def empty_cache(self) -> None:
        return None

    def compile_backend(self):
        """TorchInductor's C++ backend needs a C++ compiler on the PATH (``c++``, ``g++`` or ``clang++``)."""
        import shutil

        for cxx in ("c++", "g++", "clang++"):
            if shutil.which(cxx):
                return "inductor", f"TorchInductor's C++ backend (compiler {shutil.which(cxx)})"
        return None, "TorchInductor on the CPU needs a C++ compiler (c++, g++ or clang++) and none is on the PATH"

    def synchronize(self, index: int | None = None) -> None:
        return None
