"""The global switch: modes, configuration, model adoption, patches and the decision report.

Public face: :mod:`apt_model.optimization.vb_global`.
"""
