"""The ground floor: mechanisms every other package imports downward, importing nothing above.

* :mod:`~apt_model.base.patches` — the undo stack (``PatchSet``) that makes ``disable()`` exact;
* :mod:`~apt_model.base.feature` — the feature-step protocol every switch feature implements;
* :mod:`~apt_model.base.settings` — the settings mechanism and the one reader of ``VB_*`` variables;
* :mod:`~apt_model.base.errors`, :mod:`~apt_model.base.log` — the error types and the logger;
* :mod:`~apt_model.base.sizes` — ``"512MB"``-style sizes; :mod:`~apt_model.base.launch` — the
  launcher's variables (rank, local rank, world size); :mod:`~apt_model.base.user_cache` — the
  user's cache folder; :mod:`~apt_model.base.version` — the package version.
"""
