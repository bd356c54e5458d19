"""Measuring on this machine: the helpers every benchmark shares (:mod:`~apt_model.bench.measure`)
and the ``apt-vb bench`` suite (:mod:`~apt_model.bench.suite`).

Rules (DESIGN.md section 9): warm-up first, medians with quartiles, the thread count fixed and
recorded, results as JSON with the machine description, and never a timing as a test assertion.
"""
