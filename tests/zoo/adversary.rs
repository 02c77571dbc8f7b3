//! An adversary for the thresholds: a hill climb over the data of one op and pair of correct
//! policies, searching for inputs whose difference comes closest to (or beyond) its threshold.
//! Each step mutates the input — an element copied from another, doubled or halved, moved by a
//! few units in the last place, negated, zeroed, made an outlier — and keeps the change when
//! the closest call grows. The two sides differ by round-off only, so a ratio above 1 is a
//! violation: of the guaranteed bound (a defect whatever the data), of the probabilistic
//! threshold at δ = 10⁻⁶ (data the model does not describe), or of a per-element bound.
//!
//! Used by `examples/adversary.rs` (the search over every cell) and by `tests/data_zoo.rs`
//! (a short search in `cargo test`, which must find no guaranteed violation).

use super::{attention_operands, execute, generate, threshold, Family, Op, Pair, FAMILIES};
use ttrace::bounds::Confidence;
use ttrace::engine::SplitMix64;
use ttrace::{Format, Overflow, Tensor};

/// The closest calls of one input: ‖D‖ over the guaranteed and the probabilistic thresholds,
/// max |D| over the guaranteed and the probabilistic per-element bounds; and whether the
/// probabilistic request fell back to the guaranteed threshold (the engine's executions
/// exceeded the model's threshold at δ_s: a miss of the model that the check caught).
#[derive(Clone, Copy, Default, Debug)]
pub struct Calls {
    pub norm_g: f64,
    pub norm_p: f64,
    pub elem_g: f64,
    pub elem_p: f64,
    pub fallback: bool,
}

impl Calls {
    /// What the climb maximizes: the guaranteed calls (a violation there is a defect on any
    /// data) or the probabilistic ones. A ratio within 10⁻⁶ below 1 is a difference the model
    /// determined exactly (its threshold is that difference): it counts 0, so that the climb
    /// looks elsewhere.
    pub fn score(&self, guaranteed: bool) -> f64 {
        let open = |r: f64| {
            if (1.0 - 1e-6..=1.0).contains(&r) {
                0.0
            } else {
                r
            }
        };
        if guaranteed {
            open(self.norm_g).max(open(self.elem_g))
        } else if self.fallback {
            // The model's own threshold was exceeded: as close as a probabilistic call gets
            // without a violation (the climb keeps such data and looks for more).
            1.0
        } else {
            open(self.norm_p).max(open(self.elem_p))
        }
    }

    /// A guaranteed bound exceeded.
    pub fn guaranteed_violated(&self) -> bool {
        self.norm_g > 1.0 || self.elem_g > 1.0
    }

    /// Any threshold exceeded.
    pub fn violated(&self) -> bool {
        self.guaranteed_violated() || self.norm_p > 1.0 || self.elem_p > 1.0
    }

    /// The larger of each call.
    pub fn max(self, o: Calls) -> Calls {
        Calls {
            norm_g: self.norm_g.max(o.norm_g),
            norm_p: self.norm_p.max(o.norm_p),
            elem_g: self.elem_g.max(o.elem_g),
            elem_p: self.elem_p.max(o.elem_p),
            fallback: self.fallback || o.fallback,
        }
    }
}

fn ratio(d: f64, t: f64) -> f64 {
    if d == 0.0 {
        0.0
    } else if t == 0.0 {
        f64::INFINITY
    } else {
        d / t
    }
}

/// The calls of one input, `None` when a side fails or a threshold refuses (an overflow, a
/// bound that does not exist: refusals are the zoo's business). For a side whose order is a
/// family, the difference is the largest over the pairs of members the sides may run.
pub fn calls(op: Op, pair: &Pair, x: &Tensor, b: &Tensor) -> Option<Calls> {
    let (op_r, op_c) = super::forms(op, pair);
    // Every order a side may run (each member of a family): the thresholds hold for any.
    let runs = |op: Op, p: &ttrace::Policy| -> Option<Vec<Vec<f64>>> {
        let members = p.accumulation.order.members();
        members
            .into_iter()
            .map(|o| execute(op, x, b, &p.clone().with_order(o)).ok())
            .collect()
    };
    let (rs, cs) = (runs(op_r, &pair.reference)?, runs(op_c, &pair.candidate)?);
    if !rs.iter().chain(&cs).flatten().all(|v| v.is_finite()) {
        return None;
    }
    let g = threshold(op_r, op_c, x, b, pair, Confidence::Guaranteed).ok()?;
    let p = threshold(
        op_r,
        op_c,
        x,
        b,
        pair,
        Confidence::Probabilistic { delta: 1e-6 },
    )
    .ok()?;
    let (mut d, mut dmax) = (0.0f64, 0.0f64);
    for r in &rs {
        for c in &cs {
            let sq = r.iter().zip(c).map(|(a, b)| (a - b) * (a - b)).sum::<f64>();
            d = d.max(sq.sqrt());
            dmax = r
                .iter()
                .zip(c)
                .map(|(a, b)| (a - b).abs())
                .fold(dmax, f64::max);
        }
    }
    Some(Calls {
        norm_g: ratio(d, g.abs_frobenius),
        norm_p: ratio(d, p.abs_frobenius),
        elem_g: ratio(dmax, g.per_element),
        elem_p: ratio(dmax, p.per_element),
        fallback: p.confidence == Confidence::Guaranteed,
    })
}

/// One mutation of `v` (values of `f`): a random element changed.
fn mutate(v: &mut [f64], f: Format, g: &mut SplitMix64) {
    let n = v.len();
    let i = (g.next_u64() % n as u64) as usize;
    let j = (g.next_u64() % n as u64) as usize;
    let x = v[i];
    let ulp = f.ulp(x).unwrap_or(0.0);
    let new = match g.next_u64() % 9 {
        0 => v[j],
        1 => x * 2.0,
        2 => x * 0.5,
        3 => x + ulp * ((g.next_u64() % 7) as f64 - 3.0),
        4 => -x,
        5 => 0.0,
        6 => v[j] * 2f64.powi((g.next_u64() % 41) as i32 - 20),
        7 => v[j] + f.ulp(v[j]).unwrap_or(0.0) * ((g.next_u64() % 5) as f64 - 2.0),
        _ => x * (1.0 + 0.01 * g.normal()),
    };
    v[i] = f.round(new, Overflow::Saturating);
}

/// The end of one climb: where it started, the input it reached and its calls.
pub struct Climb {
    pub family: Family,
    pub shape: (usize, usize),
    /// Whether it climbed the guaranteed calls (else the probabilistic ones).
    pub guaranteed: bool,
    pub x: Vec<f64>,
    pub b: Tensor,
    pub calls: Calls,
}

/// The second operand of a climb: B [k, 2] Gaussian for a matmul, a Gaussian [rows, k]
/// otherwise (`add`'s; unused by the rest).
fn operand_b(op: Op, rows: usize, k: usize, s: u64, pair: &Pair) -> Tensor {
    let (input, acc) = (pair.reference.input(), pair.reference.accumulator());
    let (r, c) = if matches!(op, Op::Matmul | Op::MatmulFast) {
        (k, 2)
    } else {
        (rows, k)
    };
    Tensor::from_vec(
        &[r, c],
        generate(Family::Gaussian, r, c, s ^ 1, input, acc),
        input,
    )
    .expect("zoo data")
}

/// `starts` climbs of `steps` steps on (op, pair), each from a family and a small shape
/// drawn from `seed` (for attention, its queries climb: tokens × head dimension); even starts climb the guaranteed calls, odd ones the probabilistic.
pub fn climb(op: Op, pair: &Pair, steps: usize, starts: usize, seed: u64) -> Vec<Climb> {
    let input = pair.reference.input();
    let acc = pair.reference.accumulator();
    let mut g = SplitMix64::for_name(&format!("{} {}", op.name(), pair.name), seed);
    let mut out = vec![];
    for start in 0..starts {
        let family: Family = FAMILIES[(g.next_u64() % FAMILIES.len() as u64) as usize];
        // Attention needs tokens to mix (one token's output is its V row, exactly).
        let shapes = if let Op::Attention(_) = op {
            [(32, 16), (16, 32), (64, 12), (24, 24), (12, 64)]
        } else {
            [(1, 3), (1, 8), (2, 16), (1, 64), (4, 32)]
        };
        let (rows, k) = shapes[(start + g.next_u64() as usize) % 5];
        let s = g.next_u64();
        let (mut xv, b) = if let Op::Attention(_) = op {
            // Q climbs; K and V stay as the zoo draws them.
            let (q, kv) = attention_operands(family, rows, k, s, input, acc).expect("zoo data");
            (q.values().to_vec(), kv)
        } else {
            (
                generate(family, rows, k, s, input, acc),
                operand_b(op, rows, k, s, pair),
            )
        };
        let eval = |v: &[f64]| {
            let x = Tensor::from_vec(&[rows, k], v.to_vec(), input).ok()?;
            calls(op, pair, &x, &b)
        };
        let Some(mut best) = eval(&xv) else {
            continue;
        };
        let target = start % 2 == 0;
        for _ in 0..steps {
            let mut trial = xv.clone();
            for _ in 0..1 + g.next_u64() % 3 {
                mutate(&mut trial, input, &mut g);
            }
            if let Some(c) = eval(&trial) {
                if c.score(target) >= best.score(target) {
                    best = c;
                    xv = trial;
                }
            }
        }
        out.push(Climb {
            family,
            shape: (rows, k),
            guaranteed: target,
            x: xv,
            b,
            calls: best,
        });
    }
    out
}
