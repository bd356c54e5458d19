"""The VGPU stack (seed-era path): ``create_vgpu_stack(config=None)`` and its levels.

Implementation: :mod:`apt_model.memory.levels`.
"""
from apt_model.memory.levels import Level, VGPUStack, create_vgpu_stack

__all__ = ["Level", "VGPUStack", "create_vgpu_stack"]
