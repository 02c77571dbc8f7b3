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

/// The classes of equal words among `keys`: each class's first index and its size, in order of
/// first appearance — what a [`DataMap`] from word to class gives, three to four times faster
/// (the hash map was half of a softmax threshold's per-element bookkeeping): open addressing
/// with linear probing in a table of at least twice as many slots as keys, each word folded
/// and hashed by a multiplication with a random odd seed per call (so that no input can be
/// built to crowd one run of slots).
pub(crate) fn classes_of_words(keys: &[u64]) -> Vec<(usize, usize)> {
    classes_of(keys, |key| key ^ (key >> 32))
}

/// [`classes_of_words`] for pairs of words (equal when both are).
pub(crate) fn classes_of_pairs(keys: &[(u64, u64)]) -> Vec<(usize, usize)> {
    classes_of(keys, fold_pair)
}

/// Each pair's class as an index into [`classes_of_pairs`]'s list (in order of first
/// appearance).
pub(crate) fn class_ids_of_pairs(keys: &[(u64, u64)]) -> Vec<u32> {
    let mut ids = vec![0u32; keys.len()];
    classes_with(keys, fold_pair, |j, class| ids[j] = class);
    ids
}

fn fold_pair((a, b): (u64, u64)) -> u64 {
    a ^ (a >> 32) ^ b.rotate_left(29)
}

/// The classes of equal keys, each folded to one word by `fold` before the seeded hash.
fn classes_of<K: Copy + Eq + Default>(keys: &[K], fold: impl Fn(K) -> u64) -> Vec<(usize, usize)> {
    classes_with(keys, fold, |_, _| {})
}

/// [`classes_of`], telling `each` every key's class index (0-based) as it goes.
fn classes_with<K: Copy + Eq + Default>(
    keys: &[K],
    fold: impl Fn(K) -> u64,
    mut each: impl FnMut(usize, u32),
) -> Vec<(usize, usize)> {
    let bits = (2 * keys.len()).max(2).next_power_of_two().trailing_zeros();
    let mask = (1usize << bits) - 1;
    let seed = Seeded::default().0 | 1;
    // Slot: a key and its class's index + 1 (0: empty).
    let mut slots = vec![(K::default(), 0u32); mask + 1];
    let mut classes: Vec<(usize, usize)> = Vec::new();
    for (j, &key) in keys.iter().enumerate() {
        let folded = fold(key).wrapping_mul(seed);
        let mut at = (folded >> (64 - bits)) as usize;
        loop {
            let (word, class) = slots[at];
            if class == 0 {
                classes.push((j, 1));
                slots[at] = (key, classes.len() as u32);
                each(j, classes.len() as u32 - 1);
                break;
            }
            if word == key {
                classes[class as usize - 1].1 += 1;
                each(j, class - 1);
                break;
            }
            at = (at + 1) & mask;
        }
    }
    classes
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The classes are those of a plain map from word to class, in order of first appearance,
    /// on words with many repeats, with none, and with equal low or high halves.
    #[test]
    fn classes_of_words_are_a_maps_classes() {
        let mut g = crate::engine::SplitMix64::for_name("classes_of_words", 0);
        let cases: Vec<Vec<u64>> = vec![
            vec![],
            vec![7],
            (0..1000).map(|_| g.next_u64() % 37).collect(),
            (0..1000).map(|_| g.next_u64()).collect(),
            (0..1000).map(|i| (i % 13) << 45).collect(),
            (0..1000).map(|i| (i % 300) | (5 << 32)).collect(),
            (0..64).map(|_| 3).collect(),
        ];
        // A plain map's classes, in order of first appearance.
        fn map_classes<K: Copy + Eq + std::hash::Hash>(keys: &[K]) -> Vec<(usize, usize)> {
            let mut expected: Vec<(usize, usize)> = vec![];
            let mut index = std::collections::HashMap::new();
            for (j, &k) in keys.iter().enumerate() {
                let c = *index.entry(k).or_insert_with(|| {
                    expected.push((j, 0));
                    expected.len() - 1
                });
                expected[c].1 += 1;
            }
            expected
        }
        for keys in cases {
            assert_eq!(classes_of_words(&keys), map_classes(&keys));
            // The same words paired with a second word that splits every class of two or more.
            let pairs: Vec<(u64, u64)> = keys
                .iter()
                .enumerate()
                .map(|(j, &k)| (k, j as u64 % 2))
                .collect();
            let expected = map_classes(&pairs);
            assert_eq!(classes_of_pairs(&pairs), expected);
            let ids = class_ids_of_pairs(&pairs);
            for (j, &k) in pairs.iter().enumerate() {
                assert_eq!(pairs[expected[ids[j] as usize].0], k);
            }
        }
    }
}
