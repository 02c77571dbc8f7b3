//! The trailing roundings of an output element, shared by every op's threshold and by the
//! fast pass: each side's value rounded to its output format, and the refusal of a rounding
//! that may overflow.

use crate::bounds::compare::ElementDiff;
use crate::error::Result;
use crate::format::Format;

/// Round each side's value, currently in format `cur.*`, to `target.*` (see `ElementDiff`):
/// both sides rounding to the same format is the "nearly equal values" case; one side
/// rounding onto the grid the other side's value already lies on is the "snap" case;
/// roundings to different formats are independent errors.
pub(crate) fn round_sides(
    d: &mut ElementDiff,
    cur: (Format, Format),
    target: (Format, Format),
    magnitude: f64,
) {
    let need_r = !cur.0.is_subset_of(target.0);
    let need_c = !cur.1.is_subset_of(target.1);
    if target.0 == target.1 {
        match (need_r, need_c) {
            (true, true) => d.round_both(target.0, magnitude),
            (true, false) | (false, true) => d.round_snap(target.0, magnitude),
            (false, false) => {}
        }
    } else {
        if need_r {
            d.round_one(target.0, magnitude);
        }
        if need_c {
            d.round_one(target.1, magnitude);
        }
    }
}

/// [`round_sides`] for a difference of which only the guaranteed bound is wanted, planned once
/// for many elements: what the same roundings add to the guaranteed bound (ulps at the
/// magnitude plus the bound so far), without the model's statistics.
#[derive(Debug, Clone, Copy)]
pub(crate) enum GuaranteedRounding {
    /// No side rounds.
    None,
    /// Each side that rounds adds half an ulp of its format, the reference's first.
    Halves(Option<Format>, Option<Format>),
    /// Both sides round to one format: one ulp.
    Both(Format),
}

impl GuaranteedRounding {
    /// The plan for values in formats `cur` rounded to `target`, as [`round_sides`] rounds
    /// them.
    pub(crate) fn new(cur: (Format, Format), target: (Format, Format)) -> GuaranteedRounding {
        let need_r = !cur.0.is_subset_of(target.0);
        let need_c = !cur.1.is_subset_of(target.1);
        match (need_r, need_c) {
            (false, false) => GuaranteedRounding::None,
            (true, true) if target.0 == target.1 => GuaranteedRounding::Both(target.0),
            _ if target.0 == target.1 => GuaranteedRounding::Halves(Some(target.0), None),
            _ => GuaranteedRounding::Halves(need_r.then_some(target.0), need_c.then_some(target.1)),
        }
    }

    /// The guaranteed bound `guaranteed` after the roundings, at `magnitude`.
    #[inline]
    pub(crate) fn apply(self, guaranteed: f64, magnitude: f64) -> f64 {
        let ulp = |f: Format, g: f64| f.ulp(magnitude.abs() + g).unwrap_or(f64::INFINITY);
        match self {
            GuaranteedRounding::None => guaranteed,
            GuaranteedRounding::Both(f) => guaranteed + ulp(f, guaranteed),
            GuaranteedRounding::Halves(r, c) => {
                let mut g = guaranteed;
                for f in [r, c].into_iter().flatten() {
                    g += ulp(f, g) / 2.0;
                }
                g
            }
        }
    }
}

/// Refuse an output rounding that may overflow either side's output format: the value `v`
/// (exact) within the difference's guaranteed bound may reach the format's overflow threshold.
pub(crate) fn check_output(d: &ElementDiff, v: f64, outputs: (Format, Format)) -> Result<()> {
    let magnitude = v.abs() + d.guaranteed;
    for f in [outputs.0, outputs.1] {
        let limit = crate::bounds::reduction::overflow_threshold(f);
        if magnitude >= limit {
            return Err(crate::bounds::reduction::overflow_error(
                f,
                magnitude,
                "an output element",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::SplitMix64;

    /// The guaranteed-only roundings add what the full ones add to the guaranteed bound, for
    /// every pair of current and target formats, whatever the rest of the difference.
    #[test]
    fn guaranteed_roundings_match_the_full_ones() {
        let formats = [
            Format::F64,
            Format::F32,
            Format::BF16,
            Format::F16,
            Format::E4M3,
        ];
        let mut g = SplitMix64::for_name("output", 1);
        for &c0 in &formats {
            for &c1 in &formats {
                for &t0 in &formats {
                    for &t1 in &formats {
                        for _ in 0..8 {
                            let magnitude = (g.normal() * 8.0).exp2() * g.uniform();
                            let mut d = ElementDiff {
                                offset: g.normal() * 1e-3,
                                bias_bound: g.uniform() * 1e-4,
                                guaranteed: g.uniform() * (g.normal() * 6.0).exp2(),
                                proxy: g.uniform() * 1e-6,
                                ..ElementDiff::default()
                            };
                            let before = d.guaranteed;
                            round_sides(&mut d, (c0, c1), (t0, t1), magnitude);
                            let got = GuaranteedRounding::new((c0, c1), (t0, t1))
                                .apply(before, magnitude);
                            assert_eq!(
                                got.to_bits(),
                                d.guaranteed.to_bits(),
                                "{c0:?} {c1:?} → {t0:?} {t1:?} at {magnitude:e}"
                            );
                        }
                    }
                }
            }
        }
    }
}
