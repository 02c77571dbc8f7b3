//! Hash maps of the thresholds' bookkeeping, keyed by data (bit patterns of values, digests of
//! rows, as alike elements and rows are grouped) or by indices (the fast pass's live values):
//! std's SipHash was the larger part of such a map's cost, so they hash with a multiplicative
//! fold instead, seeded per map from std's `RandomState` (random per process) so that no input
//! can be built to crowd one bucket.

use std::hash::{BuildHasher, Hasher};

/// A `HashMap` with [`Seeded`] hashing.
pub(crate) type DataMap<K, V> = std::collections::HashMap<K, V, Seeded>;

/// A random seed per map (see the module docs).
#[derive(Clone)]
pub(crate) struct Seeded(u64);

impl Default for Seeded {
    fn default() -> Seeded {
        Seeded(std::collections::hash_map::RandomState::new().hash_one(0x7474_7261_6365u64))
    }
}

impl BuildHasher for Seeded {
    type Hasher = Fold;
    fn build_hasher(&self) -> Fold {
        Fold(self.0)
    }
}

/// Each word folded in by a rotation, an xor and a multiplication; SplitMix64's finalizer at
/// the end.
pub(crate) struct Fold(u64);

impl Hasher for Fold {
    fn finish(&self) -> u64 {
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }
    fn write_u64(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(26) ^ word).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn write_usize(&mut self, word: usize) {
        self.write_u64(word as u64);
    }
}
