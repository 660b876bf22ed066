"""Plain-JAX layers. Each module declares its weights (``Param``: shape, logical axes, init) and
applies them to whatever shards it is handed; none of them knows about the mesh."""

from dew.nn.param import Param, init_params, logical_axes

__all__ = ["Param", "init_params", "logical_axes"]
