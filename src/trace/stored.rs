//! A tensor as a file stores it: its format, its shape and its elements' little-endian bit
//! patterns. The checker keeps tensors in this form from the file to the comparison — shards
//! are merged pattern by pattern and decoded to `f64` a block at a time — so an FP8 tensor
//! takes one byte per element in memory, not the eight of its decoded values.

#[cfg(test)]
use crate::error::Error;
use crate::error::Result;
use crate::format::codec::encode_values;
use crate::format::codec::{decode_values_into, element_size};
use crate::format::Format;
use crate::tensor::{element_count, Tensor};

/// A tensor as stored: format, shape and the elements' little-endian bit patterns
/// ([`element_size`] bytes each). Every pattern of the format's width is a value of it, so
/// decoding cannot fail.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Stored {
    shape: Vec<usize>,
    format: Format,
    bytes: Vec<u8>,
}

impl Stored {
    /// Wrap `bytes`, which must hold exactly the shape's elements.
    #[cfg(test)]
    pub(crate) fn new(shape: &[usize], format: Format, bytes: Vec<u8>) -> Result<Stored> {
        let need = element_count(shape).and_then(|n| n.checked_mul(element_size(format)));
        if need != Some(bytes.len()) {
            return Err(Error::InvalidParameter {
                name: "bytes",
                reason: format!(
                    "{} bytes do not hold a {format} tensor of shape {shape:?}",
                    bytes.len()
                ),
            });
        }
        Ok(Stored::from_parts_unchecked(shape, format, bytes))
    }

    /// Wrap `bytes` known to hold the shape's elements (a merge's output, a validated read).
    pub(crate) fn from_parts_unchecked(shape: &[usize], format: Format, bytes: Vec<u8>) -> Stored {
        debug_assert_eq!(
            element_count(shape).map(|n| n * element_size(format)),
            Some(bytes.len())
        );
        Stored {
            shape: shape.to_vec(),
            format,
            bytes,
        }
    }

    /// The patterns of a tensor's values.
    #[cfg(test)]
    pub(crate) fn encode(t: &Tensor) -> Result<Stored> {
        Ok(Stored::from_parts_unchecked(
            t.shape(),
            t.format(),
            encode_values(t.values(), t.format(), "tensor")?,
        ))
    }

    /// The shape.
    pub(crate) fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The stored format.
    pub(crate) fn format(&self) -> Format {
        self.format
    }

    /// The number of elements.
    pub(crate) fn len(&self) -> usize {
        self.bytes.len() / self.width()
    }

    /// Bytes per element.
    pub(crate) fn width(&self) -> usize {
        element_size(self.format)
    }

    /// The patterns.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The buffer, for reuse.
    pub(crate) fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    /// A hash of the patterns, shape and format (64 bits; equal tensors hash alike, different
    /// ones almost never do — it tells which traced tensors hold the same content).
    pub(crate) fn content_hash(&self) -> u64 {
        const K: u64 = 0x9E37_79B9_7F4A_7C15;
        // Four independent lanes over 32-byte blocks: the multiplications overlap.
        let mut lanes = [1u64, 2, 3, 4];
        let mix = |h: u64, w: u64| (h ^ w).wrapping_mul(K).rotate_left(29);
        let blocks = self.bytes.chunks_exact(32);
        let tail = blocks.remainder();
        for b in blocks {
            for (l, h) in lanes.iter_mut().enumerate() {
                let w = u64::from_le_bytes(b[8 * l..8 * l + 8].try_into().unwrap_or([0; 8]));
                *h = mix(*h, w);
            }
        }
        let mut h = lanes
            .iter()
            .fold(self.bytes.len() as u64, |h, &l| mix(h, l));
        for c in tail.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            h = mix(h, u64::from_le_bytes(w));
        }
        for &d in &self.shape {
            h = mix(h, d as u64);
        }
        mix(
            h,
            self.format.bit_width() as u64 ^ (self.format.precision() as u64) << 8,
        )
    }

    /// The values of elements `start..end` into `out` (cleared first; its capacity is reused).
    pub(crate) fn decode_range(&self, start: usize, end: usize, out: &mut Vec<f64>) {
        let w = self.width();
        // Whole patterns of the format's width: decoding cannot fail (an error would need a
        // pattern wider than the format); NaN stands in all the same.
        if decode_values_into(&self.bytes[start * w..end * w], self.format, out).is_err() {
            out.clear();
            out.resize(end - start, f64::NAN);
        }
    }

    /// Element `i`'s value.
    pub(crate) fn value(&self, i: usize) -> f64 {
        let mut one = Vec::with_capacity(1);
        self.decode_range(i, i + 1, &mut one);
        one[0]
    }

    /// The decoded tensor.
    pub(crate) fn decode(&self) -> Tensor {
        let mut values = Vec::new();
        self.decode_range(0, self.len(), &mut values);
        // Decoded patterns are values of the format by construction.
        Tensor::from_parts_unchecked(&self.shape, values, self.format)
    }
}

/// `t` divided by `d`, rounded to nearest in its own format (exact for a power of two `d`
/// outside the format's subnormal range).
pub(crate) fn divided(t: &Stored, d: f64) -> Result<Stored> {
    let f = t.format();
    let mut values = Vec::new();
    t.decode_range(0, t.len(), &mut values);
    for v in &mut values {
        *v = f.round(*v / d, crate::format::Overflow::NonSaturating);
    }
    Ok(Stored::from_parts_unchecked(
        t.shape(),
        f,
        encode_values(&values, f, "tensor divided by its loss normalization")?,
    ))
}

/// A stored tensor's values decoded a window at a time, for visits of nearby ranges (the
/// rows of a norm input, each visited twice): memory for one window of values.
pub(crate) struct Window<'a> {
    t: &'a Stored,
    start: usize,
    values: Vec<f64>,
}

impl<'a> Window<'a> {
    /// A window over `t` (nothing decoded yet).
    pub(crate) fn new(t: &'a Stored) -> Window<'a> {
        Window {
            t,
            start: 0,
            values: Vec::new(),
        }
    }

    /// Hand `f` the values `start..end` (within the tensor), in order, in pieces of at most
    /// [`WINDOW`] values.
    pub(crate) fn visit(&mut self, start: usize, end: usize, f: &mut dyn FnMut(&[f64])) {
        let mut at = start;
        while at < end {
            let held = self.start..self.start + self.values.len();
            if !held.contains(&at) {
                let to = (at + WINDOW).min(self.t.len());
                self.t.decode_range(at, to, &mut self.values);
                self.start = at;
            }
            let upto = end.min(self.start + self.values.len());
            f(&self.values[at - self.start..upto - self.start]);
            at = upto;
        }
    }
}

/// Values per [`Window`].
pub(crate) const WINDOW: usize = 1 << 14;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_fp8_pattern() {
        for f in [Format::E4M3, Format::E5M2] {
            let bytes: Vec<u8> = (0..=255).collect();
            let s = Stored::new(&[16, 16], f, bytes.clone()).unwrap();
            let t = s.decode();
            for (i, &b) in bytes.iter().enumerate() {
                let v = f.decode(u64::from(b)).unwrap();
                assert_eq!(t.values()[i].to_bits(), v.to_bits(), "{f} pattern {b:#x}");
                assert_eq!(s.value(i).to_bits(), v.to_bits());
            }
            assert_eq!(Stored::encode(&t).unwrap(), s);
        }
    }

    #[test]
    fn refuses_a_length_that_does_not_fit() {
        assert!(matches!(
            Stored::new(&[3], Format::BF16, vec![0; 5]),
            Err(Error::InvalidParameter { name: "bytes", .. })
        ));
        assert!(matches!(
            Stored::new(&[usize::MAX, 4], Format::E4M3, vec![]),
            Err(Error::InvalidParameter { .. })
        ));
    }

    /// Rows read through a window (rows shorter than it, straddling it, longer than it) give
    /// the norm gain of the decoded values bit for bit.
    #[test]
    fn windowed_rows_give_the_norm_gain_of_the_values() {
        use crate::check::price::{measured_norm_gain, norm_gain_by};
        let mut g = crate::random::SplitMix64::for_name("window", 1);
        for (row, rows) in [
            (2, 5000),
            (3, 9000),
            (1000, 40),
            (WINDOW + 7, 3),
            (3 * WINDOW, 2),
        ] {
            let n = row * rows;
            let bytes = (0..2 * n).map(|_| g.next_u64() as u8 & 0x3f).collect();
            let s = Stored::new(&[rows, row], Format::BF16, bytes).unwrap();
            let mut window = Window::new(&s);
            let by_window = norm_gain_by(n, row, &mut |a, b, f| window.visit(a, b, f));
            let whole = measured_norm_gain(s.decode().values(), row);
            assert_eq!(by_window.to_bits(), whole.to_bits(), "row {row}");
            assert!(whole > 1.0);
        }
    }
}
