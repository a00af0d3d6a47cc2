"""What ShardedGradScaler's agreement needs: the reducer over a process group, whether a group
covers a DeviceMesh, and whose flag a collective agrees (an optimizer's identity).

torch's FSDP scaler all-reduces one flag per device per optimizer inside ``unscale_``; polyamp
folds every device into one flag per optimizer, and one all-reduce through a
:mod:`polyamp.distributed` reducer agrees it (with the fingerprint that finds misaligned ranks).
Imports nothing of the facade. Importing it does not import torch.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
import zlib
from typing import Any

from polyamp._errors import ConfigError
from polyamp.adapters import iter_params
from polyamp.config import short_repr
from polyamp.distributed import Reducer, ReducerUnavailableError, reducer

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



def optimizer_identity(optimizer: Any) -> int:
    """Whose flag a sharded step agrees: the number of parameters in each param group and their
    dtypes, as every rank of a sharded job sees them (not their shapes, which differ between shards).

    Remembered per optimizer while its groups keep their sizes (a per-parameter pass only then).
    """
    if optimizer is None:
        return 0
    groups = getattr(optimizer, "param_groups", None)
    groups = groups if isinstance(groups, list) else [{"params": list(iter_params(optimizer))}]
    sizes = tuple(len(group["params"]) for group in groups)
    try:
        known = _IDENTITIES.get(optimizer)
    except TypeError:  # not weakly referenceable: computed each time
        known = None
    if known is not None and known[0] == sizes:
        return known[1]
    dtypes = tuple(tuple(sorted({str(p.dtype) for p in group["params"]})) for group in groups)
    identity = zlib.crc32(repr((sizes, dtypes)).encode()) or 1  # 0 means "none named"
    with contextlib.suppress(TypeError):
        _IDENTITIES[optimizer] = (sizes, identity)
    return identity


#: optimizer -> (its groups' sizes, its identity); weak, so no optimizer is kept alive by it
_IDENTITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
