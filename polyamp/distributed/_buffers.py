"""The one error of reducers that reduce in place: a buffer of the wrong dtype or layout."""

from __future__ import annotations

from collections.abc import Sequence

from .._errors import ForeignArrayError


def check_buffer(describe: str, what: str, dtype: str, dtypes: Sequence[str], facts: dict[str, bool],
                 where: str = "", placed: bool = True) -> None:
    """Raise ForeignArrayError unless ``dtype`` is one of ``dtypes``, every fact holds and ``placed``.

    ``describe``: the reducer; ``what``: the array (e.g. "a CuPy array on device 1"); ``facts``:
    what a buffer must be, by adjective ({"C-contiguous": True, "writeable": False}); ``where``:
    where it must live, for the fix (e.g. " on device 0"), and ``placed``: whether it does.
    """
    if dtype in dtypes and all(facts.values()) and placed:
        return
    state = ", ".join(f"{name}: {value}" for name, value in facts.items())
    needs = " ".join(reversed(facts))
    raise ForeignArrayError(
        f"{describe} cannot all-reduce {what} of dtype {dtype} ({state}) in place. Fix: pass a "
        f"{needs} array of one of {tuple(dtypes)}{where}."
    )
