"""A ReLU multilayer perceptron with a hand-written backward pass, for NumPy or CuPy arrays: every
activation and gradient rounded to the compute dtype, so float16 gradients underflow as on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import array_api_compat
import numpy as np

from polyamp import Parameter, _dtypes
from polyamp._errors import ConfigError
from polyamp.flat import FlatArrays

from ._lowp import round_to

__all__ = ["MLP", "softmax_cross_entropy"]


class MLP:
    """``Linear -> ReLU -> ... -> Linear``; weights of std ``weight_std`` (None: He's), biases 0."""

    def __init__(self, sizes: Sequence[int], *, weight_std: float | None = None, seed: int = 0,
                 like: Any = None) -> None:
        sizes = list(sizes)
        if len(sizes) < 2 or not all(isinstance(n, int) and n > 0 for n in sizes):
            raise ConfigError(f"sizes must list >= 2 positive ints (inputs ... outputs), got sizes={sizes!r}")
        like = np.zeros((), np.float32) if like is None else like
        xp = array_api_compat.array_namespace(like)
        shapes = [s for n_in, n_out in zip(sizes, sizes[1:]) for s in ((n_in, n_out), (n_out,))]
        # masters live in one flat float32 array, so the compute copy is one rounding per step
        self._masters = FlatArrays(shapes, "float32", like=like)
        rng = np.random.default_rng(seed)
        for view in self._masters.views[::2]:
            n_in = view.shape[0]
            std = math.sqrt(2.0 / n_in) if weight_std is None else weight_std
            view[...] = xp.asarray(rng.standard_normal(view.shape).astype(np.float32) * np.float32(std))
        self._params = [Parameter(v) for v in self._masters.views]
        self._xp, self.sizes = xp, sizes
        self._cache: dict[str, Any] = {}

    def parameters(self) -> list[Parameter]:
        """The float32 master parameters: weight and bias of each layer, in order."""
        return self._params

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        """``("layers.<i>.weight" / "layers.<i>.bias", parameter)`` in order, as torch names them."""
        return [(f"layers.{i // 2}.{'bias' if i % 2 else 'weight'}", p) for i, p in enumerate(self._params)]

    def forward(self, x: Any, compute_dtype: Any = "float32") -> Any:
        """The logits of ``x``, computed in the compute dtype (one rounding of the masters, then one
        matmul and one rounding per layer); kept for :meth:`backward`."""
        logits, self._cache = self._run(x, _dtypes.compute_dtype_name(compute_dtype))
        return logits

    def _run(self, x: Any, name: str) -> tuple[Any, dict[str, Any]]:
        """The forward pass and what :meth:`backward` needs of it (nothing stored: a ``predict`` on
        another thread leaves a training step's cache alone)."""
        xp = self._xp
        weights = self._masters.views_of(round_to(self._masters.flat, name))  # low-precision copy
        act = _dtypes.cast(x, "float32")
        acts, n_layers = [act], len(weights) // 2
        for i in range(n_layers):
            z = xp.matmul(act, weights[2 * i]) + weights[2 * i + 1]  # float32 accumulation
            if i < n_layers - 1:
                z = xp.maximum(z, xp.zeros((), dtype=z.dtype))
            act = round_to(z, name)  # what a compute-dtype kernel would store
            acts.append(act)
        return _dtypes.cast(act, name), {"name": name, "weights": weights, "acts": acts}

    def backward(self, grad_output: Any) -> None:
        """Write d(loss)/d(parameter) into every ``p.grad`` from d(loss)/d(logits), rounded as it goes."""
        if not self._cache:
            raise RuntimeError("MLP.backward() needs a forward() first; call model.forward(x, dtype)")
        xp, name = self._xp, self._cache["name"]
        weights, acts = self._cache["weights"], self._cache["acts"]
        delta = round_to(_dtypes.cast(grad_output, "float32"), name)
        for i in reversed(range(len(weights) // 2)):
            w_grad, b_grad = self._params[2 * i].grad, self._params[2 * i + 1].grad
            w_grad[...] = round_to(xp.matmul(xp.matrix_transpose(acts[i]), delta), name)
            b_grad[...] = round_to(xp.sum(delta, axis=0), name)
            if i:
                back = xp.matmul(delta, xp.matrix_transpose(weights[2 * i]))
                delta = round_to(xp.where(acts[i] > 0, back, xp.zeros((), dtype=back.dtype)), name)
        self._cache = {}

    def predict(self, x: Any) -> Any:
        """Class indices for inputs ``x``: the forward pass in float32 (a training step's cache kept)."""
        return self._xp.argmax(self._run(x, "float32")[0], axis=1)


def softmax_cross_entropy(logits: Any, labels: Any, normalizer: int | None = None) -> tuple[Any, Any]:
    """Cross-entropy of ``logits`` against ``labels`` summed over ``normalizer`` (default: the batch
    size), and its gradient ``(softmax - onehot) / normalizer``; in float32, as torch.autocast does."""
    xp = array_api_compat.array_namespace(logits)
    z = _dtypes.cast(logits, "float32")
    z = z - xp.max(z, axis=1, keepdims=True)
    log_p = z - xp.log(xp.sum(xp.exp(z), axis=1, keepdims=True))
    onehot = xp.astype(labels[:, None] == xp.arange(z.shape[1])[None, :], xp.float32)
    denominator = float(z.shape[0] if normalizer is None else normalizer)
    loss = -xp.sum(log_p * onehot) / denominator
    grad = (xp.exp(log_p) - onehot) / denominator
    return loss, grad
