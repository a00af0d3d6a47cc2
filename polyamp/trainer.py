"""Mixed-precision training around the loss scaler: float32 masters, low-precision compute.

:class:`MixedPrecisionTrainer` runs one training step as::

    inputs (and floating targets) -> compute dtype; forward in the compute dtype
    loss (float32) -> scaled by the loss scale -> backward in the compute dtype
    gradients -> float32 master gradients (one flat GradBuffer) -> unscale_ (one call)
    -> global norm / clip (one call) -> optimizer step on the masters unless the gradients or
    their norm hold inf/nan -> update

Torch models (``torch.nn.Module``, torch imported only then) run under ``torch.autocast``; anything
else follows :class:`ArrayModel` (NumPy, CuPy, any array-API library). ``reducer=``: docs/distributed.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import array_api_compat
import numpy as np

from . import _dtypes, _step_inputs
from ._agreement import Agreement
from ._digest import content_digest
from ._errors import ConfigError
from ._guard_values import loss_check
from ._iteration import Iteration
from ._masters import check_masters
from ._metering import check_meter
from ._registry import model_steps
from .adapters import iter_params
from .config import FIXED_ONE, LossScaleConfig
from .engine import LossScaler, make_iteration
from .grads import GradBuffer, _check_max_norm
from .guard import StepGuard, Verdict, check_guard, verdict_field, why
from .noop import NoOpLossScaler
from .overflow import OverflowReport, build_report, check_diagnose
from .parameter import Parameter

if TYPE_CHECKING:  # annotations only: `import polyamp` loads the meter on first use
    from .precision import PrecisionMeter, PrecisionReport

__all__ = ["ArrayLossFn", "ArrayModel", "MixedPrecisionTrainer", "StepMetrics"]


@runtime_checkable
class ArrayModel(Protocol):
    """A model without autograd that the trainer can run in any compute dtype.

    ``parameters()`` returns polyamp.Parameters holding float32 masters. ``forward`` gets inputs already
    cast to the compute dtype and should compute from low-precision copies of the masters; ``backward``
    gets d(scaled loss)/d(output) in the compute dtype, propagates it in the compute dtype, and writes
    (overwrites) each gradient into ``p.grad``, a float32 view of the trainer's GradBuffer; that write is
    the cast back to float32.
    """

    def parameters(self) -> Any: ...

    def forward(self, x: Any, compute_dtype: str) -> Any: ...

    def backward(self, grad_output: Any) -> None: ...


class ArrayLossFn(Protocol):
    """``loss_fn(output, target) -> (loss, d loss / d output)`` for an :class:`ArrayModel`."""

    def __call__(self, output: Any, target: Any) -> tuple[Any, Any]: ...


@dataclass(frozen=True)
class StepMetrics:
    """What one :meth:`MixedPrecisionTrainer.train_step` did, as host numbers.

    ``loss_scale`` is the scale this step's backward used; ``grad_norm`` is the global norm of the
    unscaled gradients before clipping (inf or nan on a skipped step). ``overflow``: with
    ``diagnose=True``, the report on a skipped step's gradients and loss, else None.
    """

    loss: float
    loss_scale: float
    skipped: bool
    grad_norm: float
    overflow: OverflowReport | None = None
    verdict: Verdict | None = None  # the guard's (None without a guard, or a non-finite norm)

    @property
    def reason(self) -> str | None:
        """None when applied, else why (``"overflow"``, or polyamp.StepGuard's reasons)."""
        return why(self.verdict, self.skipped)

    loss_spike = verdict_field("loss_spike", "Whether the guard found the loss a spike, also on an overflow "
                               "step (None: not judged).")


class MixedPrecisionTrainer:
    """Train ``model`` with float32 master weights, ``compute_dtype`` compute, dynamic loss scaling.

    ``config`` configures the :class:`polyamp.LossScaler`; ``loss_scaling=False`` uses the no-op scaler
    instead (to see what goes wrong without it; a step with inf/nan gradients is still skipped).
    ``max_grad_norm`` clips by global norm. Each step reads the loss, the skip decision and the norm on
    the host.

    ``reducer`` (see ``polyamp.distributed.reducer``: a torch process group, ``"torch"``, an mpi4py
    communicator, ``"mpi"``, ...) makes it data parallel: each rank passes its shard of the batch, the
    loss's gradient is divided by the number of ranks before the backward and the float32 gradients are
    summed after it: with equal shards, the step of one process on the whole batch. One collective per
    step, and one more at the first to check the ranks' scaler configs.

    ``diagnose=True`` puts an :class:`polyamp.OverflowReport` in ``StepMetrics.overflow`` on skipped steps
    (gradients named by the model's ``named_parameters()``, else ``params[i]``).

    ``meter`` (a :class:`polyamp.PrecisionMeter`) counts the unscaled master gradients of each sample step,
    named as ``diagnose`` names them: :attr:`last_precision`, and the fractions in ``scaler.metrics()``.
    With ``loss_scaling=False`` it counts at a scale fixed at 1 (the scaler is then a
    :class:`polyamp.LossScaler` at 1, as with a guard). With ``reducer=`` it counts the summed gradients
    (the same on every rank); ranks whose meters differ raise ``RankMismatchError``.
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        compute_dtype: Any = "float16",
        config: LossScaleConfig | None = None,
        *,
        loss_scaling: bool = True,
        max_grad_norm: float | None = None,
        backend: str | None = None,
        reducer: Any = None,
        diagnose: bool = False,
        guard: StepGuard | None = None,
        meter: PrecisionMeter | None = None,
    ) -> None:
        self._diagnose = check_diagnose(diagnose)
        guard, meter = check_guard(guard), check_meter(meter)
        self._dtype = _dtypes.compute_dtype_name(compute_dtype)
        if max_grad_norm is not None:
            _check_max_norm(max_grad_norm)
        self._model, self._optimizer, self._max_grad_norm = model, optimizer, max_grad_norm
        self._clip_id = 0 if max_grad_norm is None else content_digest(repr(float(max_grad_norm)).encode())
        if loss_scaling or guard is not None or meter is not None:  # no scaling: the scale fixed at 1
            config = config if loss_scaling else FIXED_ONE
            # the one iteration: gradients summed, decided, updated
            self._iteration = make_iteration(config, backend, reducer=reducer, guard=guard, meter=meter)
            self._scaler: Any = LossScaler.over(self._iteration)
        else:  # no scaling: a fixed scale of 1 to fingerprint, and the decision on a non-finite norm
            self._scaler = NoOpLossScaler(config, backend)
            agreement = None if reducer is None else Agreement(reducer)
            self._iteration = Iteration(FIXED_ONE, None, agreement=agreement)
        self._unscaled_skips = 0  # steps skipped for a non-finite norm without loss scaling
        self._steps: Any = model_steps(model, self._dtype) or ArraySteps(model, self._dtype)
        _check_optimizer_holds(optimizer, self._steps.params)
        # with a reducer the fingerprint rides after the gradients: one collective per step
        # (and, with a guard, the rank's loss before it: summed with the gradients, the ranks' mean)
        self._loss_slot = guard is not None and reducer is not None
        spare = 0 if reducer is None else Agreement.payload_spare() + self._loss_slot
        self._grads = GradBuffer.attach(self._steps.params, spare=spare)
        self._aligned_once = False  # the first step checks the ranks' sizes before summing

    # -- properties -------------------------------------------------------------------
    @property
    def model(self) -> Any:
        """The model being trained."""
        return self._model

    @property
    def optimizer(self) -> Any:
        """The optimizer that updates the float32 masters."""
        return self._optimizer

    @property
    def compute_dtype(self) -> str:
        """The compute dtype's name: "float16", "bfloat16" or "float32"."""
        return self._dtype

    @property
    def scaler(self) -> Any:
        """The :class:`polyamp.LossScaler` (or the no-op scaler when loss scaling is off)."""
        return self._scaler

    @property
    def reducer(self) -> Any:
        """The ``polyamp.distributed.Reducer`` that sums the gradients over the ranks, or None."""
        agreement = self._iteration.agreement
        return None if agreement is None else agreement.reducer

    @property
    def grads(self) -> GradBuffer:
        """The float32 master gradients: every ``p.grad`` is a view of ``grads.flat``."""
        return self._grads

    @property
    def loss_scale(self) -> float:
        """The loss scale the next step will use (a device sync on a GPU)."""
        return float(self._scaler.get_scale())

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped because gradients (or their norm) held inf or nan."""
        return self._scaler.skipped_steps + self._unscaled_skips

    @property
    def steps(self) -> int:
        """How many steps ran (applied or skipped)."""
        return self._scaler.steps

    @property
    def last_precision(self) -> PrecisionReport | None:
        """With ``meter=``, the :class:`polyamp.PrecisionReport` of the last sample step, else None."""
        return self._iteration.metering.last

    # -- the step -----------------------------------------------------------------------
    def train_step(self, input: Any, target: Any, loss_fn: Any) -> StepMetrics:
        """One step: forward and backward in the compute dtype, masters updated unless inf/nan.

        Host reads: the loss, the skip decision and the gradient norm (one sync each on a GPU).
        ``input`` is an array; ``target`` an array or None (passed to ``loss_fn`` as it is). What
        ``loss_fn`` returns is checked before the backward: a bad call changes no weight or counter.
        """
        _step_inputs.check_batch(input, target)
        scaler, grads = self._scaler, self._grads
        grads.reattach()
        grads.zero_()
        reducer = self.reducer
        ranks = 1 if reducer is None else reducer.size
        loss = self._steps.forward_backward(input, target, loss_fn, scaler, ranks)
        host_loss = _host_loss(loss)  # the loss's one read, before any weight or counter moves
        if scaler.enabled:
            grads.mark_scaled()
        summed = None  # with a loss slot: the ranks' mean loss
        if reducer is not None:
            summed = self._sum_over_ranks(grads, loss / ranks if self._loss_slot else None)
        metering = self._iteration.metering
        sampled = metering.active and metering.due(False, self._iteration.steps, None)
        grads.unscale_(scaler, names=self._names() if sampled else None)  # a sample step: named
        if self._scaler.enabled and self._scaler.guard is not None:
            self._iteration.take_loss(summed if self._loss_slot else loss, "train_step()")
        norm = grads.norm() if self._max_grad_norm is None else grads.clip_(self._max_grad_norm)
        finite = self._check_norm(norm)
        try:
            result = scaler.step([grads.flat], self._optimizer.step if finite else lambda: None)
        except BaseException:  # the optimizer raised (or Ctrl-C): the next train_step starts afresh
            self._iteration.end() if scaler.enabled else scaler.update()
            raise
        scaler.update()
        skipped = bool(result.skipped) or not finite
        loss, scale = host_loss, float(result.scale_before)
        report = self._explain(loss, scale) if skipped and self._diagnose else None
        return StepMetrics(loss, scale, skipped, float(norm), report, result.verdict if finite else None)

    def _names(self) -> list[str]:
        """Each trained parameter's name: the model's ``named_parameters()``, else ``params[i]``."""
        named = getattr(self._model, "named_parameters", None)
        by_id = {id(p): n for n, p in named()} if callable(named) else {}
        names = [by_id.get(id(p), f"params[{i}]") for i, p in enumerate(self._steps.params)]
        return names if len(set(names)) == len(names) else [f"params[{i}]" for i in range(len(names))]

    def _explain(self, loss: float, scale: float) -> OverflowReport:
        """The report on a skipped step: each parameter's gradient (a view of the buffer), the loss."""
        named = [(name, p.grad) for name, p in zip(self._names(), self._steps.params) if p.grad is not None]
        return build_report(named, loss=loss, scale=scale, skipped=True)

    def _sum_over_ranks(self, grads: GradBuffer, loss: Any = None) -> Any:
        """Sum the gradients (and the loss slot) over the ranks in place: ONE collective, with the
        fingerprint (:meth:`polyamp._iteration.Iteration.sum_payload`); the first also checks sizes.
        Returns the loss slot (the ranks' mean loss, a device view), or None without one."""
        size = int(grads.flat.shape[0])
        if loss is not None:  # the guard's loss slot rides with the gradients
            xp = array_api_compat.array_namespace(grads.storage)
            grads.storage[size:size + 1] = xp.reshape(xp.astype(loss, grads.storage.dtype), (1,))
            size += 1
        # every rank must clip alike and guard alike: the clip setting, the guard's settings and
        # history are part of what is agreed
        whose = self._iteration.whose(self._clip_id)  # the guard's and the meter's folded in
        like = None if self._aligned_once else grads.flat
        self._iteration.sum_payload(grads.storage, size, whose=whose, like=like)
        self._aligned_once = True
        return None if loss is None else grads.storage[size - 1:size]

    def _check_norm(self, norm: Any) -> bool:
        """False when a non-finite norm keeps this step off the weights: with loss scaling it joins the
        scaler's check on the device; without, the iteration decides here (one read)."""
        xp = array_api_compat.array_namespace(norm)
        bad = xp.astype(~xp.isfinite(norm), xp.float32)
        if self._scaler.enabled:
            self._scaler.record_found_inf(bad)
            return True
        iteration = self._iteration
        iteration.record(bad)
        decision = iteration.decide()  # ranks found to differ on the device: raised here
        iteration.finish(decision, rule=False)
        self._unscaled_skips += decision.skipped
        return not decision.skipped

    def __repr__(self) -> str:
        return (f"MixedPrecisionTrainer(model={type(self._model).__name__}, compute_dtype={self._dtype!r}, "
                f"scaler={self._scaler!r})")


class ArraySteps:
    """Forward and backward of an :class:`ArrayModel`; the loss function returns its gradient."""

    def __init__(self, model: Any, dtype: str) -> None:
        if not isinstance(model, ArrayModel):
            raise TypeError("model must be a torch.nn.Module or follow polyamp.ArrayModel "
                            "(parameters(), forward(x, compute_dtype), "
                            f"backward(grad_output)), got {type(model).__qualname__}")
        self.params = list(model.parameters())
        check_masters(self.params, Parameter, lambda p: p.data)
        self.model, self.dtype = model, dtype

    def forward_backward(self, input: Any, target: Any, loss_fn: Any, scaler: Any, ranks: int = 1) -> Any:
        """Run the model and write scaled compute-dtype gradients into the float32 buffer.

        ``ranks``: the loss's float32 gradient is divided by it first (data parallel).
        """
        x = _dtypes.cast(input, self.dtype)
        if target is not None and _dtypes.is_floating(target):
            target = _dtypes.cast(target, self.dtype)
        output = self.model.forward(x, self.dtype)
        loss, grad_output = _step_inputs.array_loss(loss_fn(output, target), output)
        grad_output = _dtypes.cast(grad_output, "float32")
        seed = scaler.scale(grad_output / ranks if ranks > 1 else grad_output)
        with np.errstate(over="ignore"):  # float16 overflow to inf is the scaler's to catch
            seed = _dtypes.cast(seed, self.dtype)
        self.model.backward(seed)
        return loss


def _host_loss(loss: Any) -> float:
    """The loss as a Python float (one read); TypeError naming it unless it is one real value."""
    loss_check(loss, "train_step()")
    return float(loss.reshape(()) if hasattr(loss, "reshape") else loss)


def _check_optimizer_holds(optimizer: Any, params: list[Any]) -> None:
    """Raise unless ``optimizer`` updates every trained parameter of the model."""
    held = {id(p) for p in iter_params(optimizer)}
    missing = [i for i, p in enumerate(params) if id(p) not in held]
    if missing:
        raise ConfigError(f"the optimizer does not hold model parameters at indices {missing}; build "
                          "it from model.parameters(), e.g. polyamp.optim.Adam(model.parameters())")
