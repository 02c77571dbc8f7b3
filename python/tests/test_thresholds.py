"""Thresholds priced from Python hold on results computed independently (NumPy float32
emulation of each order), catch a planted error, and read torch and NumPy arrays exactly."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import ttrace
from ttrace._arrays import as_core, as_float64

from emulate import rows, seq_sum, splitk_sum

REF = "in=f32,acc=f32,out=f32,order=sequential"
CAND = "in=f32,acc=f32,out=f32,order=splitk:4:f32:tree"


def families(rng: np.random.Generator, shape):
    yield "normal", rng.standard_normal(shape)
    yield "nonzero mean", 10.0 + rng.standard_normal(shape)
    yield "uniform positive", rng.uniform(0, 1, shape)
    yield "heavy tail", rng.standard_cauchy(shape).clip(-1e4, 1e4)
    yield "integers", rng.integers(-8, 8, shape).astype(np.float64)


@pytest.mark.parametrize("seed", range(4))
def test_sum_threshold_holds_on_emulated_orders_and_catches_a_dropped_term(seed):
    rng = np.random.default_rng(seed)
    for name, data in families(rng, (16, 509)):
        x = data.astype(np.float32)
        ref = rows(x, seq_sum)
        cand = rows(x, lambda r: splitk_sum(r, 4))
        t = ttrace.sum_threshold(x, reference=REF, candidate=CAND)
        v = t.check(ref, cand)
        assert v.passed, (name, v)
        # A rank that drops one term of one row is caught.
        bad = cand.copy()
        bad[3] = splitk_sum(list(x[3, 1:]), 4)
        if abs(float(x[3, 0])) > 1e-3 * abs(float(ref[3])):
            assert not t.check(ref, bad).passed, name


def test_guaranteed_threshold_is_wider_and_still_holds():
    x = np.random.default_rng(7).standard_normal((8, 1000)).astype(np.float32)
    ref, cand = rows(x, seq_sum), rows(x, lambda r: splitk_sum(r, 4))
    p = ttrace.sum_threshold(x, reference=REF, candidate=CAND)
    g = ttrace.sum_threshold(x, reference=REF, candidate=CAND, guaranteed=True)
    assert g.delta is None and p.delta == 1e-6
    assert g.abs_frobenius >= p.abs_frobenius > 0
    assert g.check(ref, cand).passed


def test_same_arithmetic_means_identical_results():
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    t = ttrace.sum_threshold(x, reference=REF)
    assert t.identical and t.abs_frobenius == 0.0
    ref = rows(x, seq_sum)
    assert t.check(ref, ref).passed
    off = ref.copy()
    off[0] = np.nextafter(off[0], np.float32(np.inf))
    assert not t.check(ref, off).passed


def test_matmul_threshold_from_torch_bf16_inputs():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(8, 96, generator=g).to(torch.bfloat16)
    b = torch.randn(96, 4, generator=g).to(torch.bfloat16)
    t = ttrace.matmul_threshold(
        a, b, reference="in=bf16,acc=f32,out=f32",
        candidate="in=bf16,acc=f32,out=f32,order=splitk:4:f32:tree",
    )
    # Emulate both orders on the exact BF16 values (products are exact in float32).
    af, bf = a.float().numpy(), b.float().numpy()
    prods = af[:, :, None] * bf[None, :, :]  # [m, k, n]
    ref = np.array([[seq_sum(prods[i, :, j]) for j in range(4)] for i in range(8)])
    cand = np.array([[splitk_sum(list(prods[i, :, j]), 4) for j in range(4)] for i in range(8)])
    assert t.check(ref.astype(np.float32), cand.astype(np.float32)).passed
    assert not t.check(ref.astype(np.float32), (cand * np.float32(1.01)).astype(np.float32)).passed


def test_linear_threshold_reads_weights_as_pytorch_stores_them():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 40, generator=g), torch.randn(3, 40, generator=g)
    lin = ttrace.linear_threshold(x, w, reference="in=f32,acc=f32,out=f32",
                                  candidate="in=f32,acc=f32,out=f32,order=splitk:2:f32:tree")
    mm = ttrace.matmul_threshold(x, w.T.contiguous(), reference="in=f32,acc=f32,out=f32",
                                 candidate="in=f32,acc=f32,out=f32,order=splitk:2:f32:tree")
    assert lin.abs_frobenius == mm.abs_frobenius and lin.elements == 18


@pytest.mark.parametrize(
    "dtype,fmt", [(torch.float32, "f32"), (torch.float16, "f16"), (torch.bfloat16, "bf16"),
                  (torch.float8_e4m3fn, "e4m3"), (torch.float8_e5m2, "e5m2")])
def test_torch_tensors_are_read_exactly_and_without_copies(dtype, fmt):
    t = (torch.randn(5, 7, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    arr, got = as_core(t)
    assert got == fmt
    if dtype != torch.float32 and dtype != torch.float16:
        # Bit-pattern views share the tensor's memory.
        assert arr.ctypes.data == t.data_ptr()
    assert np.array_equal(as_float64(t), t.double().numpy())


def test_ml_dtypes_arrays_are_read_exactly():
    x = np.array([1.0, -2.5, 3.140625, 1e-40], dtype=ml_dtypes.bfloat16)
    assert np.array_equal(as_float64(x), x.astype(np.float64))


def test_norm_softmax_elementwise_and_allreduce_thresholds_price_their_ops():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w = np.ones(64, dtype=np.float32)
    p = "in=f32,acc=f32,out=f32"
    n = ttrace.norm_threshold(x, w, np.zeros(64, np.float32), reference=p,
                              candidate=p + ",order=pairwise:1", candidate_variance="welford")
    s = ttrace.softmax_threshold(x, reference=p, candidate_form="online:16")
    e = ttrace.elementwise_threshold("gelu", x, reference="in=f32,acc=f32,out=f32",
                                     candidate="in=f32,acc=f64,out=f32")
    a = ttrace.allreduce_threshold([x, x, x, x], reference=p, candidate=p + ",order=splitk:4:f32:ring")
    for t in (n, s, e, a):
        assert t.relative > 0 and t.elements == 256, t


def test_policy_text_round_trips():
    assert ttrace.parse_policy(" in=bf16 , acc=f32 ,out=bf16 ") == "in=bf16,acc=f32,out=bf16,order=sequential"


@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
                                   ml_dtypes.bfloat16, np.float16, np.float32])
def test_transposed_arrays_are_read_in_their_logical_order(dtype):
    x = (np.arange(12, dtype=np.float64).reshape(3, 4) / 3 - 1.5).astype(dtype)
    t = x.T  # Fortran-ordered: memory order differs from the logical order
    assert not t.flags["C_CONTIGUOUS"]
    assert np.array_equal(as_float64(t), t.astype(np.float64))


def test_the_core_reads_fortran_ordered_bit_patterns_in_logical_order():
    from ttrace import _ttrace

    x = (np.arange(12, dtype=np.float64).reshape(3, 4) / 3 - 1.5).astype(ml_dtypes.float8_e4m3fn)
    bits_t = np.ascontiguousarray(x).view(np.uint8).T
    assert bits_t.flags["F_CONTIGUOUS"] and not bits_t.flags["C_CONTIGUOUS"]
    assert np.array_equal(_ttrace.to_float64(bits_t, "e4m3"), x.T.astype(np.float64))


def test_linear_pricing_fast_holds_and_stays_near_the_walk():
    # BF16 operands, FP32 accumulation, sequential vs split-K over 8: the vectorized pass and
    # the walk both hold for the engine's two executions, and (following exact values and
    # parities as the walk does, with fewer than 4,096 outputs) the pass is near the walk.
    g = torch.Generator().manual_seed(11)
    x = torch.randn(32, 512, generator=g).to(torch.bfloat16)
    w = torch.randn(64, 512, generator=g).to(torch.bfloat16)
    ref, cand = "in=bf16,acc=f32,out=f32", "in=bf16,acc=f32,out=f32,order=splitk:8:f32:tree"
    fast = ttrace.linear_threshold(x, w, reference=ref, candidate=cand, pricing="fast")
    walk = ttrace.linear_threshold(x, w, reference=ref, candidate=cand, pricing="walk")
    assert 0.8 * walk.abs_frobenius <= fast.abs_frobenius <= 1.3 * walk.abs_frobenius
    xd, wd = x.double().numpy(), w.double().numpy()
    prods = xd[:, :, None] * wd.T[None, :, :]  # [m, k, n], exact in f64
    r = prods.astype(np.float32)
    seq = np.zeros((32, 64), dtype=np.float32)
    for p in range(512):
        seq = (seq + r[:, p, :]).astype(np.float32) if p else r[:, 0, :].copy()
    parts = []
    for q in range(8):
        part = r[:, 64 * q, :].copy()
        for p in range(64 * q + 1, 64 * (q + 1)):
            part = (part + r[:, p, :]).astype(np.float32)
        parts.append(part)
    pair = [(parts[i] + parts[i + 1]).astype(np.float32) for i in range(0, 8, 2)]
    tree = ((pair[0] + pair[1]).astype(np.float32) + (pair[2] + pair[3]).astype(np.float32))
    tree = tree.astype(np.float32)
    assert not np.array_equal(seq, tree)
    assert fast.check(seq, tree).passed and walk.check(seq, tree).passed
    with pytest.raises(ValueError, match="pricing"):
        ttrace.linear_threshold(x, w, reference=ref, candidate=cand, pricing="quick")


def test_guaranteed_linear_threshold_is_the_walks_bound_by_two_gemms():
    # The default prices a guaranteed request by two GEMMs of magnitudes: the walk's bound
    # (exact f64 sums of the same formula) within 1e-4 and never below it, with no model
    # behind it (expected_relative NaN), and a NumPy execution of both orders within it.
    g = torch.Generator().manual_seed(12)
    x = torch.randn(24, 384, generator=g).to(torch.bfloat16)
    w = (torch.randn(40, 384, generator=g) + 0.25).to(torch.bfloat16)
    b = torch.randn(40, generator=g).to(torch.bfloat16)
    ref, cand = "in=bf16,acc=f32,out=f32", "in=bf16,acc=f32,out=f32,order=splitk:4:f32:tree"
    gemm = ttrace.linear_threshold(x, w, b, reference=ref, candidate=cand, guaranteed=True)
    walk = ttrace.linear_threshold(x, w, b, reference=ref, candidate=cand, guaranteed=True,
                                   pricing="walk")
    assert gemm.delta is None and walk.delta is None
    for got, want in [(gemm.abs_frobenius, walk.abs_frobenius),
                      (gemm.per_element, walk.per_element)]:
        assert want <= got <= want * (1 + 1e-4)
    assert np.isnan(gemm.expected_relative) and not np.isnan(walk.expected_relative)
    prods = x.double().numpy()[:, :, None] * w.double().numpy().T[None, :, :]
    r = prods.astype(np.float32)
    bias = b.float().numpy()

    def chain(lo: int, hi: int) -> "np.ndarray":
        s = r[:, lo, :].copy()
        for p in range(lo + 1, hi):
            s = (s + r[:, p, :]).astype(np.float32)
        return s

    seq = (chain(0, 384) + bias).astype(np.float32)
    parts = [chain(96 * q, 96 * (q + 1)) for q in range(4)]
    tree = ((parts[0] + parts[1]).astype(np.float32)
            + (parts[2] + parts[3]).astype(np.float32)).astype(np.float32)
    tree = (tree + bias).astype(np.float32)
    assert not np.array_equal(seq, tree)
    assert gemm.check(seq, tree).passed


@pytest.mark.parametrize("mean", [False, True])
def test_sum_pricing_fast_holds_and_stays_near_the_walk(mean):
    # BF16 rows summed in FP32, sequential vs split over 4 (tree): a NumPy execution of both
    # orders is the oracle.
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 1024, generator=g) + 0.5).to(torch.bfloat16)
    ref, cand = "in=bf16,acc=f32,out=f32", "in=bf16,acc=f32,out=f32,order=splitk:4:f32:tree"
    fast = ttrace.sum_threshold(x, reference=ref, candidate=cand, mean=mean, pricing="fast")
    walk = ttrace.sum_threshold(x, reference=ref, candidate=cand, mean=mean, pricing="walk")
    assert 0.8 * walk.abs_frobenius <= fast.abs_frobenius <= 1.5 * walk.abs_frobenius
    xs = x.float().numpy()

    def run(cols: "np.ndarray") -> "np.ndarray":
        s = cols[:, 0].copy()
        for p in range(1, cols.shape[1]):
            s = (s + cols[:, p]).astype(np.float32)
        return s

    seq = run(xs)
    parts = [run(xs[:, 256 * q:256 * (q + 1)]) for q in range(4)]
    tree = ((parts[0] + parts[1]).astype(np.float32)
            + (parts[2] + parts[3]).astype(np.float32)).astype(np.float32)
    if mean:
        seq, tree = (seq / np.float32(1024)), (tree / np.float32(1024))
    assert not np.array_equal(seq, tree)
    assert fast.check(seq, tree).passed and walk.check(seq, tree).passed
    with pytest.raises(ValueError, match="pricing"):
        ttrace.sum_threshold(x, reference=ref, candidate=cand, pricing="quick")


def test_every_op_of_the_registry_prices_through_one_entry_point():
    """``ttrace.threshold`` reaches every op of the library's registry: each gives the
    threshold of its named function (the same model, bit for bit), and the generic entry's
    sum holds on emulated orders and catches a dropped term."""
    names = ttrace.thresholds.ops()
    assert {"matmul", "linear", "allreduce", "layernorm", "scale:C", "exp"} <= set(names)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    y = rng.standard_normal((4, 64)).astype(np.float32)
    w = rng.standard_normal((64, 8)).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    b = (0.1 * rng.standard_normal(64)).astype(np.float32)
    p, c = "in=f32,acc=f32,out=f32", "in=f32,acc=f32,out=f32,order=pairwise:4"
    qkv = tuple(rng.standard_normal((16, 8)).astype(np.float32) for _ in range(3))
    named = {
        "attention": (qkv, None),
        "attention:causal": (qkv, None),
        "matmul": ((x, w), lambda: ttrace.matmul_threshold(x, w, reference=p, candidate=c)),
        "linear": ((x, w.T), lambda: ttrace.linear_threshold(x, w.T, reference=p, candidate=c)),
        "sum": ((x,), lambda: ttrace.sum_threshold(x, reference=p, candidate=c)),
        "mean": ((x,), lambda: ttrace.sum_threshold(x, reference=p, candidate=c, mean=True)),
        "allreduce": ((x, y), lambda: ttrace.allreduce_threshold([x, y], reference=p,
                                                                 candidate=c)),
        "softmax": ((x,), lambda: ttrace.softmax_threshold(x, reference=p, candidate=c)),
        "layernorm": ((x, g, b), lambda: ttrace.norm_threshold(x, g, b, reference=p,
                                                               candidate=c)),
        "rmsnorm": ((x, g), lambda: ttrace.norm_threshold(x, g, op="rmsnorm", reference=p,
                                                          candidate=c)),
        "add": ((x, y), lambda: ttrace.elementwise_threshold("add", x, y, reference=p,
                                                             candidate=c)),
        "scale:C": ((x,), lambda: ttrace.elementwise_threshold("scale:0.3", x, reference=p,
                                                               candidate=c)),
        "cross_entropy": ((x, np.array([3.0, 0.0, 63.0, 17.0])),
                          lambda: ttrace.cross_entropy_threshold(
                              x, np.array([3, 0, 63, 17]), reference=p, candidate=c)),
        "cross_entropy_grad": ((x, np.array([3.0, 0.0, 63.0, 17.0])),
                               lambda: ttrace.cross_entropy_threshold(
                                   x, np.array([3, 0, 63, 17]), reference=p, candidate=c,
                                   gradient=True)),
    }
    for op in names:
        inputs, direct = named.get(op, ((x,), None))
        text = op.replace("scale:C", "scale:0.3")
        t = ttrace.threshold(text, inputs, reference=p, candidate=c)
        assert t.op == text and t.elements > 0 and t.abs_frobenius == t.abs_frobenius, op
        if direct is not None:
            assert t.to_dict()["abs_frobenius"] == direct().to_dict()["abs_frobenius"], op
    # Softmax's form through the side text.
    on = ttrace.threshold("softmax", (x,), reference=p, candidate=p + ",form=online:16")
    assert on.candidate.endswith("form=online:16")
    assert on.abs_frobenius == ttrace.softmax_threshold(
        x, reference=p, candidate_form="online:16").abs_frobenius
    # The sum against NumPy's emulation of both orders.
    s = ttrace.threshold("sum", (x,), reference=REF, candidate=CAND)
    ref, cand = rows(x, seq_sum), rows(x, lambda r: splitk_sum(r, 4))
    assert s.check(ref, cand).passed
    bad = cand.copy()
    bad[1] = splitk_sum(list(x[1, 1:]), 4)
    assert not s.check(ref, bad).passed
    with pytest.raises(ttrace.InvalidInputError, match="unknown op 'conv'"):
        ttrace.threshold("conv", (x,), reference=p)
    with pytest.raises(ttrace.InvalidInputError, match="takes 2 to 3 operands"):
        ttrace.threshold("matmul", (x,), reference=p)


def test_cross_entropy_threshold_prices_the_loss_as_pytorch_reduces_it() -> None:
    """The mean cross-entropy's threshold: integer targets, rows with ``ignore_index`` left
    out of the loss (pricing the kept rows alone gives the same threshold), the
    vocabulary-parallel candidate priced wider than a pairwise one and far below the loss's
    FP32 tolerance, and bad targets refused with their kind."""
    rng = np.random.default_rng(5)
    logits = (2 * rng.standard_normal((12, 4096))).astype(np.float32)
    target = rng.integers(0, 4096, 12)
    p = "in=f32,acc=f32,out=f32"
    vp = p + ",order=splitk:8:f32:tree"
    t = ttrace.cross_entropy_threshold(logits, target, reference=p, candidate=vp)
    assert t.op == "cross_entropy" and t.elements == 1
    loss = float(np.mean(np.log(np.exp(logits.astype(np.float64)).sum(axis=1))
                         - logits[np.arange(12), target]))
    assert 0 < t.abs_frobenius < 1e-5 * loss
    via_torch = ttrace.cross_entropy_threshold(torch.from_numpy(logits),
                                               torch.from_numpy(target), reference=p,
                                               candidate=vp)
    assert via_torch.abs_frobenius == t.abs_frobenius
    pairwise = ttrace.cross_entropy_threshold(logits, target, reference=p,
                                              candidate=p + ",order=pairwise:8")
    assert 0 < pairwise.abs_frobenius
    # The gradient in the logits: a [12, 4096] tensor's threshold, against the gradient
    # torch computes (the reference's norm is its norm).
    g = ttrace.cross_entropy_threshold(logits, target, reference=p, candidate=vp,
                                       gradient=True)
    assert g.op == "cross_entropy_grad" and g.elements == 12 * 4096
    z = torch.from_numpy(logits).double().requires_grad_(True)
    torch.nn.functional.cross_entropy(z, torch.from_numpy(target)).backward()
    assert z.grad is not None
    norm = float(z.grad.norm())
    assert abs(g.to_dict()["reference_norm"] - norm) < 1e-5 * norm
    assert 0 < g.relative < 1e-5
    same = ttrace.cross_entropy_threshold(logits, target, reference=p, candidate=p)
    assert same.abs_frobenius == 0
    ignored = target.copy()
    ignored[[1, 7]] = -100
    kept = np.array([i for i in range(12) if i not in (1, 7)])
    a = ttrace.cross_entropy_threshold(logits, ignored, reference=p, candidate=vp)
    b = ttrace.cross_entropy_threshold(logits[kept], target[kept], reference=p, candidate=vp)
    assert a.abs_frobenius == b.abs_frobenius
    with pytest.raises(ttrace.InvalidInputError) as e:
        ttrace.cross_entropy_threshold(logits, target[:5], reference=p, candidate=vp)
    assert e.value.kind == "LengthMismatch"
    with pytest.raises(ttrace.InvalidInputError) as e:
        ttrace.cross_entropy_threshold(logits, target + 4096, reference=p, candidate=vp)
    assert e.value.kind == "InvalidParameter"
    with pytest.raises(ttrace.InvalidInputError) as e:
        ttrace.cross_entropy_threshold(logits, target.reshape(3, 4), reference=p)
    assert e.value.kind == "ShapeMismatch"
    with pytest.raises(ttrace.InvalidInputError, match="reshape") as e:
        ttrace.cross_entropy_threshold(logits.reshape(3, 4, 4096), target, reference=p)
    assert e.value.kind == "ShapeMismatch"
    with pytest.raises(ttrace.InvalidInputError, match="ignore_index") as e:
        ttrace.cross_entropy_threshold(logits, np.full(12, -100), reference=p)
    assert e.value.kind == "InvalidParameter"
    with pytest.raises(ttrace.InvalidInputError) as e:
        ttrace.cross_entropy_threshold(logits, target.astype(bool), reference=p)
    assert e.value.kind == "InvalidParameter"


def test_attention_threshold_holds_for_numpys_standard_and_online_attention():
    """One head's attention computed by NumPy in float32 twice — the standard form (BLAS
    products, a full-row softmax) and the online form over key blocks of 4 (running max,
    rescaled sums) — differs by no more than the attention op's thresholds for those forms;
    the causal variant masks, and a difference of 1e-3 of the output's norm is beyond them."""
    rng = np.random.default_rng(11)
    n, d = 24, 16
    q, k, v = (rng.standard_normal((n, d)).astype(np.float32) * s for s in (2.0, 2.0, 1.0))
    f32 = np.float32
    scale = f32(1.0 / np.sqrt(d))

    def standard(causal: bool) -> np.ndarray:
        s = (q @ k.T) * scale
        if causal:
            s = np.where(np.tril(np.ones((n, n), bool)), s, f32(-np.inf))
        e = np.exp(s - s.max(1, keepdims=True))
        return ((e / e.sum(1, keepdims=True)) @ v).astype(f32)

    def online(causal: bool, block: int = 4) -> np.ndarray:
        out = np.zeros((n, d), f32)
        for i in range(n):
            m, l, o = f32(-np.inf), f32(0), np.zeros(d, f32)
            for j0 in range(0, (i + 1) if causal else n, block):
                j1 = min(j0 + block, (i + 1) if causal else n)
                s = (k[j0:j1] @ q[i]) * scale
                mb = s.max()
                e = np.exp(s - mb)
                m_new = max(m, mb)
                a, b = np.exp(f32(m - m_new)), np.exp(f32(mb - m_new))
                l = l * a + e.sum() * b
                o = o * a + (e @ v[j0:j1]) * b
                m = m_new
            out[i] = o / l
        return out

    side = "in=f32,acc=f32,out=f32"
    for causal in (False, True):
        op = "attention:causal" if causal else "attention"
        observed = float(np.linalg.norm(standard(causal).astype(np.float64)
                                        - online(causal).astype(np.float64)))
        for guaranteed in (False, True):
            t = ttrace.threshold(op, (q, k, v), reference=side,
                                 candidate=side + ",form=online:4", guaranteed=guaranteed)
            assert 0 < observed <= t.abs_frobenius, (op, guaranteed, observed, t.abs_frobenius)
            # A difference of 1e-3 of the output's norm is beyond both.
            assert t.abs_frobenius < 1e-3 * float(np.linalg.norm(standard(causal)))
    # Causality changes the output: the two ops price different tensors.
    assert np.linalg.norm(standard(True) - standard(False)) > 1.0


def test_a_threshold_judges_only_the_results_it_was_priced_for() -> None:
    """None is no operand (NumPy would read it as a NaN scalar, and a sum of a scalar prices
    nothing); a threshold refuses results of another size, and empty ones, whatever their
    difference — never a vacuous pass."""
    x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    with pytest.raises(ttrace.InvalidInputError, match="None is not an array") as e:
        ttrace.threshold("sum", (None,), reference=REF, candidate=CAND)
    assert e.value.kind == "InvalidParameter"
    with pytest.raises(ttrace.InvalidInputError, match="None is not an array"):
        ttrace.threshold("matmul", (x, None), reference=REF, candidate=CAND)
    t = ttrace.threshold("sum", (x,), reference=REF, candidate=CAND)
    assert t.elements == 4
    sums = rows(x.astype(np.float64), seq_sum)
    assert t.check(sums, sums).passed
    other = np.ones(3, np.float32)
    v = t.check(other, other)
    assert not v.passed and "priced for 4 elements" in (v.problem or "")
    empty = ttrace.threshold("sum", (np.zeros((0, 8), np.float32),), reference=REF,
                             candidate=CAND)
    assert empty.elements == 0
    v = empty.check(np.zeros(0, np.float32), np.zeros(0, np.float32))
    assert not v.passed and "no element" in (v.problem or "")
    with pytest.raises(AssertionError):
        ttrace.testing.assert_close(np.zeros(0, np.float32), np.zeros(0, np.float32), op="sum",
                                    inputs=(np.zeros((0, 8), np.float32),), reference=REF,
                                    candidate=CAND)


def test_norm_pricing_reaches_the_core() -> None:
    """``pricing`` on LayerNorm thresholds: the named function and the generic entry give the
    same threshold for each pricing, the walk's and the fast model's agree within the fast
    model's documented width on Gaussian rows, and an unknown pricing is refused."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((64, 1024)).astype(np.float32)
    g = np.ones(1024, dtype=np.float32)
    b = np.zeros(1024, dtype=np.float32)
    p, c = "in=f32,acc=f32,out=f32", "in=f32,acc=f32,out=f32,order=pairwise:8"
    by = {}
    for pricing in ("walk", "fast", "auto"):
        t = ttrace.norm_threshold(x, g, b, reference=p, candidate=c, pricing=pricing)
        u = ttrace.threshold("layernorm", (x, g, b), reference=p, candidate=c, pricing=pricing)
        assert t.to_dict()["abs_frobenius"] == u.to_dict()["abs_frobenius"], pricing
        by[pricing] = t.abs_frobenius
    # 65,536 elements in rows of 1,024: auto is fast.
    assert by["auto"] == by["fast"]
    assert 0.5 * by["walk"] <= by["fast"] <= 3.0 * by["walk"], by
    with pytest.raises(ttrace.InvalidInputError) as e:
        ttrace.norm_threshold(x, g, b, reference=p, pricing="quick")
    assert e.value.kind == "InvalidParameter"
