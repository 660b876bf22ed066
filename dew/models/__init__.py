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
    """The model ``name`` configured with ``config``.

    Args:
      name: a registered model (``available()``): ``"causal_transformer"``, or one added with
        ``register``.
      **config: the model's fields: for ``"causal_transformer"``, ``CausalTransformer``'s
        (``vocab_size``, ``emb_features``, ``num_layers``, ``num_heads``, ``max_seq_len``, ...).

    Returns:
      the model, e.g. a ``CausalTransformer``.

    Raises:
      ValueError: ``name`` is not registered, or the model refuses ``config``.

    Examples:
        >>> import dew
        >>> model = dew.models.build("causal_transformer", vocab_size=256, emb_features=64,
        ...                          num_layers=2, num_heads=4, max_seq_len=32)
        >>> model.head_dim
        16
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(available())}")
    return _REGISTRY[name](**config)
