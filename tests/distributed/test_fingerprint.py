"""The fingerprint's encodings (host == device == the documented layout), the bytes of the second
collective that name what differs, and the agreement against a second scaler's real messages.

Multi-process runs are in test_misaligned_ranks.py; here the encoding itself, and the device
path (used for GPU arrays) run on NumPy arrays against a second scaler's real message.
"""

from __future__ import annotations

import numpy as np
import pytest

from polyamp import LossScaleConfig, LossScaler
from polyamp.distributed import RankMismatchError, Reducer, ReducerError, config_fingerprint, reducer
from polyamp.distributed import _fingerprint as fp
from polyamp.distributed import _wire as wire
from polyamp.policy import LossScaleState, scale_bits

SCALES = [2.0**-126, 2.0**-100, 0.3, 1.0, 3.0, 1024.0, 65536.0, 2.0**100 * 1.75, 3.4028234663852886e38]


ENCODINGS = [fp.BYTES, fp.BITS]


def _layout(values, encoding: fp.Encoding) -> np.ndarray:
    """The documented layout: field by field (the config and whose flag four 32-bit words each, the
    others one), lowest digit first (bytes and then their squares, or bits)."""
    octets = np.array(fp.words(values), "<u4").view(np.uint8)
    if encoding.digit_bits == 1:
        return np.unpackbits(octets, bitorder="little").astype(np.float64)
    return np.concatenate([octets, octets.astype(np.float64) ** 2]).astype(np.float64)


def _numpy_device() -> fp.Place:
    import array_api_compat.numpy as xp

    return fp.Place(xp, "cpu")  # the device code (as for a GPU), on NumPy arrays


@pytest.mark.parametrize("encoding", ENCODINGS, ids=["bytes", "bits"])
@pytest.mark.parametrize("scale", SCALES)
def test_the_device_encoding_equals_the_host_encoding(scale, encoding):
    host = [123456789, 7, 2, 2**32 - 1, 10**9, 2, 5]
    growth, backoff = 1999, 3
    device = _numpy_device()
    state = (np.array(scale, np.float32), np.array(growth, np.int32), np.array(backoff, np.int32))
    got = device.encode(device.fields(host, state), encoding)
    mine = fp.Fingerprint(*host, scale_bits(np.float32(scale)), growth, backoff)
    want = fp.encode(mine, encoding)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(want, _layout(mine, encoding))
    assert got.shape == (encoding.size,) and float(got.max()) <= (255.0**2 if encoding.squares else 1.0)


def test_bytes_and_squares_fit_the_message():
    assert fp.BYTES.size == 2 * 4 * fp.N_WORDS == 128 and wire.HEAD == 2
    assert fp.BITS.size == 32 * fp.N_WORDS == 512


def _sums(*prints: fp.Fingerprint, encoding=fp.BYTES) -> np.ndarray:
    return sum(fp.encode(p, encoding) for p in prints)


def _print(scale: float = 1024.0, **fields) -> fp.Fingerprint:
    base = dict(config=5, iteration=3, collective=1, sequence=3, payload=0, extras=0, whose=0,
                scale=scale_bits(scale), growth_tracker=0, backoff_tracker=0)
    base.update(fields)
    return fp.Fingerprint(**base)


@pytest.mark.parametrize("encoding", ENCODINGS, ids=["bytes", "bits"])
def test_equal_fingerprints_are_aligned_for_any_number_of_ranks(encoding):
    for n in (1, 2, 3, 64):
        assert not fp.misaligned(_sums(*[_print()] * n, encoding=encoding), n, encoding)
    assert fp.misaligned(_sums(_print(), _print(2.0), encoding=encoding), 2, encoding)


def test_a_byte_that_differs_is_found_even_when_the_sums_match():
    """Ranks sending bytes 1 and 3 sum like ranks sending 2 and 2: the squares tell them apart."""
    a, b, c = _print(iteration=1), _print(iteration=3), _print(iteration=2)
    assert fp.misaligned(_sums(a, b), 2) and not fp.misaligned(_sums(c, c), 2)
    assert _sums(a, b)[1] == _sums(c, c)[1]  # the iteration's lowest byte: equal sums


def test_two_ranks_name_the_other_value():
    mine, other = _print(1024.0), _print(2.0**20)
    sums = _sums(mine, other)
    assert fp.misaligned(sums, 2)
    text = "rank states differ: scale 2**{} on this rank, scale 2**{} on the other ranks"
    assert fp.describe(sums, 2, mine) == text.format(10, 20)
    assert fp.describe(sums, 2, other) == text.format(20, 10)


def test_three_ranks_say_when_the_others_differ_among_themselves():
    a, b, c = _print(1024.0), _print(1024.0), _print(0.3)
    sums = _sums(a, b, c)
    assert fp.describe(sums, 3, c) == (
        "rank states differ: scale 0.3 on this rank, scale 2**10 on the other ranks")
    for agreeing in (a, b):  # true on a rank that agrees with one of the others, too
        assert fp.describe(sums, 3, agreeing) == (
            "rank states differ: scale 2**10 on this rank, another value on at least one other rank "
            "(the other ranks do not all agree)")


def test_a_collective_out_of_place_is_named_by_its_position():
    mine = _print(iteration=0, collective=2, sequence=1)
    other = _print(iteration=1, collective=1, sequence=1)
    text = fp.describe(_sums(mine, other), 2, mine)
    assert text.startswith("the ranks' collectives are not aligned: collective 2 of iteration 0")
    assert "collective 1 of iteration 1 (#2) on the other ranks" in text


@pytest.mark.parametrize("field", ["config", "payload", "extras", "growth_tracker", "backoff_tracker"])
def test_every_field_is_named(field):
    mine, other = _print(), _print(**{field: 9})
    text = fp.describe(_sums(mine, other), 2, mine)
    assert text and ("9" in text), text


class Recorder(Reducer):
    """A rank that keeps its messages (a second scaler's, to pair with the first's). ``peer``: it
    stands as rank 1 of 2 (what :class:`PairedWith`'s peer sends) beside a rank 0 in its own state,
    whose one-value message cancels its own (``c`` and ``e`` sum to 0 over the ranks); else a group of one."""

    def __init__(self, peer: bool = False) -> None:
        super().__init__("recorder", int(peer), 1 + int(peer), None)
        self.messages: list[np.ndarray] = []

    def _prepare(self, array):
        return array

    def _allreduce(self, buffer, op):
        self.messages.append(np.array(buffer.numpy() if hasattr(buffer, "numpy") else buffer, copy=True))
        if self.size == 2 and op == "sum" and str(buffer.dtype).endswith("int64"):  # rank 0, same state:
            flag, v = divmod(int(buffer[0]), wire.B)  # its flag, and -v mod Q (its c is -c)
            buffer[0] = 2 * flag * wire.B + v + (-v) % fp.Q

    def _barrier(self):
        pass


class PairedWith(Reducer):
    """Rank 0 of two, whose peer's message is one recorded from another scaler: the reduction is
    real. ``explain``: the peer's fingerprint, whose bytes it sends in the second collective."""

    def __init__(self, peer: Recorder, explain: fp.Fingerprint | None = None) -> None:
        super().__init__("pair", 0, 2, None)
        self.peer, self.explain = peer, explain

    def _peer(self, op):
        index = self.collectives - 1
        if index < len(self.peer.messages):
            return np.asarray(self.peer.messages[index])
        assert op == "sum" and self.explain is not None, "the peer sent no such message"
        return fp.encode(self.explain, fp.BYTES)

    def _prepare(self, array):
        return array

    def _allreduce(self, buffer, op):
        peer = self._peer(op).astype(buffer.dtype)
        if op == "max":
            np.maximum(buffer, peer, out=buffer)
        else:
            buffer += peer

    def _barrier(self):
        pass


def _peer(config: LossScaleConfig, iteration: int, sequence: int, scale: float, growth: int = 0):
    """The fingerprint of the peer's agreement (collective 1 of ``iteration``)."""
    return fp.Fingerprint(config_fingerprint(config), iteration, 1, sequence, 0, 0, 0, scale_bits(scale),
                          growth, 0)


@pytest.fixture(params=["host", "device"])
def path(request, monkeypatch):
    """Run the agreement as for host arrays, or as for GPU arrays (forced on NumPy arrays)."""
    if request.param == "device":
        import polyamp._agreement as agreement

        monkeypatch.setattr(agreement, "_on_host", lambda *args: False)
    return request.param


def _run(scaler: LossScaler, steps: int, applied: list[int]) -> None:
    for step in range(steps):
        scaler.step([np.full(3, 2.0, np.float32)], lambda step=step: applied.append(step))
        scaler.update()


def test_aligned_ranks_step_together(path):
    peer = Recorder(peer=True)
    _run(LossScaler(LossScaleConfig(init_scale=8.0), reducer=peer), 3, [])
    applied: list[int] = []
    _run(LossScaler(LossScaleConfig(init_scale=8.0), reducer=PairedWith(peer)), 3, applied)
    assert applied == [0, 1, 2]


def test_another_scale_raises_before_the_step_is_applied(path):
    peer = Recorder(peer=True)
    _run(LossScaler(LossScaleConfig(init_scale=8.0), reducer=peer), 2, [])
    red = PairedWith(peer, _peer(LossScaleConfig(init_scale=8.0), 1, 1, 8.0, growth=1))
    scaler = LossScaler(LossScaleConfig(init_scale=8.0), reducer=red)
    applied: list[int] = []
    _run(scaler, 1, applied)
    scaler.set_scale(4.0)  # this rank alone
    expected = "scale 2\\*\\*2 on this rank, scale 2\\*\\*3 on the other ranks"
    with pytest.raises(RankMismatchError, match=expected):
        _run(scaler, 1, applied)
    assert applied == [0]
    with pytest.raises(ReducerError, match="cannot issue another collective.*misaligned"):
        red.allreduce_sum_(np.zeros(1))


def test_the_device_path_adds_the_mismatch_to_the_agreed_flag(monkeypatch):
    import polyamp._agreement as agreement

    monkeypatch.setattr(agreement, "_on_host", lambda *args: False)
    peer = Recorder(peer=True)
    config = LossScaleConfig(init_scale=8.0, growth_interval=7)
    _run(LossScaler(config, reducer=peer), 1, [])
    scaler = LossScaler(LossScaleConfig(init_scale=8.0), reducer=PairedWith(peer, _peer(config, 0, 0, 8.0)))
    scaler.unscale_([np.ones(2, np.float32)])
    agreed = scaler.agree_()
    assert float(agreed.found_inf) == 1.0  # no overflow: the 1 is the mismatch, so every rank skips
    assert scaler.reducer.collectives == 1  # the second collective only once the skip decision read it
    with pytest.raises(RankMismatchError, match="config fingerprint"):
        scaler.step([], lambda: pytest.fail("a misaligned step was applied"))


def test_the_trainer_storage_carries_the_fingerprint_after_the_gradients():
    from polyamp import GradBuffer

    buffer = GradBuffer([(2, 3), (4,)], spare=fp.BITS.size)
    assert buffer.flat.shape == (10,) and buffer.storage.shape == (10 + fp.BITS.size,)
    buffer.views[1][...] = 5.0
    assert buffer.storage[6:10].tolist() == [5.0] * 4 and np.shares_memory(buffer.flat, buffer.storage)
    plain = GradBuffer([(2,)])
    assert plain.storage is plain.flat


def test_extra_holds_at_most_two_values_and_nothing_is_sent():
    from polyamp import ConfigError

    red = Recorder()
    scaler = LossScaler(reducer=red)
    scaler.unscale_([np.ones(2, np.float32)])
    with pytest.raises(ConfigError, match="at most 2 values"):
        scaler.agree_(np.zeros(3))
    assert red.collectives == 0
    scaler.agree_(np.zeros(2))
    assert red.collectives == 2  # the first message with extra values is announced first


def test_on_fault_is_checked():
    from polyamp import ConfigError

    with pytest.raises(ConfigError, match="on_fault must be 'abort'.*or 'raise'.*got on_fault='exit'"):
        reducer("mpi", on_fault="exit")
    red = Recorder()
    assert red.on_fault == "abort" and reducer(red) is red
    with pytest.raises(ConfigError, match="cannot change the existing reducer"):
        reducer(red, on_fault="raise")


def test_state_values_of_a_host_state_are_fingerprinted_too():
    """The trainer without loss scaling fingerprints a fixed scale of 1."""
    state = LossScaleState(np.array(1.0, np.float32), np.array(0, np.int32), np.array(0, np.int32))
    device = _numpy_device()
    on_host = device.encode(device.fields([1, 2, 3, 4, 5, 0, 7, scale_bits(1.0), 0, 0]), fp.BYTES)
    from_state = device.encode(device.fields([1, 2, 3, 4, 5, 0, 7], state), fp.BYTES)
    np.testing.assert_array_equal(on_host, from_state)


@pytest.mark.parametrize("encoding", ENCODINGS, ids=["bytes", "bits"])
def test_the_device_encoding_runs_on_torch_tensors(encoding):
    """The GPU path's operations on torch tensors (here on the CPU): equal to the host encoding."""
    torch = pytest.importorskip("torch")
    import array_api_compat

    xp = array_api_compat.array_namespace(torch.zeros(()))
    device = fp.Place(xp, torch.device("cpu"))
    state = (torch.tensor(0.3, dtype=torch.float32), torch.tensor(17, dtype=torch.int32),
             torch.tensor(2, dtype=torch.int32))
    host = [4, 3, 2, 1, 0, 2, 0]
    got = device.encode(device.fields(host, state), encoding)
    want = fp.encode(fp.Fingerprint(*host, scale_bits(np.float32(0.3)), 17, 2), encoding)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float64
    np.testing.assert_array_equal(got.numpy(), want)
    if encoding == fp.BITS:  # the trainer's check of summed bits, on the device
        read = wire.PayloadBits(device, 0, 2, 0).read
        assert bool(read(got * 2).aligned) and not bool(read(got * 2 + 1).aligned)


class TorchPairedWith(PairedWith):
    """PairedWith for torch buffers: the peer's recorded message is reduced in as a tensor."""

    def _allreduce(self, buffer, op):
        import torch

        peer = torch.from_numpy(self._peer(op)).to(buffer.dtype)
        if op == "max":
            torch.maximum(buffer, peer, out=buffer)
        else:
            buffer += peer


def test_the_device_path_on_torch_tensors_raises_before_applying(monkeypatch):
    torch = pytest.importorskip("torch")
    import polyamp._agreement as agreement

    monkeypatch.setattr(agreement, "_on_host", lambda *args: False)
    grads = [torch.full((3,), 2.0)]
    peer = Recorder(peer=True)
    twin = LossScaler(LossScaleConfig(init_scale=8.0), reducer=peer)
    twin.step([g.clone() for g in grads], lambda: None)
    twin.update()
    twin.step([g.clone() for g in grads], lambda: None)
    twin.update()
    config = LossScaleConfig(init_scale=8.0)
    scaler = LossScaler(config, reducer=TorchPairedWith(peer, _peer(config, 1, 1, 8.0, growth=1)))
    applied: list[int] = []
    assert scaler.step([g.clone() for g in grads], lambda: applied.append(0))
    scaler.update()
    scaler.set_scale(2.0)  # this rank alone
    with pytest.raises(RankMismatchError, match="scale 2\\*\\*1 on this rank, scale 2\\*\\*3 on the other"):
        scaler.step([g.clone() for g in grads], lambda: applied.append(1))
    assert applied == [0]


@pytest.mark.parametrize("flag", [float("nan"), -1.0, 0.5])
def test_a_non_zero_recorded_flag_skips_alone_and_across_ranks(path, flag):
    """Non-zero (NaN too) is a bad step, as the local read_flag says: on the host and device paths."""
    def step(scaler: LossScaler, flag: float | None, applied: list[int]) -> bool:
        if flag is not None:
            scaler.record_found_inf(np.float32(flag))
        skipped = scaler.step([np.full(3, 8.0, np.float32)], lambda: applied.append(1)).skipped
        scaler.update()
        return bool(skipped)

    alone: list[int] = []
    assert step(LossScaler(LossScaleConfig(init_scale=4.0)), flag, alone) and alone == []
    peer = Recorder(peer=True)
    assert not step(LossScaler(LossScaleConfig(init_scale=4.0), reducer=peer), None, [])
    applied: list[int] = []
    scaler = LossScaler(LossScaleConfig(init_scale=4.0), reducer=PairedWith(peer))
    assert step(scaler, flag, applied)
    assert applied == [] and scaler.get_scale() == 2.0


@pytest.mark.parametrize("kind", ["bfloat16", "requires_grad"])
def test_extra_values_of_cpu_tensors_without_a_numpy_view_are_agreed(path, kind):
    """A bfloat16 or requires-grad CPU tensor has no NumPy view: its values still travel."""
    torch = pytest.importorskip("torch")
    if path == "device" and kind == "requires_grad":
        pytest.skip("the device path keeps autograd on the message (this test's Recorder reads it as NumPy)")
    extra = torch.tensor([3.0, 4.0], dtype=torch.bfloat16 if kind == "bfloat16" else torch.float32,
                         requires_grad=kind == "requires_grad") * 1
    scaler = LossScaler(LossScaleConfig(init_scale=4.0), reducer=Recorder())
    scaler.unscale_([torch.ones(2)])
    agreed = scaler.agree_(extra=extra)
    assert agreed.extra.dtype == extra.dtype and agreed.extra.tolist() == [3.0, 4.0]
    assert float(agreed.found_inf) == 0.0


# -- every field misaligned alone, on the one-int64 path and the two-value path ------------------
#: field -> the peer's value: the state's three through the state, the agreement's seven host
#: fields altered as it builds them
ALONE = {"config": 12345, "iteration": 1, "collective": 2, "sequence": 5, "payload": 9, "extras": 3,
         "whose": 77, "scale": 512.0, "growth_tracker": 4, "backoff_tracker": 2}
MINE = dict(scale=1024.0, growth_tracker=3, backoff_tracker=1)
#: what the explanation says for each field
NAMED = {"config": "config fingerprint", "payload": "0 values summed on this rank",
         "extras": "extra values agreed", "whose": "the flag of scaler/optimizer",
         "scale": "scale 2**10 on this rank, scale 2**9 on the other",
         "growth_tracker": "growth_tracker 3 on this rank",
         "backoff_tracker": "backoff_tracker 1 on this rank, backoff_tracker 2 on the other"}


def _state(path: str, values: dict):
    from polyamp.policy import HostState

    scale, growth, backoff = values["scale"], values["growth_tracker"], values["backoff_tracker"]
    if path == "host":
        return HostState(scale, growth, backoff)
    return LossScaleState(np.array(scale, np.float32), np.array(growth, np.int32),
                          np.array(backoff, np.int32))


def _agree(agreement, path: str, values: dict, extra: bool, field: str | None = None,
           sent: list[int] | None = None) -> list[int]:
    """One real agreement on a paddle-rule state; ``field``: that host field takes the peer's value.
    The fingerprint sent is put in ``sent`` (and returned)."""
    from polyamp._agreement import Agreement

    sent = [] if sent is None else sent

    def next_fields(*args):
        host = Agreement._next(agreement, *args)
        if field is not None and field in fp.FIELDS[:fp.HOST_FIELDS]:
            host[fp.FIELDS.index(field)] = ALONE[field]
        sent[:] = [*host, scale_bits(values["scale"]), values["growth_tracker"], values["backoff_tracker"]]
        return host

    agreement._next = next_fields
    agreement._length = 2 if extra else 0  # announced already: the two-value message itself must find it
    config = LossScaleConfig(rule="paddle", init_scale=1024.0, backoff_interval=3, growth_interval=10)
    agreed = agreement.flag_and_extra(np.zeros((), np.float32), np.ones(2, np.float32) if extra else None,
                                      config, _state(path, values))
    if path == "device":  # the difference is added to the flag; verify() names it
        assert float(agreed.found_inf) == 1.0
        agreement.verify()
    return sent


@pytest.mark.parametrize("extra", [False, True], ids=["one-int64", "two-value"])
@pytest.mark.parametrize("field", list(ALONE))
def test_each_field_of_the_fingerprint_misaligned_alone_is_found(path, field, extra):
    """Two ranks whose fingerprints differ in ``field`` alone (e.g. the paddle rule's backoff
    tracker: one rank resumed from another checkpoint) are found in the step's own collective, on
    both wire formats and both paths, and the explanation names that field."""
    from polyamp._agreement import Agreement

    assert set(ALONE) == set(fp.FIELDS)
    recorder = Recorder(peer=True)
    peer_values = {**MINE, field: ALONE[field]} if field in MINE else MINE
    peer_print = _agree(Agreement(recorder), "host", peer_values, extra, field)
    red = PairedWith(recorder, explain=fp.Fingerprint(*peer_print))
    sent: list[int] = []
    with pytest.raises(RankMismatchError) as raised:
        _agree(Agreement(red), path, MINE, extra, sent=sent)
    assert [a != b for a, b in zip(sent, peer_print, strict=True)] == [f == field for f in fp.FIELDS]
    text = str(raised.value)
    assert NAMED.get(field, "collectives are not aligned") in text, text


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_a_group_of_one_sends_its_flag_alone(monkeypatch, device):
    """One rank has nobody to differ from: no fingerprint is read or digested, the message is the
    flag (and the extras), and a state that could not be read does not stop the step."""
    import polyamp._agreement as agreement

    if device:  # the device path (GPU arrays), on NumPy arrays
        monkeypatch.setattr(agreement, "_on_host", lambda *args: False)
    monkeypatch.setattr(agreement, "_host_state", lambda state: pytest.fail("the state was read"))
    monkeypatch.setattr(fp.Place, "fields", lambda *args: pytest.fail("a fingerprint was built"))
    plain, extras = Recorder(), Recorder()
    one, two = LossScaler(reducer=plain), LossScaler(reducer=extras)
    for grads in ([np.ones(2, np.float32)], [np.array([np.inf], np.float32)], [np.ones(2, np.float32)]):
        one.step(grads, lambda: None)  # the one-value SUM format
        one.update()
        two.unscale_([g.copy() for g in grads])
        two.agree_(extra=np.array([3.0, 4.0]))  # the two-value MAX format
        two.step([], lambda: None)
        two.update()
    assert [m.tolist() for m in plain.messages] == [[0], [wire.B], [0]]
    # the first: the new length announced in the last one's format (none)
    assert [m.tolist() for m in extras.messages] == [[0], [0, 0, 3, 4], [1, 1, 3, 4], [0, 0, 3, 4]]
