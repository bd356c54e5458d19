"""The compile ladder: per adopted model, torch.compile → a registered override → eager.

* :mod:`~apt_model.compile.backends` — the device kind's compiler (the device contract's
  ``compile_backend`` / ``compile``), wrapped to count compilations and their seconds;
* :mod:`~apt_model.compile.overrides` — the override rung: a ``torch.compile`` backend that
  applies registered graph rewrites (hand-written attention → SDPA; a vendor's fused kernels),
  verified against the captured graph on the first call's inputs, then runs the graph eagerly;
* :mod:`~apt_model.compile.ladder` — the per-model state machine: each rung warms up, then an
  on-line A/B trial against eager keeps it or falls to the next, with every attempt in a timeline;
* :mod:`~apt_model.compile.step` — the switch's ``compile`` feature step;
* :mod:`~apt_model.compile.settings` — its settings entries.
"""
