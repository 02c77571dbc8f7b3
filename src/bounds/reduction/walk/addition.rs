//! The walk's sites that add to a value it computed before: ŝ + exact terms (a term, a fused
//! block, or none — a conversion to a new format) and ŝ + ŵ, two computed values.

use super::*;

/// The [`Walk::repeats`] key of the roundings whose terms' intervals hold a midpoint
/// ([`Walk::value_plus_exact`]); content keys are hashes, which this value stands apart from
/// for any practical purpose.
const STRADDLE: u64 = 0x5354_5241_4444_4c45;

impl Walk<'_> {
    /// ŝ + t (t exact: a term or a fused block), or ŝ alone rounded to a new format.
    pub(super) fn value_plus_terms(
        &mut self,
        f: Format,
        v: Computed,
        exact: &[f64],
        det_in: Det,
    ) -> Known {
        let mut known = self.value_plus_exact(f, v, exact);
        // The known operands' own errors are part of the result's.
        known.det = known.det + det_in;
        known
    }

    pub(super) fn value_plus_exact(&mut self, f: Format, v: Computed, exact: &[f64]) -> Known {
        let (k, s, _, fa, _, (c, r, spacing_a)) = v;
        // The exact sum t of the exact operands, when it is one f64.
        let t = match exact {
            [] => Some(0.0),
            [t] => Some(*t),
            _ => {
                self.scratch.clear();
                for &t in exact {
                    self.scratch.add(t);
                }
                let t = self.scratch.to_f64();
                self.scratch.add(-t);
                (self.scratch.to_f64() == 0.0).then_some(t)
            }
        };
        let t_exact = t.unwrap_or_else(|| exact.iter().sum());
        let w = self.site_radius;
        let cx = c + t_exact;
        let rx = r + cx.abs() * SLACK + w;
        let (xmin, xmax) = abs_range(cx, rx);
        self.note_overflow(f, xmax);
        let u = f.ulp(xmax).unwrap_or(f64::INFINITY);
        let uniform = f.ulp(xmin) == Some(u) && u.is_finite();
        // The grid of the exact operands: each one's lowest bit (their sum may need more bits
        // than one f64 holds).
        let g_exact = exact
            .iter()
            .map(|&e| lowest_bit(e))
            .fold(f64::INFINITY, f64::min);
        // ŝ is a multiple of its lattice and of its format's spacing at its smallest
        // magnitude; the exact sum ŝ + t of the coarser of the two and of t's grid.
        let sa = spacing_a.max(k.lattice);
        let lx = sa.min(g_exact);
        let lattice = lattice_after(lx, f.ulp(xmin).unwrap_or(0.0), u);
        let undetermined = |w: &mut Self| {
            let g = fa.ulp(s).unwrap_or(0.0).max(sa).min(g_exact);
            // Alike when the same exact operands meet the same grid (the error depends on
            // them and on bits of ŝ), and when the whole computation repeats.
            let group = if exact.is_empty() {
                w.site_content
            } else {
                mix(2, w.exact_content)
            };
            let site = w.random(f, cx, rx, g, group);
            Known {
                det: k.det,
                bound: k.bound + site + w.site_radius,
                parity: None,
                exact: false,
                lattice,
                content: 0,
                range: ANYWHERE,
            }
        };
        let Some(t) = t else {
            return undetermined(self);
        };
        if !uniform || !t.is_finite() {
            return undetermined(self);
        }
        // ŝ lies on the grid U (or on U/2 with its parity known): ŝ = m·U + ρ with ρ known.
        let (rho, parity) = if sa >= u {
            (0.0, parity_on(&k, u))
        } else if sa >= u / 2.0 {
            match parity_on(&k, u / 2.0) {
                Some(odd) => (if odd { u / 2.0 } else { 0.0 }, None),
                None => return undetermined(self),
            }
        } else {
            return undetermined(self);
        };
        // RN_U(m·U + y) = m·U + RN_U(y) for y = ρ + t, away from ties (the grid is uniform).
        let q = t / u + rho / u;
        if q - rho / u != t / u || !q.is_finite() {
            return undetermined(self);
        }
        if w > 0.0 {
            // Terms within w: determined only when every t' within w rounds to the same
            // point, no tie among them.
            let n = q.round_ties_even();
            if !(w / u).is_finite() {
                return undetermined(self);
            }
            if (q - n).abs() + w / u >= 0.5 && w / u >= 0.25 {
                return undetermined(self);
            }
            if (q - n).abs() + w / u >= 0.5 {
                // A midpoint within w < U/4 of t: the error is ±U/2 within 2w, its sign set by
                // where the term's deviation puts it (a wider interval leaves it anywhere
                // within ±U/2: undetermined, above). Nearly equal terms (within 2w of each
                // other) straddle alike, and their deviations share their source (the squares of
                // x − μ̂ all move with μ̂'s error): their roundings may err alike, one coherent
                // group per grid and bucket of term values, each |η| ≤ U/2 (k of them:
                // (kU/2)²). Priced as uniform and independent, a row of nearly equal squares
                // added after an outlier's, each near a midpoint, erred 2.5 of the model's
                // standard deviations beyond it (`examples/adversary.rs`).
                let bucket = (t / (2.0 * w)).floor();
                let key = (u.to_bits(), mix(STRADDLE, bucket.to_bits()));
                let e = self.repeats.entry(key).or_insert((0.0, u * u / 4.0));
                e.0 += 1.0;
                return Known {
                    det: k.det,
                    bound: k.bound + u / 2.0 + w,
                    parity: None,
                    exact: false,
                    lattice,
                    content: 0,
                    range: ANYWHERE,
                };
            }
        }
        let floor = q.floor();
        let (eta, parity_after, tie_unknown) = if q - floor == 0.5 {
            // A tie: ŝ + t = (m + ⌊q⌋ + ½)·U goes to the even neighbour; the result is even.
            match parity {
                Some(odd) => {
                    let down = odd == is_odd(floor); // m + ⌊q⌋ even
                    (
                        if down { -u / 2.0 } else { u / 2.0 },
                        Some((u, false)),
                        false,
                    )
                }
                None => (0.0, Some((u, false)), true),
            }
        } else {
            let n = q.round_ties_even();
            let eta = (n - q) * u;
            (eta, parity.map(|odd| (u, odd ^ is_odd(n))), false)
        };
        if tie_unknown {
            // Its direction is the parity bit of ŝ, a low-order bit the model does not know:
            // ±U/2 with a random sign (variance and sub-Gaussian proxy U²/4).
            self.variance += u * u / 4.0;
            return Known {
                det: k.det,
                bound: k.bound + u / 2.0,
                parity: parity_after,
                exact: false,
                lattice,
                content: 0,
                range: ANYWHERE,
            };
        }
        self.mean += eta;
        self.mean_abs += eta.abs();
        Known {
            det: k.det + Det::of(eta, 0.0),
            bound: k.bound,
            parity: parity_after,
            exact: false,
            lattice,
            content: 0,
            range: ANYWHERE,
        }
    }

    /// ŝ₁ + ŝ₂: exact when both lie on the result's grid; a tie of unknown direction or an
    /// exact sum when both lie on half of it with known parities; otherwise undetermined.
    pub(super) fn value_plus_value(&mut self, f: Format, v: Computed, w: Computed) -> Known {
        let (kv, sv, _, fv, _, (cv, rv, gv)) = v;
        let (kw, sw, _, fw, _, (cw, rw, gw)) = w;
        let (gv, gw) = (gv.max(kv.lattice), gw.max(kw.lattice));
        let cx = cv + cw;
        let rx = rv + rw + cx.abs() * SLACK;
        let (xmin, xmax) = abs_range(cx, rx);
        self.note_overflow(f, xmax);
        let u = f.ulp(xmax).unwrap_or(f64::INFINITY);
        let uniform = f.ulp(xmin) == Some(u) && u.is_finite();
        let det = kv.det + kw.det;
        let bound = kv.bound + kw.bound;
        if kv.content != 0 && kv.content == kw.content && fv == fw && fv.is_subset_of(f) {
            // Two identically computed values (the equal blocks of a constant row): ŝ + ŝ = 2ŝ
            // is exact whatever ŝ's bits are, and both errors are the same one, twice.
            return Known {
                det,
                bound,
                parity: parity_on(&kv, u / 2.0).map(|odd| (u, odd)),
                exact: kv.exact && kw.exact,
                lattice: 2.0 * gv,
                content: 0,
                range: ANYWHERE,
            };
        }
        let lattice = lattice_after(gv.min(gw), f.ulp(xmin).unwrap_or(0.0), u);
        if uniform && gv >= u && gw >= u {
            let parity = match (parity_on(&kv, u), parity_on(&kw, u)) {
                (Some(a), Some(b)) => Some((u, a ^ b)),
                _ => None,
            };
            return Known {
                det,
                bound,
                parity,
                exact: kv.exact && kw.exact,
                lattice,
                content: 0,
                range: ANYWHERE,
            };
        }
        if uniform && gv >= u / 2.0 && gw >= u / 2.0 {
            if let (Some(a), Some(b)) = (parity_on(&kv, u / 2.0), parity_on(&kw, u / 2.0)) {
                if a == b {
                    return Known {
                        det,
                        bound,
                        parity: None,
                        exact: false,
                        // Both odd or both even multiples of U/2: a multiple of U.
                        lattice: lattice.max(u),
                        content: 0,
                        range: ANYWHERE,
                    };
                }
                // A tie decided by a parity bit the model does not know: ±U/2, random sign.
                self.variance += u * u / 4.0;
                return Known {
                    det,
                    bound: bound + u / 2.0,
                    parity: Some((u, false)),
                    exact: false,
                    lattice: lattice.max(u),
                    content: 0,
                    range: ANYWHERE,
                };
            }
        }
        let g = (fv.ulp(sv).unwrap_or(0.0).max(gv)).min(fw.ulp(sw).unwrap_or(0.0).max(gw));
        // The error depends on the smaller operand's bits on the result's grid: additions of
        // identically computed operands (the repeated blocks of a constant row) err alike, and
        // so do operands within a small fraction of that grid of each other (the nearly equal
        // blocks of a near-constant row: their residues differ by less than U/16). Those are
        // grouped by the bin of U/16 their value lies in, when it is known that well.
        let (c_small, r_small, content) = if cv.abs() <= cw.abs() {
            (cv, rv, kv.content)
        } else {
            (cw, rw, kw.content)
        };
        let bin = u / 16.0;
        let key = if r_small < bin && (c_small / bin).abs() < 2f64.powi(62) {
            mix(4, (c_small / bin).round() as i64 as u64)
        } else {
            mix(3, content)
        };
        let site = self.random(f, cx, rx, g, key);
        Known {
            det,
            bound: bound + site,
            parity: None,
            exact: false,
            lattice,
            content: 0,
            range: ANYWHERE,
        }
    }
}
