"""What ShardedGradScaler's agreement needs: the reducer over a process group, whether a group
covers a DeviceMesh, and whose flag a collective agrees (:class:`Places`: an optimizer's place).

torch all-reduces one flag per device per optimizer; polyamp agrees one flag per optimizer with one
all-reduce through a :mod:`polyamp.distributed` reducer. Importing it does not import torch.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from polyamp._digest import content_digest
from polyamp._errors import ConfigError
from polyamp.config import short_repr
from polyamp.distributed import Reducer, ReducerUnavailableError, reducer

from ._torch_grads import param_groups

PICKLE_REFUSED = (
    "a ShardedGradScaler built on process_group={group} cannot be pickled or copied: a process "
    "group belongs to the process that built it. Fix: save scaler.state_dict() and load it into "
    "a ShardedGradScaler built on the group in the new process (process_group=None, the default "
    "group, and group names such as 'mpi' do pickle)."
)


def build_reducer(process_group: Any) -> Reducer:
    """The reducer over ``process_group`` (None: torch.distributed's default group); the reducer's
    errors (TypeError, ConfigError, ReducerUnavailableError) name the argument."""
    try:
        return reducer("torch" if process_group is None else process_group)
    except (TypeError, ConfigError, ReducerUnavailableError) as exc:
        raise type(exc)(f"ShardedGradScaler(process_group={short_repr(process_group)}): {exc}") from None


def mesh_inside(mesh: Any, red: Reducer | None, *, holds: bool = False) -> bool:
    """Whether every rank of a DeviceMesh is in the torch process group behind ``red``; ``holds``:
    whether the mesh holds every rank of the group instead (then every rank of the group holds a
    shard of its DTensors; not so for pipeline stages). The same answer on every rank of both."""
    group = getattr(red, "group", None)
    dist = sys.modules.get("torch.distributed")
    if group is None or dist is None or not isinstance(group, dist.ProcessGroup):
        return False
    in_mesh, in_group = set(mesh.mesh.flatten().tolist()), set(dist.get_process_group_ranks(group))
    return in_group <= in_mesh if holds else in_mesh <= in_group


def dtensor_shapes(optimizer: Any, holds: Any) -> tuple[Any, ...]:
    """The global shapes and dtypes (the same on every rank) of the optimizer's DTensor parameters whose
    mesh ``holds(mesh)`` every rank of the group, per param group; empty where there are none."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:  # never imported: no parameter is a DTensor
        return ()
    shapes = tuple(tuple((tuple(p.shape), str(p.dtype)) for p in group["params"]
                         if isinstance(p, dtensor) and holds(p.device_mesh))
                   for group in param_groups(optimizer))
    return shapes if any(shapes) else ()


class Places:
    """Whose flag a sharded step agrees (:meth:`identity`): equal on every rank of a legitimate
    sharded job, whatever each rank's shard holds.

    An optimizer is named by its place in first-step order (since construction, a new process group,
    ``load_state_dict`` or unpickling), its class, and its :func:`dtensor_shapes`; not by a rank's own
    parameters. Two optimizers of one class swapped on a rank from their first step on are found only
    where those shapes differ.
    """

    def __init__(self) -> None:
        self._holds: dict[Any, bool] = {}  # DeviceMesh -> does it hold every rank of the group
        # id(optimizer) -> its weak reference (None: not weakly referenceable), place, group sizes, identity
        self._known: dict[int, tuple[Any, int, tuple[int, ...], int]] = {}
        self._count = 0  # places given so far (a dead optimizer's place is not given again)

    def identity(self, optimizer: Any, red: Reducer | None) -> int:
        """The optimizer's identity over ``red`` (one reducer for these places' life; None: no DTensor
        counts), never 0 (None's). Computed again only when its groups' sizes change."""
        if optimizer is None:
            return 0
        key = id(optimizer)
        sizes = tuple(len(group["params"]) for group in param_groups(optimizer))
        known = self._known.get(key)
        if known is not None and known[0] is not None and known[0]() is not optimizer:
            known = None  # the id of an optimizer that is gone: this one is new
        if known is not None and known[2] == sizes:
            return known[3]
        place = self._count if known is None else known[1]
        kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        shapes = dtensor_shapes(optimizer, lambda mesh: self._mesh_holds(mesh, red))
        identity = content_digest(repr((place, kind, shapes)).encode())
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
            self._holds[mesh] = mesh_inside(mesh, red, holds=True)
        return self._holds[mesh]
