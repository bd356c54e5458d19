"""Built-in device kinds. Importing this package registers them, in ranking order:
CUDA (NVIDIA) and ROCm/DCU (AMD, Hygon) > NPU (Ascend) > MLU (Cambricon) > XPU (Intel) > MPS (Apple) > CPU.
"""
from apt_model.devices.backends import cpu, cuda, mps, out_of_tree, xpu  # noqa: F401
