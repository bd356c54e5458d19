"""Multi-device and multi-process training under the switch (``docs/distributed.md``).

One module per job:

* :mod:`~apt_model.base.launch` — the launcher's variables (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``...): :func:`read_launch_env`, :func:`process_rank`;
* :mod:`~apt_model.devices.binding` — each rank's local device, respecting the vendor's
  visible-devices variable (used by the ranking policy);
* :mod:`~apt_model.distributed.backend_mapping` — the selected kind's ``torch.distributed``
  backend, and mapping a script's ``"nccl"`` to the backend that works here;
* :mod:`~apt_model.distributed.process_group` — initializing the default process group when the
  script has not, and the ``init_process_group`` / ``new_group`` patches;
* :mod:`~apt_model.distributed.ddp` — DistributedDataParallel applied in place to an adopted model;
* :mod:`~apt_model.distributed.data_parallel` — ``nn.DataParallel`` device ids and replicas;
* :mod:`~apt_model.distributed.wrappers` — recognizing DDP / FSDP2 / DataParallel the script applied;
* :mod:`~apt_model.distributed.session` — the policy of one switch session and its report.

Importing this package imports neither ``torch.distributed`` nor the switch; the switch's
``vb.ensure_process_group()`` initializes the default group early, on request.
"""
from apt_model.base.launch import LaunchEnv, process_rank, read_launch_env

__all__ = ["LaunchEnv", "process_rank", "read_launch_env"]

