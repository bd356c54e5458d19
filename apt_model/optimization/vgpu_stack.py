"""The VGPU stack (seed-era path): ``create_vgpu_stack(config=None)`` and its levels.

``print(create_vgpu_stack())`` gives one line per level as the original guide showed them
(``Level 0: cuda:0 - 71000MB @ 2900.0GB/s``, ``Level 2: nvme - 32000MB @ 0.7GB/s (folder; read ..,
write .. GB/s)``), with real capacities and bandwidths measured on this machine.

Implementation: :mod:`apt_model.memory.levels`.
"""
from apt_model.memory.levels import Level, VGPUStack, create_vgpu_stack

__all__ = ["Level", "VGPUStack", "create_vgpu_stack"]
