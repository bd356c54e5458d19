"""The models adopted with their whole training state resident on level 0.

A model whose plan fits what the level-0 budget leaves is not paged (the paging step's decision
``resident``), yet its parameters, gradients and optimizer states occupy level 0 all the same.
:class:`ResidentModels` remembers such models (weakly: a model the script drops stops counting)
so that the plans of the models adopted after them, and the pager's room for pages, count their
bytes against the one budget — several models share it (docs/tiers.md).
"""
from __future__ import annotations

import weakref
from typing import Container

import torch.nn as nn

from apt_model.memory.placement import params_state_sizes


class ResidentModels:
    """Weakly held models kept whole on level 0, with their training-state bytes.

    The bytes are counted as the placement plan counts them
    (:func:`~apt_model.memory.placement.plan_placement`): every parameter, a gradient per trainable
    parameter and ``state_factor`` times the trainable bytes of optimizer state (2: Adam's ``m``
    and ``v``), each parameter once however many models share it.
    """

    def __init__(self, state_factor: float = 2.0):
        self.state_factor = float(state_factor)
        self._models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def add(self, model: nn.Module) -> None:
        """Remember ``model`` (held weakly)."""
        self._models[model] = None

    def models(self) -> list[nn.Module]:
        """The resident models still alive."""
        return list(self._models.keys())

    def __len__(self) -> int:
        """Resident models still alive (changes when one is freed)."""
        return len(self._models)

    def bytes(self, exclude: nn.Module | None = None, paged: Container[int] = ()) -> int:
        """Training-state bytes of the resident models, in bytes: leaving out the parameters of
        ``exclude`` (the model being planned: a wrapper of a resident model, or the model itself
        adopted again, brings those along) and those whose ``id`` is in ``paged`` (paged since,
        through a model that wraps the resident one: its pages count them)."""
        own = {id(p) for p in exclude.parameters()} if exclude is not None else set()
        params = [p for m in self.models() for p in m.parameters()
                  if id(p) not in own and id(p) not in paged]
        p_bytes, t_bytes = params_state_sizes(params)
        return p_bytes + t_bytes + int(self.state_factor * t_bytes)
