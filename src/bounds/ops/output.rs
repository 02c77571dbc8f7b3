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
    GuaranteedRounding::new(cur, target).round(d, magnitude);
}

/// Which trailing roundings [`round_sides`] performs, decided once for many elements; with
/// [`apply`](Self::apply), what they add to a guaranteed bound alone (ulps at the magnitude
/// plus the bound so far), without the model's statistics.
#[derive(Debug, Clone, Copy)]
pub(crate) enum GuaranteedRounding {
    /// No side rounds.
    None,
    /// Both sides round to one format (nearly equal values): one ulp.
    Both(Format),
    /// One side rounds onto the grid the other's value lies on: half an ulp.
    Snap(Format),
    /// The sides round to different formats, each that rounds independently (the
    /// reference's first): half an ulp each.
    Apart(Option<Format>, Option<Format>),
}

impl GuaranteedRounding {
    /// The roundings of values in formats `cur` rounded to `target`.
    pub(crate) fn new(cur: (Format, Format), target: (Format, Format)) -> GuaranteedRounding {
        let need_r = !cur.0.is_subset_of(target.0);
        let need_c = !cur.1.is_subset_of(target.1);
        match (need_r, need_c) {
            (false, false) => GuaranteedRounding::None,
            _ if target.0 != target.1 => {
                GuaranteedRounding::Apart(need_r.then_some(target.0), need_c.then_some(target.1))
            }
            (true, true) => GuaranteedRounding::Both(target.0),
            _ => GuaranteedRounding::Snap(target.0),
        }
    }

    /// The roundings applied to `d`, a value of about `magnitude` ([`round_sides`], with the
    /// roundings decided once for many elements).
    #[inline]
    pub(crate) fn round(self, d: &mut ElementDiff, magnitude: f64) {
        match self {
            GuaranteedRounding::None => {}
            GuaranteedRounding::Both(f) => d.round_both(f, magnitude),
            GuaranteedRounding::Snap(f) => d.round_snap(f, magnitude),
            GuaranteedRounding::Apart(r, c) => {
                for f in [r, c].into_iter().flatten() {
                    d.round_one(f, magnitude);
                }
            }
        }
    }

    /// The guaranteed bound `guaranteed` after the roundings, at `magnitude`.
    #[inline]
    pub(crate) fn apply(self, guaranteed: f64, magnitude: f64) -> f64 {
        let ulp = |f: Format, g: f64| f.ulp(magnitude.abs() + g).unwrap_or(f64::INFINITY);
        match self {
            GuaranteedRounding::None => guaranteed,
            GuaranteedRounding::Both(f) => guaranteed + ulp(f, guaranteed),
            GuaranteedRounding::Snap(f) => guaranteed + ulp(f, guaranteed) / 2.0,
            GuaranteedRounding::Apart(r, c) => {
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
