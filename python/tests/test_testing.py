"""ttrace.testing.assert_close: passes what round-off explains, fails with a message that
names the tensor, the error and threshold in eps, and the worst element."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ttrace.testing import assert_close

from emulate import rows, seq_sum, splitk_sum


def _sums(seed: int = 0):
    x = np.random.default_rng(seed).standard_normal((8, 777)).astype(np.float32)
    return x, rows(x, seq_sum), rows(x, lambda r: splitk_sum(r, 8))


def test_passes_round_off_that_a_fixed_tolerance_would_refuse():
    x, ref, cand = _sums()
    v = assert_close(cand, ref, op="sum", inputs=(x,),
                     candidate="in=f32,acc=f32,out=f32,order=splitk:8:f32:tree")
    assert v.passed and v.rel_error > 0
    # The same pair under a bit-exact expectation (no candidate arithmetic given) fails.
    with pytest.raises(AssertionError):
        assert_close(cand, ref, op="sum", inputs=(x,))


def test_failure_message_names_tensor_error_threshold_and_worst_element():
    x, ref, cand = _sums(1)
    bad = cand.copy()
    bad[5] += np.float32(0.25)
    with pytest.raises(AssertionError) as e:
        assert_close(bad, ref, op="sum", inputs=(x,), name="row sums",
                     candidate="in=f32,acc=f32,out=f32,order=splitk:8:f32:tree")
    msg = str(e.value)
    assert msg.startswith("row sums: the difference is larger than round-off of sum")
    assert "worst element at index (5,)" in msg
    assert "eps" in msg and "threshold" in msg and "splitk:8" in msg


def test_torch_linear_in_bf16_against_a_split_k_emulation():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(16, 256, generator=g).to(torch.bfloat16)
    w = torch.randn(8, 256, generator=g).to(torch.bfloat16)
    # Exact products, then each order in float32, then the BF16 output rounding.
    prods = x.float().numpy()[:, None, :] * w.float().numpy()[None, :, :]
    ref = np.array([[seq_sum(prods[i, j]) for j in range(8)] for i in range(16)], np.float32)
    cand = np.array([[splitk_sum(list(prods[i, j]), 2) for j in range(8)] for i in range(16)],
                    np.float32)
    ref_t, cand_t = torch.from_numpy(ref).to(torch.bfloat16), torch.from_numpy(cand).to(torch.bfloat16)
    assert_close(cand_t, ref_t, op="linear", inputs=(x, w),
                 candidate="in=bf16,acc=f32,out=bf16,order=splitk:2:f32:tree")
    with pytest.raises(AssertionError):
        assert_close(cand_t * 1.05, ref_t, op="linear", inputs=(x, w),
                     candidate="in=bf16,acc=f32,out=bf16,order=splitk:2:f32:tree")


def test_nan_on_one_side_is_reported():
    x, ref, cand = _sums(2)
    cand[2] = np.nan
    with pytest.raises(AssertionError) as e:
        assert_close(cand, ref, op="sum", inputs=(x,),
                     candidate="in=f32,acc=f32,out=f32,order=splitk:8:f32:tree")
    assert "NaN or infinite on one side" in str(e.value)
    assert "index (2,)" in str(e.value)


def test_shape_mismatch_and_unknown_op_are_clear():
    x, ref, cand = _sums(3)
    with pytest.raises(AssertionError, match="shapes differ"):
        assert_close(cand[:4], ref, op="sum", inputs=(x,))
    with pytest.raises(ValueError, match="unknown op 'conv'"):
        assert_close(cand, ref, op="conv", inputs=(x,))


def test_failure_names_the_test_that_fired_and_a_missing_candidate():
    """One corrupted element fires the sparse test beside the norm: the message names every
    test that fired, each with its own statistic; an omitted candidate= says that only a
    bit-identical result passes."""
    x = np.random.default_rng(3).standard_normal((32, 32, 512)).astype(np.float32)
    ref = rows(x, seq_sum)
    cand = rows(x, lambda r: splitk_sum(r, 8))
    cand[5, 7] = np.float32(cand[5, 7] + 256 * np.spacing(np.float32(abs(cand[5, 7]))))
    with pytest.raises(AssertionError) as e:
        assert_close(cand, ref, op="sum", inputs=(x,),
                     candidate="in=f32,acc=f32,out=f32,order=splitk:8:f32:tree")
    msg = str(e.value)
    assert "fired: norm, sparse" in msg and "sparse test: statistic" in msg, msg
    assert "norm ratio" in msg and "worst element at index (5, 7)" in msg
    assert "bit-identical" not in msg
    with pytest.raises(AssertionError) as e:
        assert_close(cand, ref, op="sum", inputs=(x,))
    assert "only a bit-identical result passes" in str(e.value)


def _cross_entropy(z: np.ndarray, t: np.ndarray, total) -> np.float32:
    """The mean cross-entropy in FP32 as the policy describes it (numpy, by hand): each row's
    exp(z − m) summed by ``total``, lse = m + ln S, ℓ = lse − z_t, the ℓ summed by ``total``,
    divided by the row count — every operation rounded to FP32."""
    losses = []
    for row, target in zip(z, t):
        m = row.max()
        e = [np.float32(np.exp(np.float64(np.float32(x - m)))) for x in row]
        lse = np.float32(m + np.float32(np.log(np.float64(total(e)))))
        losses.append(np.float32(lse - row[target]))
    return np.float32(np.float64(total(losses)) / len(losses))


def test_cross_entropy_vocabulary_parallel_against_an_emulation() -> None:
    """A vocabulary-parallel loss (4 shards, FP32 partials) emulated by hand against the
    sequential one: within round-off, with integer targets; the loss of a batch with one
    wrong label is not."""
    rng = np.random.default_rng(11)
    z = (2 * rng.standard_normal((16, 1000))).astype(np.float32)
    t = rng.integers(0, 1000, 16)
    ref = _cross_entropy(z, t, seq_sum)
    cand = _cross_entropy(z, t, lambda v: splitk_sum(v, 4))
    assert cand != ref
    tp = "in=f32,acc=f32,out=f32,order=splitk:4:f32:tree"
    v = assert_close(np.array(cand), np.array(ref), op="cross_entropy",
                     inputs=(z, torch.from_numpy(t)), candidate=tp)
    assert v.passed
    wrong = t.copy()
    wrong[3] = (wrong[3] + 1) % 1000
    bad = _cross_entropy(z, wrong, lambda v: splitk_sum(v, 4))
    with pytest.raises(AssertionError, match="round-off of cross_entropy"):
        assert_close(np.array(bad), np.array(ref), op="cross_entropy", inputs=(z, t),
                     candidate=tp)
