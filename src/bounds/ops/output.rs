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
