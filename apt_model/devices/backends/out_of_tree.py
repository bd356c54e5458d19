"""Out-of-tree accelerators that plug into torch as a PrivateUse1 device: Huawei Ascend NPU
(``torch_npu``) and Cambricon MLU (``torch_mlu``).

Accelerate's ``is_npu_available`` hides the import error of a broken ``torch_npu`` (it just
returns False) and ``is_mlu_available`` lets it propagate; here the exact error text is kept
and reported as the candidate's reason instead, so we do our own detection for these kinds.
A device module registered under the kind's name by anything else (for example a test that
registers a PrivateUse1 backend named ``npu``) is detected the same way.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from apt_model.devices.backend import (
    AVAILABLE,
    ERROR,
    NOT_INSTALLED,
    UNAVAILABLE,
    AcceleratorBackend,
    Detection,
)
from apt_model.devices.plugins import PLUGIN_ERRORS, describe_exception
from apt_model.devices.registry import register_backend


@contextmanager
def _env(values: dict[str, str]):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class OutOfTreeBackend(AcceleratorBackend):
    """A device provided by a vendor package that registers ``torch.<device_type>``."""

    #: Environment set while detecting (vendor switches that avoid initializing the device).
    detect_env: dict[str, str] = {}
    install_hint = ""

    def detect(self, allow_init: bool = False) -> Detection:
        mod = getattr(torch, self.device_type, None)
        if mod is None:
            if self.package not in PLUGIN_ERRORS and not self.package_installed(self.package):
                return Detection(NOT_INSTALLED, f"package {self.package} not installed{self.install_hint}")
            err = self.import_package()
            if err is not None:
                return Detection(ERROR, f"{self.package} is installed but failed to load: {err}")
            mod = getattr(torch, self.device_type, None)
            if mod is None:
                return Detection(ERROR, f"{self.package} imported but registered no torch.{self.device_type} module")
        details = {self.visible_devices_env: self.visible_devices(), "privateuse1_name": _privateuse1_name()}
        try:
            with _env(self.detect_env):
                count = int(mod.device_count())
        except Exception as err:  # noqa: BLE001
            return Detection(ERROR, f"torch.{self.device_type}.device_count() failed: {describe_exception(err)}", details=details)
        if count == 0:
            return Detection(
                UNAVAILABLE,
                f"torch.{self.device_type} is present but reports 0 devices "
                f"({self.visible_devices_env}={self.visible_devices()!r})",
                details=details,
            )
        names: tuple[str, ...] = ()
        initialized = getattr(mod, "is_initialized", lambda: False)
        try:
            if allow_init or initialized():
                names = tuple(str(mod.get_device_name(i)) for i in range(count))
        except Exception as err:  # noqa: BLE001 - names are optional
            details["names_error"] = describe_exception(err)
        reason = f"found {count} device(s)" + (": " + ", ".join(sorted(set(names))) if names else "")
        return Detection(AVAILABLE, reason, count, names, details=details)


def _privateuse1_name() -> str:
    try:
        return torch._C._get_privateuse1_backend_name()
    except Exception:  # noqa: BLE001
        return "privateuseone"


@register_backend
class NpuBackend(OutOfTreeBackend):
    """Huawei Ascend NPU through ``torch_npu`` (needs the CANN toolkit)."""

    kind = "npu"
    device_type = "npu"
    vendor = "Huawei Ascend (CANN)"
    priority = 10
    package = "torch_npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    install_hint = " (install torch_npu matching your torch and CANN versions)"

    def compile_backend(self):
        """Ascend's graph mode through ``torchair`` (``torchair.get_npu_backend()``, the backend
        Huawei documents for ``torch.compile`` on NPUs); TorchInductor has no NPU code generator.
        Not verified on an NPU in this version."""
        if not self.package_installed("torchair"):
            return None, "torchair (Ascend graph mode) is not installed; TorchInductor has no NPU code generator"
        try:
            import torchair

            return torchair.get_npu_backend(compiler_config=torchair.CompilerConfig()), "torchair (Ascend graph mode)"
        except Exception as err:  # noqa: BLE001 - a broken vendor package must be survivable
            return None, f"torchair failed to load: {describe_exception(err)}"


@register_backend
class MluBackend(OutOfTreeBackend):
    """Cambricon MLU through ``torch_mlu`` (needs the Neuware / CNToolkit stack).

    There is no torch_mlu on the public package index; this backend follows its documented
    API (``torch.mlu`` mirrors ``torch.cuda``) and is tested through the PrivateUse1 route.
    """

    kind = "mlu"
    device_type = "mlu"
    vendor = "Cambricon (Neuware)"
    priority = 20
    package = "torch_mlu"
    dist_backend = "cncl"
    visible_devices_env = "MLU_VISIBLE_DEVICES"
    detect_env = {"PYTORCH_CNDEV_BASED_MLU_CHECK": "1"}  # count through CNDev, no device init
    install_hint = " (Cambricon ships torch_mlu with its Neuware SDK)"

    def compile_backend(self):
        return None, "no torch.compile backend is known for Cambricon MLU in this version"
