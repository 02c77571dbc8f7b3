//! Consistent tensor generation: every parameter and input is generated as a full logical
//! tensor from a seed derived from its canonical name, so any implementation (the reference,
//! or a sharded one that slices the logical tensor per rank) regenerates identical values.
//!
//! The generator is deliberately simple and fully specified, so it can be reproduced exactly
//! elsewhere (for example in Python): seed = SplitMix64(FNV-1a-64(name) XOR global_seed); the
//! stream is SplitMix64 (Steele, Lea & Flood 2014); a uniform is the top 53 bits of an output
//! times 2^-53; a "normal" value is the Irwin–Hall sum of 12 uniforms minus 6 (mean 0,
//! variance 1, support [−6, 6]), which uses only IEEE additions and is therefore bit-exact on
//! every platform.
//!
//! Published as [`ttrace::engine`](crate::engine)'s generators; it sits on the bottom floor
//! because the checker's sampled comparisons use the same stream.

/// FNV-1a, 64-bit.
pub fn fnv1a64(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The SplitMix64 generator.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator for the tensor called `name` under `global_seed`.
    pub fn for_name(name: &str, global_seed: u64) -> SplitMix64 {
        let mut g = SplitMix64 {
            state: fnv1a64(name) ^ global_seed,
        };
        let s = g.next_u64();
        SplitMix64 { state: s }
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform value in [0, 1) with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// An approximately standard normal value (Irwin–Hall, 12 uniforms minus 6).
    pub fn normal(&mut self) -> f64 {
        let mut s = 0.0;
        for _ in 0..12 {
            s += self.uniform();
        }
        s - 6.0
    }

    /// A uniform integer in [0, bound) (bound ≥ 1), by multiply-shift.
    pub fn below(&mut self, bound: usize) -> usize {
        ((self.next_u64() as u128 * bound as u128) >> 64) as usize
    }
}

/// `n` values mean + std·normal for the tensor `name`.
pub fn normal_values(name: &str, n: usize, mean: f64, std: f64, global_seed: u64) -> Vec<f64> {
    let mut g = SplitMix64::for_name(name, global_seed);
    (0..n).map(|_| mean + std * g.normal()).collect()
}

/// `n` integers uniform in [0, bound) for the tensor `name`.
pub fn uniform_ints(name: &str, n: usize, bound: usize, global_seed: u64) -> Vec<usize> {
    let mut g = SplitMix64::for_name(name, global_seed);
    (0..n).map(|_| g.below(bound.max(1))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_reference_values() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a64(""), 0xcbf29ce484222325);
        assert_eq!(fnv1a64("a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a64("foobar"), 0x85944171f73967e8);
    }

    #[test]
    fn splitmix_reference_values() {
        // SplitMix64 seeded with 0: the first output of the reference implementation.
        let mut g = SplitMix64 { state: 0 };
        assert_eq!(g.next_u64(), 0xe220a8397b1dcdaf);
    }

    #[test]
    fn normal_has_unit_variance() {
        let v = normal_values("x", 200_000, 0.0, 1.0, 7);
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.01, "{mean}");
        assert!((var - 1.0).abs() < 0.01, "{var}");
    }

    #[test]
    fn names_give_different_streams() {
        assert_ne!(
            normal_values("a.weight", 4, 0.0, 1.0, 1),
            normal_values("b.weight", 4, 0.0, 1.0, 1)
        );
        assert_eq!(
            normal_values("a.weight", 4, 0.0, 1.0, 1),
            normal_values("a.weight", 4, 0.0, 1.0, 1)
        );
        let ids = uniform_ints("tokens", 1000, 7, 3);
        assert!(ids.iter().all(|&i| i < 7));
    }
}
