"""The tiered memory stack (the "VGPU stack"): device HBM -> host RAM -> NVMe swap files.

* :mod:`~apt_model.memory.levels` — the levels with real capacities and measured bandwidths.
* :mod:`~apt_model.memory.swap` — the NVMe level: per-process swap folders, verified files.
* :mod:`~apt_model.memory.pages` / :mod:`~apt_model.memory.pager` — pages and the LRU pager.
* :mod:`~apt_model.memory.page_buffers` — evicted pages' host memory, reused by the next load.
* :mod:`~apt_model.memory.io_engine` — background reader and writer threads.
* :mod:`~apt_model.memory.waits` / :mod:`~apt_model.memory.interrupts` — bounded waits and locks; signal
  handlers held back while the training thread is inside them.
* :mod:`~apt_model.memory.placement` — what stays resident and what pages, and why.
* :mod:`~apt_model.memory.bandwidth` — the bandwidth probes.
* :mod:`~apt_model.memory.paging` — paging a model's training state through its own loop.
* :mod:`~apt_model.base.sizes` / :mod:`~apt_model.memory.host` — size parsing, RSS and malloc_trim.
"""
