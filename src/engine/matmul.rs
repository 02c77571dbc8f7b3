//! Matrix multiplication and linear layers under a [`Policy`], with FP8 quantization.
//!
//! Definition (what the hand-composed tests check bit for bit): for C = A·B with A of shape
//! [m, k] and B of shape [k, n],
//! 1. each operand is prepared: rounded to its input format, or for FP8 with scaling
//!    quantized as [`quantize`] describes;
//! 2. c_ij = `dot(a_i, b_·j)` under the policy's [`Accumulation`](crate::Accumulation) (order,
//!    accumulator, products), a value of the accumulator format A;
//! 3. per-tensor FP8 scaling: c_ij = fl_A(c_ij · fl32(s_a⁻¹ · s_b⁻¹)) (cuBLASLt's alpha);
//! 4. a linear layer adds its bias: c_ij = fl_A(c_ij + bias_j);
//! 5. the output is fl_O(c_ij) in the output format O.

use crate::engine::lanes32::{narrow_kernel, Narrow};
use crate::error::{Error, Result};
use crate::format::{Format, Overflow};
use crate::order::{dot_unchecked, sum_unchecked, BlockSum, Order, Products};
use crate::policy::arith::Arith;
use crate::policy::{quantize_cow, Policy};
use crate::tensor::Tensor;

fn check_2d(t: &Tensor, what: &str) -> Result<[usize; 2]> {
    let s = t.expect_rank(2, what)?;
    Ok([s[0], s[1]])
}

/// C = A·B for A of shape [m, k] and B of shape [k, n] under `policy` (see the module docs).
///
/// ```
/// use ttrace::engine::matmul;
/// use ttrace::{Policy, Tensor};
/// use ttrace::Format;
/// let a = Tensor::from_vec(&[1, 2], vec![1.0, 2.0], Format::BF16).unwrap();
/// let b = Tensor::from_vec(&[2, 1], vec![3.0, 4.0], Format::BF16).unwrap();
/// let c = matmul(&a, &b, &Policy::new(Format::BF16, Format::F32, Format::BF16)).unwrap();
/// assert_eq!(c.values(), &[11.0]);
/// ```
pub fn matmul(a: &Tensor, b: &Tensor, policy: &Policy) -> Result<Tensor> {
    matmul_scaled(a, b, policy, None, None)
}

/// [`matmul`] with the per-tensor FP8 scales given (delayed scaling) instead of computed from
/// the operands' own amax.
pub fn matmul_scaled(
    a: &Tensor,
    b: &Tensor,
    policy: &Policy,
    scale_a: Option<f64>,
    scale_b: Option<f64>,
) -> Result<Tensor> {
    let c = matmul_acc(a, b, policy, scale_a, scale_b, None)?;
    Ok(c)
}

/// The shared implementation: prepared operands, the reduction, scaling, bias, output rounding.
pub(crate) fn matmul_acc(
    a: &Tensor,
    b: &Tensor,
    policy: &Policy,
    scale_a: Option<f64>,
    scale_b: Option<f64>,
    bias: Option<&[f64]>,
) -> Result<Tensor> {
    policy.validate()?;
    let [m, k] = check_2d(a, "matmul left operand")?;
    let [k2, n] = check_2d(b, "matmul right operand")?;
    if k != k2 {
        return Err(Error::ShapeMismatch {
            what: "matmul: inner dimensions of A [m, k] and B [k, n] differ".into(),
            expected: vec![k, n],
            found: vec![k2, n],
        });
    }
    if let Some(bias) = bias {
        if bias.len() != n {
            return Err(Error::ShapeMismatch {
                what: "linear: bias length must equal the output features".into(),
                expected: vec![n],
                found: vec![bias.len()],
            });
        }
    }
    let ov = policy.accumulation.overflow;
    let qa = quantize_cow(a, [m, k], 1, policy.input(), policy, scale_a);
    let qb = quantize_cow(b, [k, n], 0, policy.rhs(), policy, scale_b);
    let mut acc = policy.accumulation.clone();
    // The reduction's input format must contain both operands' values.
    acc.input = widest(qa.format, qb.format);
    let ar = Arith::new(policy.accumulator(), policy.output, ov);
    let raw = reduce_matrix(&qa.values, &qb.values, m, k, n, &acc);
    let factor = if qa.scale_inv != 1.0 || qb.scale_inv != 1.0 {
        Some(Format::F32.round(qa.scale_inv * qb.scale_inv, Overflow::Saturating))
    } else {
        None
    };
    let mut out = raw;
    if factor.is_none() && bias.is_none() {
        // Only the output rounding: the bulk path (bit-identical to `ar.ro` per element).
        policy.output.round_slice(&mut out, ov);
        return Ok(Tensor::from_parts_unchecked(&[m, n], out, policy.output));
    }
    for (idx, v) in out.iter_mut().enumerate() {
        let mut c = *v;
        if let Some(f) = factor {
            c = ar.mul(c, f);
        }
        if let Some(bias) = bias {
            c = ar.add(c, bias[idx % n]);
        }
        *v = ar.ro(c);
    }
    Ok(Tensor::from_parts_unchecked(&[m, n], out, policy.output))
}

/// The smallest of the formats in `Format::ALL` that contains both.
fn widest(a: Format, b: Format) -> Format {
    if b.is_subset_of(a) {
        a
    } else if a.is_subset_of(b) {
        b
    } else {
        Format::ALL
            .iter()
            .rev()
            .copied()
            .find(|f| a.is_subset_of(*f) && b.is_subset_of(*f))
            .unwrap_or(Format::F64)
    }
}

/// c_ij = dot(a_i, b_·j) under `acc` for row-major a [m, k] and b [k, n]; values of the
/// accumulator format. Uses a native `f32` kernel where that is bit-identical.
pub(crate) fn reduce_matrix(
    a: &[f64],
    b: &[f64],
    m: usize,
    k: usize,
    n: usize,
    acc: &crate::Accumulation,
) -> Vec<f64> {
    if let Some(c) = native_f32_kernel(a, b, m, k, n, acc) {
        return c;
    }
    if let Some(c) = lanes_kernel(a, b, m, k, n, acc) {
        return c;
    }
    let mut bt = vec![0.0; k * n];
    for kk in 0..k {
        for j in 0..n {
            bt[j * k + kk] = b[kk * n + j];
        }
    }
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        let row = &a[i * k..(i + 1) * k];
        for j in 0..n {
            c[i * n + j] = dot_unchecked(row, &bt[j * k..(j + 1) * k], acc);
        }
    }
    c
}

/// Accumulator-format constants of [`lanes_kernel`].
#[derive(Clone, Copy)]
struct AccConsts {
    shift: u32,
    keep: u64,
    half: u64,
    min_normal: u64,
    max_bits: u64,
}

const SIGN: u64 = 1 << 63;

/// Round-to-nearest-even of an f64 magnitude pattern to the accumulator's precision, with a
/// midpoint broken toward the sign of `err` when `err` ≠ 0 (the exact value is `sum + err`);
/// returns the rounded pattern and whether the case is one this path may take (zero or normal
/// input, no overflow).
#[inline(always)]
fn round_lane(sum: f64, err: f64, c: &AccConsts) -> (f64, bool) {
    // Magnitudes are below 2^63, so signed 64-bit compares (which AVX2 has) are exact.
    let bits = sum.to_bits();
    let mag = (bits & !SIGN) as i64;
    let rem = mag & !(c.keep as i64);
    let trunc = mag & c.keep as i64;
    let half = c.half as i64;
    let tie = rem == half;
    let odd = (trunc >> c.shift) & 1;
    let toward_err = i64::from((err > 0.0) == (sum > 0.0));
    let rne = i64::from(rem > half) | (i64::from(tie) & odd);
    let use_err = tie & (err != 0.0);
    let up = if use_err { toward_err } else { rne };
    let r = trunc + (up << c.shift);
    let ok = ((mag >= c.min_normal as i64) | (mag == 0)) & (r <= c.max_bits as i64);
    (f64::from_bits((bits & SIGN) | r as u64), ok)
}

/// A column-vectorized path for the generic accumulators (every addition rounded to BF16,
/// FP16, TF32, FP8 or FP32 accumulators) with exact products and sequential order: 8 output
/// columns are accumulated side by side, each step s ← fl(s + a·b) computed as the f64 sum,
/// its exact error by TwoSum (Knuth, TAOCP vol. 2, §4.2.2) and one rounding whose midpoint is
/// broken by the error's sign — the arithmetic of [`Format::add_rounded`], on bit patterns. A
/// block of 8 outputs that meets a subnormal, an overflow or a non-finite value is recomputed
/// by the element-wise path. BF16, TF32 and FP16 accumulators with inputs of at most 12 bits
/// first take the f32-lane kernel of [`crate::engine::lanes32`] (twice the lanes, and
/// cheaper steps). Bit-identical to the element-wise path (property test
/// `lanes_kernel_is_the_generic_path`, and directed midpoint tests).
fn lanes_kernel(
    a: &[f64],
    b: &[f64],
    m: usize,
    k: usize,
    n: usize,
    acc: &crate::Accumulation,
) -> Option<Vec<f64>> {
    let f = acc.accumulator;
    if acc.order != Order::Sequential
        || acc.products != Products::Exact
        || !acc.input.is_subset_of(Format::F32)
        || f.precision() > 24
        || k == 0
    {
        return None;
    }
    let shift = 53 - f.precision();
    let c = AccConsts {
        shift,
        keep: !((1u64 << shift) - 1),
        half: 1u64 << (shift - 1),
        min_normal: ((f.emin() + 1023) as u64) << 52,
        max_bits: f.max_finite().to_bits(),
    };
    let mut out = vec![0.0; m * n];
    let n8 = n / 8 * 8;
    // The f32-lane kernel first where it applies; its blocks with a non-finite value (overflow,
    // or a non-finite input) go through the exact-error path.
    let narrow = match f {
        Format::BF16 => Some(Narrow::Bf16),
        Format::TF32 => Some(Narrow::Tf32),
        Format::F16 => Some(Narrow::F16),
        _ => None,
    };
    let pre = narrow.is_some_and(|nw| {
        acc.input.precision() <= 12
            && products_in_f32_range(a)
            && products_in_f32_range(b)
            && narrow_kernel(a, b, m, k, n, nw, &mut out)
    });
    let mut redo = vec![];
    for i in 0..m {
        let row = &a[i * k..(i + 1) * k];
        for j in (0..n8).step_by(8) {
            if pre && out[i * n + j..i * n + j + 8].iter().all(|v| v.is_finite()) {
                continue;
            }
            let (vals, ok) = lanes_tile_dispatch(row, b, n, j, &c);
            if ok {
                out[i * n + j..i * n + j + 8].copy_from_slice(&vals);
            } else {
                redo.extend((j..j + 8).map(|jj| (i, jj)));
            }
        }
        redo.extend((n8..n).map(|jj| (i, jj)));
    }
    if !redo.is_empty() {
        let mut col = vec![0.0; k];
        for (i, j) in redo {
            for (kk, v) in col.iter_mut().enumerate() {
                *v = b[kk * n + j];
            }
            out[i * n + j] = dot_unchecked(&a[i * k..(i + 1) * k], &col, acc);
        }
    }
    Some(out)
}

fn lanes_tile_dispatch(
    row: &[f64],
    b: &[f64],
    n: usize,
    j: usize,
    c: &AccConsts,
) -> ([f64; 8], bool) {
    crate::arch::dispatch!(
        // SAFETY: `dispatch!` runs this only on a CPU with AVX2.
        Avx2 => unsafe { lanes_tile_avx2(row, b, n, j, c) },
        lanes_tile(row, b, n, j, c),
    )
}

/// [`lanes_tile`] with AVX2 intrinsics, two registers of 4 lanes: the same IEEE operations
/// (mul, add, sub on f64) and the same integer logic as [`round_lane`], lane by lane.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn lanes_tile_avx2(row: &[f64], b: &[f64], n: usize, j: usize, c: &AccConsts) -> ([f64; 8], bool) {
    use std::arch::x86_64::*;
    let abs_mask = _mm256_set1_epi64x(!SIGN as i64);
    let sign_mask = _mm256_set1_epi64x(SIGN as i64);
    let low = _mm256_set1_epi64x(!c.keep as i64);
    let half = _mm256_set1_epi64x(c.half as i64);
    let ulp = _mm256_set1_epi64x((1u64 << c.shift) as i64);
    let one = _mm256_set1_epi64x(1);
    let min_normal = _mm256_set1_epi64x(c.min_normal as i64);
    let max_bits = _mm256_set1_epi64x(c.max_bits as i64);
    let zero_i = _mm256_setzero_si256();
    let zero = _mm256_setzero_pd();
    let count = _mm_set_epi64x(0, i64::from(c.shift));
    let mut bad = _mm256_setzero_si256();
    // One rounding step on 4 lanes (see `round_lane`).
    let mut round = |sum: __m256d, err: __m256d| -> __m256d {
        let bits = _mm256_castpd_si256(sum);
        let mag = _mm256_and_si256(bits, abs_mask);
        let sign = _mm256_and_si256(bits, sign_mask);
        let rem = _mm256_and_si256(mag, low);
        let trunc = _mm256_andnot_si256(low, mag);
        let tie = _mm256_cmpeq_epi64(rem, half);
        let gt = _mm256_cmpgt_epi64(rem, half);
        let odd = _mm256_cmpeq_epi64(_mm256_and_si256(_mm256_srl_epi64(trunc, count), one), one);
        let rne = _mm256_or_si256(gt, _mm256_and_si256(tie, odd));
        let err_nz = _mm256_castpd_si256(_mm256_cmp_pd::<_CMP_NEQ_UQ>(err, zero));
        let e_pos = _mm256_castpd_si256(_mm256_cmp_pd::<_CMP_GT_OQ>(err, zero));
        let s_pos = _mm256_castpd_si256(_mm256_cmp_pd::<_CMP_GT_OQ>(sum, zero));
        let toward = _mm256_cmpeq_epi64(e_pos, s_pos);
        let use_err = _mm256_and_si256(tie, err_nz);
        let up = _mm256_blendv_epi8(rne, toward, use_err);
        let r = _mm256_add_epi64(trunc, _mm256_and_si256(up, ulp));
        let below = _mm256_cmpgt_epi64(min_normal, mag);
        let nonzero = _mm256_andnot_si256(_mm256_cmpeq_epi64(mag, zero_i), _mm256_set1_epi64x(-1));
        let over = _mm256_cmpgt_epi64(r, max_bits);
        bad = _mm256_or_si256(bad, _mm256_or_si256(_mm256_and_si256(below, nonzero), over));
        _mm256_castsi256_pd(_mm256_or_si256(sign, r))
    };
    let load = |k: usize| {
        let base = k * n + j;
        let v = &b[base..base + 8];
        // SAFETY: `v` has 8 elements; unaligned loads.
        unsafe {
            (
                _mm256_loadu_pd(v.as_ptr()),
                _mm256_loadu_pd(v.as_ptr().add(4)),
            )
        }
    };
    let (b0, b1) = load(0);
    let a0 = _mm256_set1_pd(row[0]);
    let mut s0 = round(_mm256_mul_pd(a0, b0), zero);
    let mut s1 = round(_mm256_mul_pd(a0, b1), zero);
    for (kk, &av) in row.iter().enumerate().skip(1) {
        let (b0, b1) = load(kk);
        let a = _mm256_set1_pd(av);
        for (s, bv) in [(&mut s0, b0), (&mut s1, b1)] {
            let p = _mm256_mul_pd(a, bv);
            let sum = _mm256_add_pd(*s, p);
            let bb = _mm256_sub_pd(sum, *s);
            let err = _mm256_add_pd(
                _mm256_sub_pd(*s, _mm256_sub_pd(sum, bb)),
                _mm256_sub_pd(p, bb),
            );
            *s = round(sum, err);
        }
    }
    let mut out = [0.0f64; 8];
    // SAFETY: `out` has 8 elements; unaligned stores.
    unsafe {
        _mm256_storeu_pd(out.as_mut_ptr(), s0);
        _mm256_storeu_pd(out.as_mut_ptr().add(4), s1);
    }
    (out, _mm256_testz_si256(bad, bad) == 1)
}

/// One row of A against 8 columns of B: the sequential reduction in 8 lanes.
#[inline(always)]
fn lanes_tile(row: &[f64], b: &[f64], n: usize, j: usize, c: &AccConsts) -> ([f64; 8], bool) {
    let mut s = [0.0f64; 8];
    let mut ok = true;
    let b0 = &b[j..j + 8];
    for l in 0..8 {
        let (r, good) = round_lane(row[0] * b0[l], 0.0, c);
        s[l] = r;
        ok &= good;
    }
    for (kk, &av) in row.iter().enumerate().skip(1) {
        let bk = &b[kk * n + j..kk * n + j + 8];
        for l in 0..8 {
            let p = av * bk[l];
            let sum = s[l] + p;
            let bb = sum - s[l];
            let err = (s[l] - (sum - bb)) + (p - bb);
            let (r, good) = round_lane(sum, err, c);
            s[l] = r;
            ok &= good;
        }
    }
    (s, ok)
}

/// Whether every non-zero |x| lies in [2^-62, 2^62], so that products of two such values
/// neither underflow nor overflow `f32`.
fn products_in_f32_range(xs: &[f64]) -> bool {
    const LO: f64 = 1.0 / (1u64 << 62) as f64;
    const HI: f64 = (1u64 << 62) as f64;
    xs.iter().fold(true, |ok, &x| {
        let a = x.abs();
        ok & ((a == 0.0) | (LO..=HI).contains(&a))
    })
}

/// A cache-friendly native `f32` kernel (loop order i, k, j, vectorizable over j) for the cases
/// where it is bit-identical to the emulation: FP32 accumulator, non-saturating overflow,
/// sequential or blocked-sequential order, and products that `f32` multiplication computes
/// exactly as specified — rounded to F32, or exact because both inputs have at most 12
/// significant bits and lie in range (then the `f32` product is exact and s + p is a correctly
/// rounded FMA). Returns `None` otherwise.
fn native_f32_kernel(
    a: &[f64],
    b: &[f64],
    m: usize,
    k: usize,
    n: usize,
    acc: &crate::Accumulation,
) -> Option<Vec<f64>> {
    if acc.accumulator != Format::F32
        || acc.overflow != Overflow::NonSaturating
        || !acc.input.is_subset_of(Format::F32)
    {
        return None;
    }
    let products_ok = match acc.products {
        Products::Rounded(Format::F32) => true,
        Products::Exact => {
            acc.input.precision() <= 12 && products_in_f32_range(a) && products_in_f32_range(b)
        }
        Products::Rounded(_) => false,
    };
    if !products_ok {
        return None;
    }
    let block = match acc.order {
        Order::Sequential => k.max(1),
        Order::Blocked {
            block,
            inner: BlockSum::Sequential,
        } => block,
        _ => return None,
    };
    let mut c = vec![0.0f64; m * n];
    // Exact products (both inputs ≤ 12 significant bits, in range): s + a·b rounds once either
    // way, so a fused multiply-add gives the same bits and half the instructions. Large
    // products run on the rayon pool; every element is computed by the same instructions
    // whichever thread runs it, so the result does not depend on the number of threads.
    let exact_products = matches!(acc.products, Products::Exact);
    let shape = crate::engine::gemm::GemmShape { m, k, n, block };
    crate::engine::gemm::gemm_f32(a, b, &mut c, shape, exact_products);
    Some(c)
}

/// y = x·Wᵀ + b for x of shape [tokens, in], W of shape [out, in] (PyTorch's `nn.Linear`
/// layout) and an optional bias of length out.
pub fn linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    policy: &Policy,
) -> Result<Tensor> {
    linear_scaled(x, weight, bias, policy, None, None)
}

/// [`linear`] with given per-tensor FP8 scales for x and W (delayed scaling).
pub fn linear_scaled(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    policy: &Policy,
    scale_x: Option<f64>,
    scale_w: Option<f64>,
) -> Result<Tensor> {
    let wt = transpose(weight, "linear weight")?;
    let bias_vals = bias.map(|b| {
        let ar = Arith::new(
            policy.accumulator(),
            policy.output,
            policy.accumulation.overflow,
        );
        b.values().iter().map(|&v| ar.ra(v)).collect::<Vec<f64>>()
    });
    matmul_acc(x, &wt, policy, scale_x, scale_w, bias_vals.as_deref())
}

/// Gradients of [`linear`]: (dx, dW, db) from dy of shape [tokens, out].
///
/// * dx = dy·W under `dgrad` (reduction over the out features);
/// * dW = dyᵀ·x under `wgrad` (reduction over tokens);
/// * db_j = Σ_tokens dy_tj under `wgrad`'s accumulation, rounded to its output format.
pub fn linear_backward(
    x: &Tensor,
    weight: &Tensor,
    has_bias: bool,
    dy: &Tensor,
    dgrad: &Policy,
    wgrad: &Policy,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let dx = matmul(dy, weight, dgrad)?;
    let dyt = transpose(dy, "linear output gradient")?;
    let dw = matmul(&dyt, x, wgrad)?;
    let db = if has_bias {
        Some(column_sums(dy, wgrad)?)
    } else {
        None
    };
    Ok((dx, dw, db))
}

/// Σ over rows of a [rows, cols] tensor, each column reduced under `policy`'s accumulation and
/// rounded to its output format.
pub fn column_sums(t: &Tensor, policy: &Policy) -> Result<Tensor> {
    policy.validate()?;
    let [rows, cols] = check_2d(t, "column sums")?;
    let mut acc = policy.accumulation.clone();
    acc.input = t.format();
    let ar = Arith::new(policy.accumulator(), policy.output, acc.overflow);
    let v = t.values();
    let mut out = Vec::with_capacity(cols);
    let mut col = vec![0.0; rows];
    for j in 0..cols {
        for i in 0..rows {
            col[i] = v[i * cols + j];
        }
        out.push(ar.ro(sum_unchecked(&col, &acc)));
    }
    Ok(Tensor::from_parts_unchecked(&[cols], out, policy.output))
}

/// The transpose of a 2-D tensor (exact).
pub fn transpose(t: &Tensor, what: &str) -> Result<Tensor> {
    let [r, c] = check_2d(t, what)?;
    let v = t.values();
    let mut out = vec![0.0; r * c];
    for i in 0..r {
        for j in 0..c {
            out[j * r + i] = v[i * c + j];
        }
    }
    Ok(Tensor::from_parts_unchecked(&[c, r], out, t.format()))
}
