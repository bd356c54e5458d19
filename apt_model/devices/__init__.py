"""The unified device layer: find, rank, probe and drive every accelerator kind.

* :mod:`~apt_model.devices.backend` — the :class:`AcceleratorBackend` contract one kind implements.
* :mod:`~apt_model.devices.backends` — the built-in kinds (CUDA, ROCm/DCU, NPU, MLU, XPU, MPS, CPU).
* :mod:`~apt_model.devices.registry` — ``@register_backend`` and the ``apt_model.backends`` entry points.
* :mod:`~apt_model.devices.detection` — every candidate with status and reason.
* :mod:`~apt_model.devices.ranking` — the one ranking policy and ``VB_DEVICE``.
* :mod:`~apt_model.devices.capabilities` / :mod:`~apt_model.devices.probes` — probed capabilities;
  :mod:`~apt_model.devices.probe_cache` — their results on disk.
* :mod:`~apt_model.devices.timing` — device events and the one ``synchronize``.
* :mod:`~apt_model.devices.plugins` — importing torch so a broken vendor plugin cannot kill it.
"""
# Attributes resolve lazily: ``apt_model.devices.plugins`` must be importable *before* torch is
# (it is what imports torch safely), so this package's __init__ imports nothing that needs torch.
_EXPORTS = {
    "AcceleratorBackend": "backend",
    "Detection": "backend",
    "Speed": "capabilities",
    "Support": "capabilities",
    "get_speed": "capabilities",
    "get_support": "capabilities",
    "Candidate": "detection",
    "clear_detection_cache": "detection",
    "detect_devices": "detection",
    "Selection": "ranking",
    "parse_device_spec": "ranking",
    "rank": "ranking",
    "select_device": "ranking",
    "register_backend": "registry",
    "registered_backends": "registry",
    "unregister_backend": "registry",
    "DeviceBackend": "device_backend",
    "UnifiedDeviceManager": "manager",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"apt_model.devices.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'apt_model.devices' has no attribute {name!r}")
