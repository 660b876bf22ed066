"""The model registry: ``build(name, **config)`` and ``available()``."""

from __future__ import annotations

from typing import Callable

from dew.models.causal_transformer import CausalTransformer

_REGISTRY: dict[str, Callable] = {"causal_transformer": CausalTransformer}


def register(name: str, factory: Callable) -> None:
    """Makes ``build(name, ...)`` call ``factory(...)``."""
    if name in _REGISTRY:
        raise ValueError(f"a model named {name!r} is already registered")
    _REGISTRY[name] = factory


def available() -> list[str]:
    """The names ``build`` accepts."""
    return sorted(_REGISTRY)


def build(name: str, **config):
    """The model ``name`` configured with ``config`` (e.g. ``vocab_size=256, emb_features=64``)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(available())}")
    return _REGISTRY[name](**config)
