//! Reductions whose every rounding is exact, recognized without the walk.
//!
//! When every term is a multiple of g (its lowest set bit, at least the smallest subnormal of
//! every format a rounding goes to) and every sum a rounding site forms stays below g·2^p in
//! magnitude (p the precision of that site's format) and within its finite range, each such
//! sum is a value of its format: no rounding errs. The walk (`walk.rs`) then determines every
//! site as exact — error 0, no variance, no tie — and its result is known from the order's
//! sites alone: the underflow term at each non-empty site and Higham's bound, which the
//! caller adds as the walk's do. This is the common case of short sums of narrow values
//! (BF16 inputs accumulated in FP32: a LayerNorm's mean, a small BF16 matmul), priced here in
//! one pass over the sites instead of the walk's interval arithmetic at each.

use crate::format::Format;
use crate::order::{for_each_rounding, Order};

/// What the walk would have gathered over an all-exact reduction: Σ of half the smallest
/// subnormal of each non-empty site's format (in site order, as the walk adds them) and the
/// number of such sites. `None` unless every site's sum is provably a value of its format.
///
/// `terms` are the values accumulated (products already rounded where the policy rounds
/// them) and `prefix` their running sums as (hi, lo) pairs from 0 (`prefix[i]` the sum of the
/// first i terms, hi + lo within the walk's margin). A site sums one range of terms, or two
/// when a ring wraps: its magnitude is at most R = max prefix − min prefix, or 2R.
pub(super) fn exact_sites(
    terms: &[f64],
    prefix: &[(f64, f64)],
    order: &Order,
    accumulator: Format,
    load_rounds: bool,
) -> Option<(f64, f64)> {
    let g = terms
        .iter()
        .map(|&t| super::lowest_bit(t))
        .fold(f64::INFINITY, f64::min);
    if !g.is_finite() {
        // All zeros: the walk decides (nothing to gain).
        return None;
    }
    let (mut max_hi, mut min_hi, mut max_lo) = (0.0f64, 0.0f64, 0.0f64);
    for &(hi, lo) in prefix {
        max_hi = max_hi.max(hi);
        min_hi = min_hi.min(hi);
        max_lo = max_lo.max(lo.abs());
    }
    // |Pⱼ − Pᵢ| ≤ (max hi − min hi) + 2·max |lo|, the subtraction's rounding covered.
    let range = ((max_hi - min_hi) + 2.0 * max_lo) * (1.0 + 2f64.powi(-50));
    let fits = |f: Format, bound: f64| {
        g >= f.min_subnormal()
            && bound < g * 2f64.powi(f.precision() as i32)
            && bound <= f.max_finite()
    };
    // Every order rounds in its accumulator: decline before visiting the sites.
    if !fits(accumulator, range) {
        return None;
    }
    let (mut ok, mut underflow, mut sites) = (true, 0.0f64, 0.0f64);
    for_each_rounding(order, terms.len(), accumulator, load_rounds, &mut |s| {
        if s.first.is_empty() && s.second.is_empty() {
            return;
        }
        let bound = if s.second.is_empty() {
            range
        } else {
            2.0 * range
        };
        ok &= fits(s.format, bound);
        underflow += s.format.min_subnormal() / 2.0;
        sites += 1.0;
    });
    ok.then_some((underflow, sites))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::order::{Accumulation, Combine, Products};
    use crate::random::SplitMix64;

    /// Wherever every rounding is exact, the shortcut gives the walk's result — guaranteed
    /// bound bit for bit, no mean but the products' own, no variance, no tie — in every order
    /// (split partials in BF16 included), accumulator and product handling; where a rounding
    /// may err it declines and the walk runs. Both happen on these cases.
    #[test]
    fn all_exact_reductions_get_the_walks_result() {
        let orders = [
            Order::Sequential,
            Order::pairwise(8),
            Order::blocked(16),
            Order::block_fma(8),
            Order::split_k(4, Format::F32, Combine::Tree),
            Order::split_k(3, Format::F32, Combine::Sequential),
            Order::split_k(8, Format::BF16, Combine::Ring { start: 1 }),
        ];
        let mut g = SplitMix64::for_name("representable", 1);
        let (mut taken, mut declined) = (0, 0);
        for n in [1usize, 7, 64, 300, 1024] {
            for kind in 0..4 {
                let terms: Vec<f64> = (0..n)
                    .map(|_| match kind {
                        // Small integers: exact in every format here while sums stay small.
                        0 => (g.next_u64() % 9) as f64 - 3.0,
                        // BF16 values of one scale, with zeros.
                        1 if g.next_u64() % 5 == 0 => 0.0,
                        1 => Format::BF16.round(g.normal(), crate::Overflow::Saturating),
                        // BF16 values over 2¹² binades: too fine a grid for the long sums.
                        2 => {
                            let s = 2f64.powi((g.next_u64() % 12) as i32 - 6);
                            Format::BF16.round(g.normal() * s, crate::Overflow::Saturating)
                        }
                        // Exact products of BF16 pairs (a dot product's terms).
                        _ => {
                            let x = Format::BF16.round(g.normal(), crate::Overflow::Saturating);
                            let y = Format::BF16.round(g.normal(), crate::Overflow::Saturating);
                            x * y
                        }
                    })
                    .collect();
                let dot = kind == 3;
                for order in &orders {
                    for (acc_f, products) in [
                        (Format::F32, Products::Exact),
                        (Format::F16, Products::Exact),
                        (Format::F32, Products::Rounded(Format::BF16)),
                    ] {
                        let mut acc = Accumulation::new(Format::BF16, acc_f, order.clone());
                        acc.products = products;
                        let walk = super::super::reduction_error_walk_with(
                            &terms,
                            None,
                            &[],
                            &acc,
                            dot,
                            false,
                        );
                        let fast = super::super::reduction_error_walk_with(
                            &terms,
                            None,
                            &[],
                            &acc,
                            dot,
                            true,
                        );
                        let (Ok(walk), Ok(fast)) = (walk, fast) else {
                            continue;
                        };
                        let what = format!("{order} n={n} kind={kind} {acc_f} {products:?}");
                        assert_eq!(
                            walk.guaranteed.to_bits(),
                            fast.guaranteed.to_bits(),
                            "{what}"
                        );
                        assert_eq!(walk.mean, fast.mean, "{what}");
                        assert_eq!(walk.variance, fast.variance, "{what}");
                        assert_eq!(walk.tie_bound, fast.tie_bound, "{what}");
                        // Whether the shortcut answered (the terms as the walk accumulates
                        // them: rounded products where the policy rounds them).
                        let input: Vec<f64> = match (dot, products) {
                            (true, Products::Rounded(f)) => terms
                                .iter()
                                .map(|&t| f.round(t, crate::Overflow::Saturating))
                                .collect(),
                            _ => terms.clone(),
                        };
                        let mut prefix = vec![(0.0, 0.0)];
                        let (mut hi, mut lo) = (0.0f64, 0.0f64);
                        for &t in &input {
                            let (h, e) = super::super::walk::two_sum(hi, t);
                            (hi, lo) = (h, lo + e);
                            prefix.push((hi, lo));
                        }
                        let f = if dot { Format::F64 } else { Format::BF16 };
                        let lr = !f.is_subset_of(acc_f);
                        match exact_sites(&input, &prefix, order, acc_f, lr) {
                            Some(_) => taken += 1,
                            None => declined += 1,
                        }
                    }
                }
            }
        }
        assert!(
            taken > 100 && declined > 100,
            "{taken} exact, {declined} not"
        );
    }
}
