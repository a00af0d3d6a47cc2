"""The trainable-array container that polyamp optimizers update."""

from __future__ import annotations

from typing import Any

import array_api_compat

__all__ = ["Parameter"]


def _is_array(value: object) -> bool:
    """Whether ``value`` is an array of an array-API library (numpy, cupy, torch, ...)."""
    return hasattr(value, "__array_namespace__") or array_api_compat.is_array_api_obj(value)


class Parameter:
    """A trainable array plus its gradient: the unit an optimizer updates.

    Any array-API array is accepted, so one optimizer serves numpy, cupy, torch, array_api_strict.
    """

    __slots__ = ("__weakref__", "_data", "_grad")

    def __init__(self, data: Any, grad: Any | None = None) -> None:
        self.data = data
        self.grad = grad

    @property
    def data(self) -> Any:
        """The parameter's values; optimizers overwrite them in place where the library allows."""
        return self._data

    @data.setter
    def data(self, value: Any) -> None:
        if not _is_array(value):
            raise TypeError("Parameter data must be an array-API array (numpy, cupy, torch, "
                            "array_api_strict, ...), got "
                            f"{type(value).__module__}.{type(value).__qualname__}; convert it first, e.g. "
                            "Parameter(numpy.asarray(value, dtype=numpy.float32))")
        self._data = value

    @property
    def grad(self) -> Any | None:
        """The gradient of the loss with respect to ``data``, or None when not yet computed."""
        return self._grad

    @grad.setter
    def grad(self, value: Any | None) -> None:
        if value is not None and not _is_array(value):
            raise TypeError("Parameter grad must be None or an array-API array, got "
                            f"{type(value).__module__}.{type(value).__qualname__}; convert it with the "
                            "data's namespace, e.g. array_api_compat.array_namespace(p.data).asarray(value)")
        if value is not None and tuple(value.shape) != self.shape:
            raise ValueError(f"Parameter grad must have the data's shape {self.shape}, got "
                             f"{tuple(value.shape)}; compute the gradient of the same array")
        self._grad = value

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of ``data`` as a plain tuple."""
        return tuple(self._data.shape)

    @property
    def dtype(self) -> Any:
        """Dtype of ``data``, as the array library reports it."""
        return self._data.dtype

    def __repr__(self) -> str:
        grad = "None" if self._grad is None else "set"
        library = type(self._data).__module__.split(".")[0]
        return f"Parameter(shape={self.shape}, dtype={self.dtype}, library={library}, grad={grad})"
