"""The DLPack boundary against exporters that misbehave (docs/interop.md; issue 39).

Whatever a foreign object's ``__dlpack__`` or ``__dlpack_device__`` does wrong (raise any
exception, return something that is not a ``(device_type, device_id)`` pair, fail as a
property), the call is refused with a ``TypeError`` that names the argument, and nothing is
written.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupaged

NB, H_KV, BS, D = 4, 2, 8, 16


class Exporter:
    """A DLPack exporter of a NumPy array, with one of its two methods replaced."""

    def __init__(self, array, dlpack=None, device=None):
        self.array, self._dlpack, self._device = array, dlpack, device

    def __dlpack__(self, **kwargs):
        if self._dlpack is not None:
            return self._dlpack()
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        if self._device is not None:
            return self._device()
        return self.array.__dlpack_device__()


class FailingProperty:
    """``__dlpack__`` is a property that raises: ``hasattr`` passes that on."""

    @property
    def __dlpack__(self):
        raise ValueError("no export today")

    def __dlpack_device__(self):
        return (1, 0)


def _raise(error):
    def method():
        raise error

    return method


MISBEHAVIOURS = {
    "dlpack-raises-TypeError": dict(dlpack=_raise(TypeError("wrong stream"))),
    "dlpack-raises-KeyError": dict(dlpack=_raise(KeyError("max_version"))),
    "dlpack-raises-Exception": dict(dlpack=_raise(Exception("lost"))),
    "dlpack-raises-BufferError": dict(dlpack=_raise(BufferError("read-only"))),
    "dlpack-returns-junk": dict(dlpack=lambda: 42),
    "device-None": dict(device=lambda: None),
    "device-empty": dict(device=lambda: ()),
    "device-of-strings": dict(device=lambda: ("cpu", "0")),
    "device-raises-KeyError": dict(device=_raise(KeyError("device"))),
    "device-raises-RuntimeError": dict(device=_raise(RuntimeError("unknown device"))),
}
MESSAGES = {
    "dlpack-raises-TypeError": "importable through DLPack .*: TypeError: wrong stream",
    "dlpack-raises-KeyError": "importable through DLPack .*: KeyError: 'max_version'",
    "dlpack-raises-Exception": "importable through DLPack .*: Exception: lost",
    "dlpack-raises-BufferError": "importable through DLPack .*: read-only",
    "dlpack-returns-junk": "importable through DLPack",
    "device-None": r"__dlpack_device__\(\) to return \(device_type, device_id\) ints, got None",
    "device-empty": r"__dlpack_device__\(\) to return \(device_type, device_id\) ints, got \(\)",
    "device-of-strings": r"to return \(device_type, device_id\) ints, got \('cpu', '0'\)",
    "device-raises-KeyError": "importable through DLPack .*: KeyError: 'device'",
    "device-raises-RuntimeError": "importable through DLPack .*: unknown device",
}


def write_args(rng):
    return dict(
        k_cache=rng.standard_normal((NB, H_KV, BS, D)).astype(np.float32),
        v_cache=rng.standard_normal((NB, H_KV, BS, D)).astype(np.float32),
        k=rng.standard_normal((3, H_KV, D)).astype(np.float32),
        v=rng.standard_normal((3, H_KV, D)).astype(np.float32),
        slot_mapping=np.array([0, 9, 17], np.int32),
    )


@pytest.mark.parametrize("how", list(MISBEHAVIOURS))
@pytest.mark.parametrize("name", ["k_cache", "v", "slot_mapping"])
@pytest.mark.parametrize("by_keyword", [False, True], ids=["positional", "keyword"])
def test_a_misbehaving_exporter_is_refused_by_name(rng, how, name, by_keyword):
    args = write_args(rng)
    before = {n: args[n].copy() for n in ("k_cache", "v_cache")}
    args[name] = Exporter(args[name], **MISBEHAVIOURS[how])
    with pytest.raises(TypeError, match=rf"^expected {name}\b.*{MESSAGES[how]}"):
        if by_keyword:
            cupaged.write_kv(**args)
        else:
            cupaged.write_kv(*args.values())
    for n, array in before.items():
        got = args[n].array if isinstance(args[n], Exporter) else args[n]
        np.testing.assert_array_equal(got, array)


@pytest.mark.parametrize("by_keyword", [False, True], ids=["positional", "keyword"])
def test_a_dlpack_property_that_raises_is_refused_by_name(rng, by_keyword):
    args = write_args(rng)
    before = args["k_cache"].copy()
    args["v_cache"] = FailingProperty()
    message = r"^expected v_cache to be .* __dlpack__, got .*FailingProperty whose __dlpack__ ra"
    with pytest.raises(TypeError, match=message):
        if by_keyword:
            cupaged.write_kv(**args)
        else:
            cupaged.write_kv(*args.values())
    np.testing.assert_array_equal(args["k_cache"], before)


@pytest.mark.parametrize("how", ["dlpack-raises-KeyError", "device-None"])
def test_among_pytorch_tensors_too(rng, how):
    """A call of PyTorch CPU tensors takes the lean way, which declines a foreign argument: the
    general way then refuses it by name."""
    torch = pytest.importorskip("torch")
    generator = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q = torch.randn(2, 2 * H_KV, D, generator=generator)
    k_cache = torch.randn(NB, H_KV, BS, D, generator=generator)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = Exporter(np.array([9, 5], np.int32), **MISBEHAVIOURS[how])
    with pytest.raises(TypeError, match=rf"^expected context_lens\b.*{MESSAGES[how]}"):
        cupaged.paged_attention(q, k_cache, k_cache, tables, lens)
    with pytest.raises(TypeError, match=r"^expected block_tables to be .* whose __dlpack__ raised"):
        cupaged.paged_attention(q, k_cache, k_cache, block_tables=FailingProperty(),
                                context_lens=torch.tensor([9, 5], dtype=torch.int32))  # fmt: skip
