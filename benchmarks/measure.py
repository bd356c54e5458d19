"""Measurement helpers for the scripts in this folder: one implementation, in the package
(:mod:`apt_model.bench.measure`), shared with ``apt-vb bench``."""
from apt_model.bench.measure import (  # noqa: F401
    load_average,
    machine_info,
    summarize,
    time_calls,
    time_interleaved,
    write_json,
)
