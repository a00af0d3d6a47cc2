"""What ShardedGradScaler adds to GradScaler: every rank agrees on each optimizer's overflow.

torch's FSDP scaler all-reduces one flag per device per optimizer inside ``unscale_``; here
the engine folds every device into one flag per optimizer, and one all-reduce through a
:mod:`polyamp.distributed` reducer agrees it (with the fingerprint that finds misaligned ranks)
before the skip decision and the update.
FSDP2's DTensor gradients are unscaled as their local shards where the group spans their
mesh: DTensor's own unscale would all-reduce the flag once more (a MAX per dtype group).
Imports nothing of the facade: ``polyamp.compat.torch`` composes these mixins with its
GradScaler. Importing it does not import torch.
"""

from __future__ import annotations

import sys
import weakref
import zlib
from typing import Any

from polyamp._agreement import Agreement
from polyamp._errors import ConfigError
from polyamp.adapters import iter_params
from polyamp.config import short_repr
from polyamp.distributed import Reducer, ReducerUnavailableError, reducer
from polyamp.engine import LossScaler

_PICKLE = (
    "a ShardedGradScaler built on process_group={group} cannot be pickled or copied: a process "
    "group belongs to the process that built it. Fix: save scaler.state_dict() and load it into "
    "a ShardedGradScaler built on the group in the new process (process_group=None, the default "
    "group, and group names such as 'mpi' do pickle)."
)


def build_reducer(process_group: Any) -> Reducer:
    """The reducer over ``process_group`` (None: torch.distributed's default group).

    Errors name the argument: a TypeError for an object no reducer accepts, a ConfigError for
    a rank outside the group, ReducerUnavailableError when the default group is not initialised.
    """
    try:
        return reducer("torch" if process_group is None else process_group)
    except (TypeError, ConfigError, ReducerUnavailableError) as exc:
        raise type(exc)(f"ShardedGradScaler(process_group={short_repr(process_group)}): {exc}") from None


def mesh_inside(mesh: Any, red: Reducer) -> bool:
    """Whether every rank of a DeviceMesh is in the torch process group behind ``red``.

    The same answer on every rank of the mesh, so all of them unscale alike.
    """
    group = getattr(red, "group", None)
    dist = sys.modules.get("torch.distributed")
    if group is None or dist is None or not isinstance(group, dist.ProcessGroup):
        return False
    return set(mesh.mesh.flatten().tolist()) <= set(dist.get_process_group_ranks(group))



def mesh_holds(mesh: Any, red: Reducer | None) -> bool:
    """Whether a DeviceMesh holds every rank of the torch process group behind ``red``: then every
    rank of the group holds a shard of the mesh's DTensors (not so for pipeline stages, each on
    its own mesh). The same answer on every rank of the group."""
    group = getattr(red, "group", None)
    dist = sys.modules.get("torch.distributed")
    if group is None or dist is None or not isinstance(group, dist.ProcessGroup):
        return False
    return set(dist.get_process_group_ranks(group)) <= set(mesh.mesh.flatten().tolist())


def dtensor_shapes(optimizer: Any, holds: Any) -> tuple[Any, ...]:
    """The global shapes and dtypes of the optimizer's DTensor parameters whose mesh ``holds(mesh)``
    every rank of the group, per param group in order: the same on every rank (a DTensor's
    ``shape`` is the global one). Empty where there are none; other parameters are left out
    (their shards differ)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:  # never imported: no parameter is a DTensor
        return ()
    shapes = tuple(tuple((tuple(p.shape), str(p.dtype)) for p in group["params"]
                         if isinstance(p, dtensor) and holds(p.device_mesh))
                   for group in _groups(optimizer))
    return shapes if any(shapes) else ()


def _groups(optimizer: Any) -> list[Any]:
    """The optimizer's param groups (one group of its parameters where it has none)."""
    groups = getattr(optimizer, "param_groups", None)
    return groups if isinstance(groups, list) else [{"params": list(iter_params(optimizer))}]


class Places:
    """Whose flag a sharded step agrees (:meth:`identity`): equal on every rank of a legitimate
    sharded job, whatever each rank's shard holds.

    An optimizer is named by its place among the optimizers this scaler stepped, in the order first
    stepped (since construction, a new process group, ``load_state_dict`` or unpickling), its class,
    and the global shapes and dtypes of its DTensors whose mesh holds every rank of the group
    (:func:`mesh_holds`). Not the number, shapes or dtypes of a rank's own parameters: they differ
    between shards (uneven FSDP shards, a ZeRO partition, pipeline stages). So an optimizer stepped
    at another place than on the other ranks is found (also one stepped in another order from some
    iteration on); two optimizers of one class swapped on a rank from their first step on are
    found only where their DTensors' global shapes differ.
    """

    def __init__(self) -> None:
        self._holds: dict[Any, bool] = {}  # DeviceMesh -> does it hold every rank of the group
        # id(optimizer) -> its weak reference (None: not weakly referenceable), place, group sizes, identity
        self._known: dict[int, tuple[Any, int, tuple[int, ...], int]] = {}
        self._count = 0  # places given so far (a dead optimizer's place is not given again)

    def identity(self, optimizer: Any, red: Reducer | None) -> int:
        """The optimizer's identity over ``red`` (one reducer for the life of these places; None: no
        DTensor counts), never 0 (0: none named; None gives 0). Computed once per optimizer while
        its groups keep their sizes (a pass over its parameters only then)."""
        if optimizer is None:
            return 0
        key = id(optimizer)
        sizes = tuple(len(group["params"]) for group in _groups(optimizer))
        known = self._known.get(key)
        if known is not None and known[0] is not None and known[0]() is not optimizer:
            known = None  # the id of an optimizer that is gone: this one is new
        if known is not None and known[2] == sizes:
            return known[3]
        place = self._count if known is None else known[1]
        kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        shapes = dtensor_shapes(optimizer, lambda mesh: self._mesh_holds(mesh, red))
        identity = zlib.crc32(repr((place, kind, shapes)).encode()) or 1
        try:
            ref = weakref.ref(optimizer)
        except TypeError:  # not weakly referenceable: known by its id
            ref = None
        self._known[key] = (ref, place, sizes, identity)
        if known is None:
            self._count += 1
        return identity

    def _mesh_holds(self, mesh: Any, red: Reducer | None) -> bool:
        if mesh not in self._holds:
            self._holds[mesh] = mesh_holds(mesh, red)
        return self._holds[mesh]


class ShardedMethods:
    """Mixin of :class:`polyamp.compat.torch.ShardedGradScaler`: torch's signature, the group,
    and the agreement of each optimizer's flag (one collective per ``unscale_``/``step``, which
    also finds ranks whose config, scale or sequence of collectives differ)."""

    _engine: LossScaler
    _device: str
    _allow_fp16 = True  # FSDP's mixed precision hands FP16 gradients to the scaler
    _flags_are_sums = True  # the flags are agreed over the ranks (0 or 1: some rank overflowed)

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Any = None,
        *,
        backend: str | None = None,
        backoff_interval: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        diagnose: bool = False,
        guard: Any = None,
    ) -> None:
        super().__init__(  # type: ignore[call-arg]  # GradScaler's order: growth_factor first
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled,
            backend=backend, backoff_interval=backoff_interval, min_scale=min_scale,
            max_scale=max_scale, diagnose=diagnose, guard=guard,
        )
        self.process_group = process_group

    @property
    def process_group(self) -> Any:
        """The group as given (None: torch.distributed's default group, resolved at first use)."""
        return self._group

    @process_group.setter
    def process_group(self, group: Any) -> None:
        """An explicit group is checked now; the next step checks the config across it again."""
        self._engine.iteration.agreement = None if group is None else Agreement(build_reducer(group))
        self._group = group
        self._meshes: dict[Any, bool] = {}  # DeviceMesh -> do the group's ranks cover it
        self._places = Places()  # whose flag each optimizer's agreement is: restarts with the group

    @property
    def reducer(self) -> Reducer:
        """The polyamp reducer that agrees the flags (``reducer.collectives`` counts them)."""
        return self._agreed().reducer

    def _agreed(self) -> Agreement:
        """The agreement over the reducer (the default group is resolved at first use)."""
        iteration = self._engine.iteration
        if iteration.agreement is None:
            iteration.agreement = Agreement(build_reducer(self._group))
        return iteration.agreement

    def _check_grads(self, grads: list[Any], check_only: bool, optimizer: Any = None) -> Any:
        """Unscale (or check) ``grads`` and return the flag agreed over the group (1: some rank overflowed).

        Every rank issues the same collective, also one with no gradients (its flag is 0).
        The same collective finds ranks whose config, state or collectives differ, or that step
        another optimizer at this point (:class:`Places`): RankMismatchError.
        """
        agreement, iteration = self._agreed(), self._engine.iteration  # resolved before anything changes
        grads = self._local_shards(grads, agreement.reducer)
        iteration.require_loss(None, "ShardedGradScaler.step()",
                               "scale the loss (a tensor holding one value) with scaler.scale(loss)")
        found = iteration.unscale(grads, check_only=check_only, owned=True)  # 0 without gradients
        if iteration.guard is None:
            return iteration.agree_flag(found, whose=self._places.identity(optimizer, agreement.reducer))
        # the guard's values (the loss, these shards' squares) ride in the same collective
        whose = self._places.identity(optimizer, agreement.reducer)
        agreed = iteration.agree_group(found, iteration.squares(iteration.backend, grads),
                                       self._group_of(optimizer), whose=whose)
        self._values[id(optimizer)] = agreed.extra
        return agreed.found_inf

    def _agree_own_flag(self, flag: Any, optimizer: Any) -> Any:
        """A flag an ``_unscale_grads_`` override computed itself, agreed over the group (one collective)."""
        whose = self._places.identity(optimizer, self._agreed().reducer)
        return self._engine.iteration.agree_flag(flag, whose=whose)

    def _confirm_aligned(self, found: Any) -> None:
        """Before a fused optimizer's step: where the agreement lives on a GPU, read the flag
        (one sync) so that misaligned ranks raise here; they skip on the device regardless."""
        iteration = self._engine.iteration
        agreement = iteration.agreement
        if agreement is not None and agreement.unverified and iteration.backend.read_flag(found):
            iteration.verify()

    def _local_shards(self, grads: list[Any], red: Reducer) -> list[Any]:
        """DTensor gradients replaced by their local shards (same memory) where ``red``'s group
        covers the DTensor's mesh, so the one agreement below is the only collective. Elsewhere the
        DTensor stays, and its unscale agrees across its mesh as in torch."""
        dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        if dtensor is None or not any(issubclass(kind, dtensor) for kind in set(map(type, grads))):
            return grads
        meshes = self._meshes
        for mesh in {g.device_mesh for g in grads if isinstance(g, dtensor)} - meshes.keys():
            meshes[mesh] = mesh_inside(mesh, red)
        return [g.to_local() if isinstance(g, dtensor) and meshes[g.device_mesh] else g for g in grads]

    def __getstate__(self) -> dict[str, Any]:
        group = self._group
        if group is not None and not isinstance(group, str):
            raise TypeError(_PICKLE.format(group=short_repr(group)))
        state = super().__getstate__()  # type: ignore[misc]
        for name in ("_group", "_agreement", "_meshes", "_places"):
            state["extra"].pop(name, None)
        state["process_group"] = group
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        self.process_group = state.get("process_group")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """GradScaler's load; the optimizers' places restart (every rank loads alike)."""
        super().load_state_dict(state_dict)  # type: ignore[misc]
        self._places = Places()

    def __repr__(self) -> str:
        return (f"ShardedGradScaler(device={self._device!r}, process_group={short_repr(self._group)}, "
                f"engine={self._engine!r})")


class DisabledShardedInit:
    """torch's ShardedGradScaler signature for the disabled scaler: no group is ever used."""

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Any = None,
        **extra: Any,
    ) -> None:
        super().__init__(  # type: ignore[call-arg]
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled, **extra
        )
        self._group = process_group

    @property
    def process_group(self) -> Any:
        """The group as given; a disabled scaler issues no collective."""
        return self._group

    @process_group.setter
    def process_group(self, group: Any) -> None:
        self._group = group

    @property
    def reducer(self) -> None:
        """None: a disabled scaler steps on every rank, so there is nothing to agree."""
        return None

    def __repr__(self) -> str:
        return f"ShardedGradScaler(device={self._device!r}, enabled=False)"  # type: ignore[attr-defined]
