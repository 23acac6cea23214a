"""PyTorch tensors through every public function that takes arrays (issue 26).

Each function gets tensors of fresh random values, and its result, a tensor again, is compared with
the same function on NumPy copies of them (the NumPy path is tested against float64 oracles
elsewhere) and, for attention, with a float64 oracle written here. In-place functions must write
the caller's own memory (same ``data_ptr``). The CUDA variants skip cleanly without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TOLERANCES, torch_devices

import cupaged

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install '.[interop]')")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DEVICES = torch_devices(torch)
NB, H_KV, BS, D, H_Q = 10, 2, 16, 64, 4


def as_numpy(t):
    """A float64 NumPy copy of a tensor (bfloat16 widened exactly)."""
    return t.detach().to("cpu", torch.float64).numpy()


def assert_close(got, expected, dtype):
    tol = TOLERANCES[NAMES[dtype]]
    np.testing.assert_allclose(as_numpy(got), expected, atol=tol["atol"], rtol=tol["rtol"])


def oracle_decode(q, k_cache, v_cache, tables, lens):
    """float64 softmax attention of one query per sequence, K/V gathered through the tables."""
    q, k_cache, v_cache = map(as_numpy, (q, k_cache, v_cache))
    group = q.shape[1] // k_cache.shape[1]
    out = np.zeros(q.shape)
    for i, n in enumerate(lens.tolist()):
        blocks = tables[i, : -(-n // BS)].tolist()
        k = np.concatenate([k_cache[b] for b in blocks], axis=1)[:, :n]  # [H_KV, n, D]
        v = np.concatenate([v_cache[b] for b in blocks], axis=1)[:, :n]
        for h in range(q.shape[1]):
            s = k[h // group] @ q[i, h] * D**-0.5
            w = np.exp(s - s.max())
            out[i, h] = w @ v[h // group] / w.sum()
    return out


@pytest.fixture
def problem(device):
    generator = torch.Generator().manual_seed(1234)

    def make(dtype):
        def randn(*shape):
            return torch.randn(*shape, generator=generator).to(dtype).to(device)

        tables = torch.tensor([[3, 7, 1], [0, 5, 9]], dtype=torch.int32, device=device)
        lens = torch.tensor([37, 20], dtype=torch.int32, device=device)
        return randn(2, H_Q, D), randn(NB, H_KV, BS, D), randn(NB, H_KV, BS, D), tables, lens

    return make


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_write_kv_and_copy_blocks_write_the_callers_tensors(device, dtype, problem):
    _, k_cache, v_cache, _, _ = problem(dtype)
    before = k_cache.clone(), v_cache.clone()
    pointers = k_cache.data_ptr(), v_cache.data_ptr()
    k = torch.randn(3, H_KV, D).to(dtype).to(device)
    v = torch.randn(3, H_KV, D).to(dtype).to(device)
    slots = torch.tensor([5, 16 * 4 + 2, -1], device=device)

    assert cupaged.write_kv(k_cache, v_cache, k, v, slots) is None
    assert (
        cupaged.copy_blocks(
            k_cache, v_cache, torch.tensor([4], device=device), torch.tensor([8], device=device)
        )
        is None
    )

    assert (k_cache.data_ptr(), v_cache.data_ptr()) == pointers
    assert torch.equal(k_cache[0, :, 5], k[0]) and torch.equal(v_cache[4, :, 2], v[1])
    assert torch.equal(k_cache[8], k_cache[4]) and torch.equal(v_cache[8], v_cache[4])
    untouched = torch.ones(NB, BS, dtype=torch.bool)
    untouched[0, 5] = untouched[4, 2] = False
    untouched[8] = False
    for cache, old in zip((k_cache, v_cache), before, strict=True):
        keep = untouched.to(device)[:, None, :].expand(NB, H_KV, BS)
        assert torch.equal(cache[keep], old[keep])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_decode_returns_a_tensor_equal_to_the_oracle(device, dtype, problem):
    q, k_cache, v_cache, tables, lens = problem(dtype)
    expected = oracle_decode(q, k_cache, v_cache, tables.cpu().numpy(), lens.cpu().numpy())

    one_shot = cupaged.paged_attention(q, k_cache, v_cache, tables, lens)
    plan = cupaged.DecodePlan(tables, lens, k_cache, H_Q)
    out = torch.full_like(q, float("nan"))  # poisoned
    planned = plan.run(q, k_cache, v_cache, out=out)
    reference = cupaged.reference_attention(q, k_cache, v_cache, tables, lens)

    for got in (one_shot, planned, reference):
        assert isinstance(got, torch.Tensor) and got.dtype == dtype and got.device == q.device
        assert_close(got, expected, dtype)
    assert planned is out  # the caller's own object back


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_prefill_and_variants_take_tensors(device, dtype, problem):
    q1, k_cache, v_cache, tables, lens = problem(dtype)
    starts = torch.tensor([0, 4, 7], dtype=torch.int32, device=device)
    q = torch.randn(7, H_Q, D).to(dtype).to(device)
    sinks = torch.randn(H_Q, device=device)
    slopes = torch.rand(H_Q, device=device)
    numpy_args = [
        np.from_dlpack(t.cpu().view(torch.int16)) if t.dtype == torch.bfloat16 else t.cpu().numpy()
        for t in (q, k_cache, v_cache, tables, lens, starts)
    ]
    variants = dict(window_left=9, logits_soft_cap=5.0)
    expected = cupaged.reference_prefill(
        *numpy_args, **variants, alibi_slopes=slopes.cpu().numpy(), sinks=sinks.cpu().numpy(),
        out_dtype="float64",
    )  # fmt: skip

    one_shot = cupaged.paged_prefill(
        q, k_cache, v_cache, tables, lens, starts, **variants, alibi_slopes=slopes, sinks=sinks
    )
    plan = cupaged.PrefillPlan(tables, lens, starts, k_cache, H_Q, **variants, alibi_slopes=slopes)
    planned = plan.run(q, k_cache, v_cache, sinks=sinks)
    for got in (one_shot, planned):
        assert isinstance(got, torch.Tensor) and got.dtype == dtype
        assert_close(got, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_csr_round_trip_of_tensors(device):
    tables = torch.tensor([[5, 2, 0], [1, 3, 4]], dtype=torch.int32, device=device)
    lens = torch.tensor([7, 9], dtype=torch.int32, device=device)
    indptr, indices, last = cupaged.to_csr(tables, lens, 4)
    assert all(isinstance(x, torch.Tensor) for x in (indptr, indices, last))
    assert indptr.tolist() == [0, 2, 5] and indices.tolist() == [5, 2, 1, 3, 4]
    back, back_lens = cupaged.from_csr(indptr, indices, last, 4)
    assert torch.equal(back, tables) and torch.equal(back_lens, lens)


def test_a_cache_is_viewed_by_torch_without_a_copy():
    cache = cupaged.PagedCache(8, block_size=4, num_kv_heads=1, head_dim=64, dtype="float32",
                               device="cpu")  # fmt: skip
    view = torch.from_dlpack(cache.k[0])
    sid = cache.add_sequence()
    k = np.random.default_rng(0).standard_normal((1, 3, 1, 64)).astype(np.float32)
    cache.append(sid, k, k)
    block = cache.block_table(sid)[0]
    assert torch.equal(view[block, 0, :3], torch.from_numpy(k[0, :, 0]))
    assert view.data_ptr() == cache.k[0].ctypes.data


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda a: {**a, "block_tables": a["block_tables"].numpy()},
            "a mix of numpy/cupy and torch",
        ),
        (
            lambda a: {**a, "k_cache": a["k_cache"].to(torch.int8)},
            r"expected k_cache of dtype float32 .*got int8 .*k_cache torch\.int8 on cpu",
        ),
        (
            lambda a: {**a, "q": a["q"].to(torch.float64)},
            r"expected an array of float32, float16, bfloat16 .*got dtype float64 .*"
            r"q torch\.float64 on cpu",
        ),
        (
            lambda a: {**a, "k_cache": a["k_cache"].transpose(0, 1).contiguous().transpose(0, 1)},
            "expected k_cache C-contiguous",
        ),
        (  # the lean way declines a tensor off the CPU; the general one names the device
            lambda a: {**a, "q": a["q"].to("meta")},
            r"expected q importable through DLPack .*on meta: ",
        ),
        (  # numpy() refuses it: the general way names DLPack's refusal
            lambda a: {**a, "k_cache": a["k_cache"].to_sparse()},
            r"expected k_cache importable through DLPack .*layout other than torch\.strided",
        ),
    ],
    ids=["mixed-frameworks", "int8-cache", "float64-q", "non-contiguous", "meta", "sparse"],
)
def test_refusals_name_the_frameworks_dtype_and_device(change, message):
    generator = torch.Generator().manual_seed(7)
    args = dict(
        q=torch.randn(2, H_Q, D, generator=generator),
        k_cache=torch.randn(NB, H_KV, BS, D, generator=generator),
        v_cache=torch.randn(NB, H_KV, BS, D, generator=generator),
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        context_lens=torch.tensor([20, 5], dtype=torch.int32),
    )
    with pytest.raises((TypeError, ValueError), match=message):
        cupaged.paged_attention(**change(args))


class ReadOnly:
    """A DLPack exporter of a read-only array, as JAX's arrays are."""

    def __init__(self, array):
        self.array = array
        self.array.flags.writeable = False

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_an_immutable_array_is_an_input_but_not_an_in_place_target():
    rng = np.random.default_rng(3)
    cache = rng.standard_normal((NB, H_KV, BS, D)).astype(np.float32)
    k = rng.standard_normal((1, H_KV, D)).astype(np.float32)
    slots = np.array([0])
    with pytest.raises(ValueError, match="k_cache.*(read-only|writable)"):
        cupaged.write_kv(ReadOnly(cache.copy()), ReadOnly(cache.copy()), ReadOnly(k),
                         ReadOnly(k), ReadOnly(slots))  # fmt: skip


def test_nothing_is_kept_of_a_callers_tensors_after_the_call():
    """The boundary remembers nothing: a tensor the caller drops is freed (an import kept
    between calls would hold the tensor alive through its DLPack export)."""
    import gc
    import weakref

    generator = torch.Generator().manual_seed(11)
    k_cache = torch.randn(NB, H_KV, BS, D, generator=generator)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([20], dtype=torch.int32)
    q = torch.randn(1, H_Q, D, generator=generator)
    out = cupaged.paged_attention(q, k_cache, k_cache, tables, lens)
    dropped = [weakref.ref(x) for x in (q, k_cache, out)]
    del q, k_cache, out
    gc.collect()
    assert all(ref() is None for ref in dropped)


def test_16_bit_results_go_back_as_bfloat16_and_other_exporters_get_numpy():
    generator = torch.Generator().manual_seed(12)
    q = torch.randn(1, H_Q, D, generator=generator)
    k_cache = torch.randn(NB, H_KV, BS, D, generator=generator)
    tables, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    got = cupaged.reference_attention(q, k_cache, k_cache, tables, lens, out_dtype="bfloat16")
    assert got.dtype == torch.bfloat16
    wide = cupaged.reference_attention(q, k_cache, k_cache, tables, lens, out_dtype="float64")
    assert wide.dtype == torch.float64
    plain = [ReadOnly(t.numpy().copy()) for t in (q, k_cache, k_cache, tables, lens)]
    result = cupaged.paged_attention(*plain)
    assert isinstance(result, np.ndarray)
    np.testing.assert_allclose(result, cupaged.paged_attention(q, k_cache, k_cache, tables,
                                                               lens).numpy(), atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=NAMES.get)
@pytest.mark.parametrize("where", ["q", "out"])
def test_a_tensor_that_requires_grad_is_refused_naming_it(dtype, where):
    """bfloat16 too, though it is imported through an int16 view that does not require grad;
    an ``out=`` leaf of autograd is never written."""
    q = torch.randn(1, H_Q, D).to(dtype).requires_grad_(where == "q")
    out = torch.zeros(1, H_Q, D, dtype=dtype, requires_grad=where == "out")
    k_cache = torch.randn(NB, H_KV, BS, D).to(dtype)
    tables, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    with pytest.raises(TypeError, match=rf"expected {where} .*(require gradient|requires grad)"):
        cupaged.paged_attention(q, k_cache, k_cache, tables, lens, out=out)
    assert not out.detach().any(), "expected out= untouched"


@pytest.mark.parametrize("bit", ["negative", "conjugate"])
def test_a_tensor_with_a_lazy_negation_or_conjugation_is_refused(bit):
    """``z.conj().imag`` is a float tensor whose values are the negation of its memory: DLPack
    would hand the kernels the memory, so the result would be silently wrong."""
    z = torch.randn(1, H_Q, D, dtype=torch.cfloat)
    q = z.conj().imag if bit == "negative" else z.conj()
    assert (q.is_neg(), q.is_conj()) == (bit == "negative", bit == "conjugate")
    k_cache = torch.randn(NB, H_KV, BS, D)
    tables, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    with pytest.raises(TypeError, match=rf"expected q with its values in its memory .*{bit} bit"):
        cupaged.paged_attention(q, k_cache, k_cache, tables, lens)
    if bit == "negative":  # resolved as the message says, it attends with the values shown
        got = cupaged.paged_attention(q.resolve_neg(), k_cache, k_cache, tables, lens)
        expected = cupaged.reference_attention(
            -z.imag.numpy(), k_cache.numpy(), k_cache.numpy(), tables.numpy(), lens.numpy()
        )
        np.testing.assert_allclose(got.numpy(), expected, **TOLERANCES["float32"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=NAMES.get)
def test_a_plan_keeps_nothing_of_the_tensors_of_its_runs(dtype):
    """A plan lives for a step and its runs take every layer's tensors: none of them is kept
    alive by the plan once its run returns (bfloat16 arrives through a view of its own)."""
    import gc
    import weakref

    generator = torch.Generator().manual_seed(13)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([20], dtype=torch.int32)
    starts = torch.tensor([0, 2], dtype=torch.int32)
    k_cache = torch.randn(NB, H_KV, BS, D, generator=generator).to(dtype)
    plans = [
        (cupaged.DecodePlan(tables, lens, k_cache, H_Q), 1),
        (cupaged.PrefillPlan(tables, lens, starts, k_cache, H_Q), 2),
    ]
    for plan, rows in plans:
        q = torch.randn(rows, H_Q, D, generator=generator).to(dtype)
        layer = [torch.randn(NB, H_KV, BS, D, generator=generator).to(dtype) for _ in "kv"]
        given = torch.empty_like(q)
        made = plan.run(q, *layer)
        assert plan.run(q, *layer, out=given) is given
        dropped = [weakref.ref(x) for x in (q, *layer, given, made)]
        del q, layer, given, made
        gc.collect()
        assert [ref() is None for ref in dropped] == [True] * 5


def test_a_tensor_re_pointed_between_runs_is_read_where_it_points():
    """Each run imports its tensors afresh: a cache layer moved to other memory in place
    (``set_``) between two runs is read at its new memory, not through an earlier import."""
    generator = torch.Generator().manual_seed(14)
    tables = torch.tensor([[3, 7]], dtype=torch.int32)
    lens = torch.tensor([25], dtype=torch.int32)
    q = torch.randn(1, H_Q, D, generator=generator)
    k_cache, v_cache = (torch.randn(NB, H_KV, BS, D, generator=generator) for _ in "kv")
    plan = cupaged.DecodePlan(tables, lens, k_cache, H_Q)
    first = plan.run(q, k_cache, v_cache)
    other_k, other_v = (torch.randn(NB, H_KV, BS, D, generator=generator) for _ in "kv")
    k_cache.set_(other_k)
    v_cache.set_(other_v)
    second = plan.run(q, k_cache, v_cache)

    expected = oracle_decode(q, other_k, other_v, tables.numpy(), lens.numpy())
    assert_close(second, expected, torch.float32)
    assert not torch.allclose(first, second)


class Tagged(torch.Tensor):
    """A subclass of torch.Tensor defined outside PyTorch (as libraries wrap tensors)."""


def test_a_tensor_subclass_is_a_pytorch_tensor_and_comes_back_as_one():
    generator = torch.Generator().manual_seed(15)
    q = torch.randn(1, H_Q, D, generator=generator).as_subclass(Tagged)
    k_cache = torch.randn(NB, H_KV, BS, D, generator=generator)
    tables, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    got = cupaged.paged_attention(q, k_cache, k_cache, tables, lens)
    assert isinstance(got, torch.Tensor)
    expected = cupaged.paged_attention(q.as_subclass(torch.Tensor), k_cache, k_cache, tables, lens)
    assert torch.equal(got, expected)


def test_the_boundary_keeps_no_class_and_asks_each_object():
    """The boundary asks each argument itself whether it is a foreign array: a class made at run
    time is not kept alive by it, an object whose ``__dlpack__`` is its own (a proxy's
    ``__getattr__``) is imported, and an argument whose type cannot be hashed is no error."""
    import gc
    import weakref

    tables = np.array([[5, 2, 0], [1, 3, 4]], dtype=np.int32)
    lens = np.array([7, 9], dtype=np.int32)
    exporter = type("Exporter", (ReadOnly,), {})
    indptr, indices, _ = cupaged.to_csr(exporter(tables.copy()), exporter(lens.copy()), 4)
    assert indices.tolist() == [5, 2, 1, 3, 4]
    made = weakref.ref(exporter)
    del exporter
    gc.collect()
    assert made() is None, "the boundary kept a class made at run time alive"

    class Proxy:  # forwards every attribute, as wrapt.ObjectProxy does
        def __init__(self, wrapped):
            self._wrapped = wrapped

        def __getattr__(self, name):
            return getattr(self._wrapped, name)

    indptr, indices, _ = cupaged.to_csr(Proxy(tables), Proxy(lens), 4)
    assert indices.tolist() == [5, 2, 1, 3, 4]

    class Meta(type):
        def __eq__(cls, other):  # defines __eq__ alone: the class cannot be hashed
            return cls is other

    unhashable = Meta("Unhashable", (), {})()  # a true value: checked
    indptr, indices, _ = cupaged.to_csr(tables, lens, 4, checked=unhashable)
    assert indices.tolist() == [5, 2, 1, 3, 4]


@pytest.mark.parametrize(
    ("call", "dtype"),
    [
        (lambda t: cupaged.from_float(t, "bfloat16"), torch.float32),
        (cupaged.to_float, torch.float32),
        (cupaged.to_float, torch.bfloat16),
    ],
    ids=["from_float", "to_float", "to_float-bfloat16"],
)
def test_the_dtype_helpers_refuse_a_tensor_naming_the_way_in(call, dtype):
    """``from_float`` and ``to_float`` convert cupaged's own NumPy or CuPy storage (PyTorch
    converts its tensors itself): a tensor gets a ``TypeError`` naming PyTorch's conversion, not
    an ``AttributeError`` from inside; NumPy scalars still convert."""
    expected = r"expected a NumPy or CuPy array, got torch\.Tensor .* for a PyTorch tensor"
    with pytest.raises(TypeError, match=expected):
        call(torch.randn(3).to(dtype))
    assert cupaged.to_float(np.uint16(0x3FC0)) == 1.5  # an element of a bfloat16 cache
    assert cupaged.from_float(np.float32(0.1), "float16") == np.float16(0.1)
