"""Activation memory: checkpointing (recompute in backward) and offload (saved tensors leave fast
memory between forward and backward), applied by the switch without editing the model.

* :mod:`~apt_model.activations.checkpoint` — block discovery, policies, the checkpointed forward.
* :mod:`~apt_model.activations.offload` — saved-tensor hooks that offload to host / NVMe.
* :mod:`~apt_model.activations.manager` — what the switch does per adopted model, and the report.
"""
