//! The stagnation of a sequential sum in a narrow format, measured by running it.
//!
//! PyTorch's CPU LayerNorm backward adds every row's parameter-gradient term into a buffer of
//! the input's dtype (see [`cpu_narrow_accumulation`](super::price::cpu_narrow_accumulation)):
//! column by column, the running sum S_j is rounded to BF16 or FP16 after each row. The random
//! walk model of the pricing (each rounding an independent error of at most u·|S_j|, their sum
//! growing as √k) fails when the terms are small against the running sum: a term under half a
//! spacing of S_j is lost whole, and terms of one sign drifting the sum are lost the same way
//! row after row — an error that grows with k, not √k (Higham 2002, §4.2: the recursive sum's
//! error is Σ_j δ_j·S_j, and nothing makes the δ_j independent). Measured on a correct BF16
//! step at TP 2 + SP (4,096 tokens, hidden 256): the LayerNorm bias gradient of the one-process
//! run errs from the exact sum by 25 ε, the two runs differ by 26.8 ε, and the √k model gave a
//! threshold of 25.7 ε.
//!
//! Rather than model the drift, the checker runs the sum: the terms of the bias gradient are
//! the rows of the arriving gradient dy, so summing dy's rows in their stored order, rounding
//! after each, gives that sum's own error on the data at hand (bit for bit the reference's sum
//! when the kernel ran on one thread, whose chain is that order). Other thread counts and the
//! candidate's ranks sum sub-chains of the same rows (contiguous blocks, added in FP32), whose
//! partial sums are smaller: the full chain's error stands for each run's (an assumption,
//! measured rather than proven; the weight gradient's terms dy·x̂ are taken to stagnate as
//! dy's do).

use crate::format::{Format, Overflow};

use super::price::ReadRange;

/// ‖s − e‖ / ‖e‖ over the columns of `len` values read as rows of `cols` through `read`:
/// s the columns summed in row order with every partial sum rounded to `format`, e their
/// sums in `f64`. 0 where it cannot say (no full row, a value not finite, a zero sum).
pub(crate) fn chain_error(
    len: usize,
    cols: usize,
    format: Format,
    read: &mut ReadRange<'_>,
) -> f64 {
    if cols == 0 || len < cols || len % cols != 0 {
        return 0.0;
    }
    let (mut s, mut e) = (vec![0.0f64; cols], vec![0.0f64; cols]);
    let mut finite = true;
    for start in (0..len).step_by(cols) {
        let mut j = 0;
        read(start, start + cols, &mut |p| {
            for &x in p {
                finite &= x.is_finite();
                s[j] = format.round(s[j] + x, Overflow::NonSaturating);
                e[j] += x;
                j += 1;
            }
        });
    }
    let exact = e.iter().map(|x| x * x).sum::<f64>();
    let off = s
        .iter()
        .zip(&e)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f64>();
    if !finite || exact <= 0.0 || !exact.is_finite() || !off.is_finite() {
        return 0.0;
    }
    (off / exact).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(values: &[f64], cols: usize, format: Format) -> f64 {
        chain_error(values.len(), cols, format, &mut |s, e, f| f(&values[s..e]))
    }

    /// Oracle worked by hand: BF16 has 8 significant bits, so from 256 on its spacing is 2
    /// and a term of 1 is a tie that goes to the even sum, which stays 256: 256 + 1 + 1 + 1
    /// stays 256 against an exact 259 (error 3/259). A column of 1 + 2⁻⁸ terms from 1 loses
    /// each (1 + 2⁻⁸ is a tie between 1 and 1 + 2⁻⁷ that goes to even 1).
    #[test]
    fn a_stagnating_sum_is_measured() {
        let v = [256.0, 1.0, 1.0, 1.0];
        let got = of(&v, 1, Format::BF16);
        assert!((got - 3.0 / 259.0).abs() < 1e-15, "{got}");
        // Two columns, rows interleaved: the second column's sum is exact (0 error).
        let v = [256.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0];
        let got = of(&v, 2, Format::BF16);
        let want = (9.0f64 / (259.0 * 259.0 + 8.0 * 8.0)).sqrt();
        assert!((got - want).abs() < 1e-15, "{got} against {want}");
        let p = 2f64.powi(-8);
        let got = of(&[1.0, p, p], 1, Format::BF16);
        assert!((got - 2.0 * p / (1.0 + 2.0 * p)).abs() < 1e-15, "{got}");
        // In FP32 none of these round.
        assert_eq!(of(&[256.0, 1.0, 1.0, 1.0], 1, Format::F32), 0.0);
    }

    #[test]
    fn what_it_cannot_say_is_zero() {
        assert_eq!(of(&[1.0, 2.0, 3.0], 2, Format::BF16), 0.0);
        assert_eq!(of(&[1.0, f64::NAN], 1, Format::BF16), 0.0);
        assert_eq!(of(&[1.0, -1.0], 1, Format::BF16), 0.0);
        assert_eq!(of(&[], 1, Format::BF16), 0.0);
    }
}
