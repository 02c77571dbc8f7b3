//! Test oracle: exact dyadic arithmetic on big integers and an independent rounding routine.
//!
//! Nothing here calls the code under test: values are m·2^e with m a `BigInt`, sums and
//! products are exact, and rounding to a format is written from the IEEE 754 / OCP OFP8
//! definitions (precision p, e_min, largest finite value, infinity or not).
#![allow(dead_code)]

use num_bigint::{BigInt, Sign};
use num_traits::{Signed, ToPrimitive, Zero};

/// Parameters of a format, written out independently of `ttrace::Format`.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    pub p: u32,
    pub emin: i32,
    pub max: f64,
    pub has_inf: bool,
}

pub fn spec(name: &str) -> Spec {
    match name {
        "f64" => Spec {
            p: 53,
            emin: -1022,
            max: f64::MAX,
            has_inf: true,
        },
        "f32" => Spec {
            p: 24,
            emin: -126,
            max: f32::MAX as f64,
            has_inf: true,
        },
        "tf32" => Spec {
            p: 11,
            emin: -126,
            max: (2.0 - ldexp(1.0, -10)) * ldexp(1.0, 127),
            has_inf: true,
        },
        "f16" => Spec {
            p: 11,
            emin: -14,
            max: 65504.0,
            has_inf: true,
        },
        "bf16" => Spec {
            p: 8,
            emin: -126,
            max: (2.0 - ldexp(1.0, -7)) * ldexp(1.0, 127),
            has_inf: true,
        },
        "e4m3" => Spec {
            p: 4,
            emin: -6,
            max: 448.0,
            has_inf: false,
        },
        "e5m2" => Spec {
            p: 3,
            emin: -14,
            max: 57344.0,
            has_inf: true,
        },
        _ => panic!("unknown format {name}"),
    }
}

/// x·2^k built from bit patterns (no library rounding involved).
pub fn ldexp(x: f64, k: i32) -> f64 {
    let mut v = x;
    let mut k = k;
    while k > 1000 {
        v *= f64::from_bits(((1000 + 1023) as u64) << 52);
        k -= 1000;
    }
    while k < -1000 {
        v *= f64::from_bits(((-1000 + 1023) as u64) << 52);
        k += 1000;
    }
    v * f64::from_bits(((k + 1023) as u64) << 52)
}

/// An exact dyadic rational m·2^e.
#[derive(Debug, Clone, PartialEq)]
pub struct Dy {
    pub m: BigInt,
    pub e: i32,
}

impl Dy {
    pub fn zero() -> Dy {
        Dy {
            m: BigInt::zero(),
            e: 0,
        }
    }

    /// Exact value of a finite f64.
    pub fn from_f64(x: f64) -> Dy {
        assert!(x.is_finite());
        let bits = x.to_bits();
        let field = ((bits >> 52) & 0x7FF) as i32;
        let frac = bits & ((1u64 << 52) - 1);
        let (m, e) = if field == 0 {
            (frac, -1074)
        } else {
            (frac | (1u64 << 52), field - 1075)
        };
        let m = BigInt::from(m);
        Dy {
            m: if x < 0.0 { -m } else { m },
            e,
        }
    }

    pub fn add(&self, other: &Dy) -> Dy {
        let e = self.e.min(other.e);
        let a = &self.m << (self.e - e) as usize;
        let b = &other.m << (other.e - e) as usize;
        Dy { m: a + b, e }
    }

    pub fn neg(&self) -> Dy {
        Dy {
            m: -&self.m,
            e: self.e,
        }
    }

    pub fn mul(&self, other: &Dy) -> Dy {
        Dy {
            m: &self.m * &other.m,
            e: self.e + other.e,
        }
    }

    pub fn abs(&self) -> Dy {
        Dy {
            m: self.m.abs(),
            e: self.e,
        }
    }

    pub fn is_zero(&self) -> bool {
        self.m.is_zero()
    }

    /// Round to nearest, ties to even, into the format; overflow to inf (or NaN without inf),
    /// or clamp when `saturate`. Zero results are +0 (callers handle signed zeros).
    pub fn round(&self, s: Spec, saturate: bool) -> f64 {
        if self.m.is_zero() {
            return 0.0;
        }
        let neg = self.m.sign() == Sign::Minus;
        let mag = self.m.abs();
        let len = mag.bits() as i32;
        let top = self.e + len - 1; // value in [2^top, 2^(top+1))
        let qe = top.max(s.emin) - s.p as i32 + 1;
        let shift = qe - self.e;
        let q: BigInt = if shift <= 0 {
            mag << (-shift) as usize
        } else {
            let sh = shift as usize;
            let q = &mag >> sh;
            let rem = &mag - (&q << sh);
            let half = BigInt::from(1) << (sh - 1);
            let odd = (&q % 2u32) == BigInt::from(1);
            if rem > half || (rem == half && odd) {
                q + 1
            } else {
                q
            }
        };
        // q has at most p + 1 bits; q·2^qe may exceed f64 range only if it exceeds max too.
        let qf = q.to_f64().unwrap();
        let value = ldexp(qf, qe);
        let v = if value > s.max {
            if saturate {
                s.max
            } else if s.has_inf {
                f64::INFINITY
            } else {
                f64::NAN
            }
        } else {
            value
        };
        if neg {
            -v
        } else {
            v
        }
    }
}

/// Exact sum of f64 values.
pub fn exact(xs: &[f64]) -> Dy {
    xs.iter()
        .fold(Dy::zero(), |acc, &x| acc.add(&Dy::from_f64(x)))
}

/// fl(a + b) in the format: exact sum, one rounding.
pub fn fl_add(a: f64, b: f64, s: Spec) -> f64 {
    Dy::from_f64(a).add(&Dy::from_f64(b)).round(s, false)
}

/// Compare two results: equal values (−0 == +0) or both NaN.
pub fn same(a: f64, b: f64) -> bool {
    a == b || (a.is_nan() && b.is_nan())
}

/// ‖a − b‖_F in `f64` (the observed difference of two executions).
pub fn frob(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f64>()
        .sqrt()
}
