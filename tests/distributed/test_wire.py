"""The wire formats as strategies: every format implements the one interface, the one chooser picks
each for its documented cases, and a new format is one class (run here through a real scaler)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from polyamp import LossScaleConfig, LossScaler
from polyamp.distributed import RankMismatchError, Reducer
from polyamp.distributed import _fingerprint as fp
from polyamp.distributed import _wire as wire


def _formats() -> list[type[wire.Wire]]:
    """polyamp's formats (this file adds one of its own)."""
    return [cls for cls in wire.Wire.__subclasses__() if cls.__module__ == wire.__name__]


def test_every_format_implements_the_interface():
    assert {cls.__name__ for cls in _formats()} == {"OneValue", "TwoValueMax", "PayloadBits"}
    for cls in _formats():
        assert not inspect.isabstract(cls) and cls.op in ("sum", "max"), cls
        for name in ("send", "read", "explain"):
            assert list(inspect.signature(getattr(cls, name)).parameters) == \
                list(inspect.signature(getattr(wire.Wire, name)).parameters), (cls, name)
    with pytest.raises(TypeError, match="abstract"):
        wire.Wire(fp.HOST, 0, 2, 0)  # type: ignore[abstract]


@pytest.mark.parametrize(("size", "n_extra", "payload", "chosen"), [
    (1, 0, False, "OneValue"), (2, 0, False, "OneValue"), (wire.LANE_RANKS, 0, False, "OneValue"),
    (wire.LANE_RANKS + 1, 0, False, "TwoValueMax"), (2, 2, False, "TwoValueMax"),
    (2, 4, False, "TwoValueMax"), (1, 1, False, "TwoValueMax"), (2**20, 2, False, "TwoValueMax"),
    (2, 0, True, "PayloadBits"), (wire.LANE_RANKS + 1, 0, True, "PayloadBits"),
])
def test_the_chooser_picks_each_format_for_its_documented_cases(size, n_extra, payload, chosen):
    assert wire.wire_for(size, n_extra, payload).__name__ == chosen


def test_every_format_is_chosen_somewhere():
    cases = [(size, n, payload) for size in (1, 2, wire.LANE_RANKS, wire.LANE_RANKS + 1)
             for n in (0, 1, 2, 4) for payload in (False, True)]
    assert {wire.wire_for(*case) for case in cases} == set(_formats())


class MaxOfDigests(wire.Wire):
    """A new format, one class: ``[f, D, -D]`` (float64, MAX; D the LANE digest below 2**43): the
    ranks agree on D exactly when ``max(D) == -max(-D)``; a difference is named by the inherited
    second collective."""

    op = "max"

    def send(self, fields, found, values):
        d = self.place.share(fields, fp.LANE)
        return self.place.vector([self.place.bit(found), d, -d], "float64")

    def read(self, message):
        return wire.Read(message[0] > 0, None, message[1] + message[2] == 0)


class Peer(Reducer):
    """Rank 0 of 2 whose peer sends this rank's message with its digest moved by ``shift`` (a MAX)
    and this rank's bytes (a SUM). Records (op, size) of every collective."""

    def __init__(self, shift: int) -> None:
        super().__init__("peer", 0, 2, None)
        self.shift, self.ops = shift, []

    def _prepare(self, array):
        return array

    def _allreduce(self, buffer, op):
        self.ops.append((op, int(buffer.size)))
        if op == "max":
            peer = np.array(buffer, copy=True)
            peer[1:] += [self.shift, -self.shift]
            np.maximum(buffer, peer, out=buffer)
        else:
            buffer *= 2

    def _barrier(self):
        pass


@pytest.fixture(params=["host", "device"])
def new_format(request, monkeypatch):
    """Every agreement sent in MaxOfDigests, on the host path or the device path (forced on NumPy)."""
    import polyamp._agreement as agreement

    monkeypatch.setattr(wire, "wire_for", lambda size, n_extra, payload=False: MaxOfDigests)
    if request.param == "device":
        monkeypatch.setattr(agreement, "_on_host", lambda *args: False)
    return request.param


def test_a_new_format_is_one_class(new_format):
    red = Peer(shift=0)
    scaler = LossScaler(LossScaleConfig(init_scale=4.0), reducer=red)
    results = []
    for grad in (1.0, np.inf, 1.0):
        results.append(scaler.step([np.full(2, grad, np.float32)], lambda: None).skipped)
        scaler.update()
    assert results == [False, True, False] and red.ops == [("max", 3)] * 3
    red = Peer(shift=1)  # the peer's digest differs: found, then named by the second collective
    scaler = LossScaler(LossScaleConfig(init_scale=4.0), reducer=red)
    with pytest.raises(RankMismatchError, match="the ranks are not aligned"):
        scaler.step([np.ones(2, np.float32)], lambda: pytest.fail("a misaligned step was applied"))
    assert red.ops == [("max", 3), ("sum", fp.BYTES.size)]
