//! Tensors: n-dimensional arrays of `f64` that hold exact values of a declared [`Format`].

use ndarray::{ArrayD, IxDyn};

use crate::error::{Error, Result};
use crate::format::{Format, Overflow};

/// An n-dimensional array (row-major, contiguous) whose every element is a value of `format`.
///
/// The invariant is checked when a tensor is built from outside data ([`Tensor::new`],
/// [`Tensor::from_vec`]); operations produce tensors by rounding into their output format.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    data: ArrayD<f64>,
    format: Format,
}

/// The number of elements of `shape`, if it is a shape an array can have: the product of its
/// non-zero dimensions must fit in `isize` (ndarray's limit, which applies even when another
/// dimension is zero). `None` otherwise — file readers turn that into an error instead of
/// building an impossible tensor.
pub fn element_count(shape: &[usize]) -> Option<usize> {
    let nonzero = shape
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))?;
    if nonzero > isize::MAX as usize {
        return None;
    }
    Some(if shape.contains(&0) { 0 } else { nonzero })
}

impl Tensor {
    /// Wrap `data`, checking that every element is a value of `format`
    /// ([`Error::NotRepresentable`] names the first one that is not).
    pub fn new(data: ArrayD<f64>, format: Format) -> Result<Tensor> {
        let data = if data.is_standard_layout() {
            data
        } else {
            data.as_standard_layout().into_owned()
        };
        let flat = data.as_slice().unwrap_or(&[]);
        if let Some(i) = format.first_unrepresentable(flat) {
            return Err(Error::NotRepresentable {
                value: flat[i],
                format,
                what: format!("tensor element {i} (flat index, shape {:?})", data.shape()),
            });
        }
        Ok(Tensor { data, format })
    }

    /// A tensor of the given shape from row-major values, checked as in [`Tensor::new`].
    pub fn from_vec(shape: &[usize], values: Vec<f64>, format: Format) -> Result<Tensor> {
        let expected: usize = shape.iter().product();
        if expected != values.len() {
            return Err(Error::ShapeMismatch {
                what: "Tensor::from_vec".into(),
                expected: shape.to_vec(),
                found: vec![values.len()],
            });
        }
        let data =
            ArrayD::from_shape_vec(IxDyn(shape), values).map_err(|e| Error::ShapeMismatch {
                what: format!("Tensor::from_vec: {e}"),
                expected: shape.to_vec(),
                found: vec![expected],
            })?;
        Tensor::new(data, format)
    }

    /// Round arbitrary `f64` values into `format` (with `overflow`) and wrap them.
    pub fn rounded(
        shape: &[usize],
        mut values: Vec<f64>,
        format: Format,
        overflow: Overflow,
    ) -> Result<Tensor> {
        format.round_slice(&mut values, overflow);
        Tensor::from_vec(shape, values, format)
    }

    /// A tensor of zeros.
    pub fn zeros(shape: &[usize], format: Format) -> Tensor {
        Tensor {
            data: ArrayD::zeros(IxDyn(shape)),
            format,
        }
    }

    /// Internal constructor for values already known to be in `format` and contiguous, with
    /// `shape` holding exactly `values.len()` elements (callers guarantee it; readers validate
    /// shapes with [`element_count`] first). Should the guarantee ever fail, the result is
    /// poisoned rather than plausible: a flat tensor of NaNs, which no comparison accepts
    /// (its shape and values both mismatch), instead of silently wrong data.
    pub(crate) fn from_parts_unchecked(
        shape: &[usize],
        values: Vec<f64>,
        format: Format,
    ) -> Tensor {
        debug_assert_eq!(shape.iter().product::<usize>(), values.len());
        debug_assert!(format.first_unrepresentable(&values).is_none());
        let len = values.len();
        let data = ArrayD::from_shape_vec(IxDyn(shape), values)
            .unwrap_or_else(|_| ArrayD::from_elem(IxDyn(&[len]), f64::NAN));
        Tensor { data, format }
    }

    /// The element format.
    pub fn format(&self) -> Format {
        self.format
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        self.data.shape()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The array.
    pub fn data(&self) -> &ArrayD<f64> {
        &self.data
    }

    /// The elements in row-major order.
    pub fn values(&self) -> &[f64] {
        // Invariant: always standard layout.
        self.data.as_slice().unwrap_or(&[])
    }

    /// Take the array out.
    pub fn into_data(self) -> ArrayD<f64> {
        self.data
    }

    /// Take the elements out, in row-major order (the buffer can be reused, e.g. in the spare
    /// pool of [`merge_reusing`](crate::shard::merge_reusing)).
    pub fn into_values(self) -> Vec<f64> {
        // Invariant: standard layout, so the buffer starts at offset 0 in row-major order.
        let (v, offset) = self.data.into_raw_vec_and_offset();
        debug_assert!(offset.unwrap_or(0) == 0);
        v
    }

    /// Round every element into `format` (a no-op copy when the format already contains
    /// this tensor's format).
    pub fn cast(&self, format: Format, overflow: Overflow) -> Tensor {
        if self.format.is_subset_of(format) {
            return Tensor {
                data: self.data.clone(),
                format,
            };
        }
        let mut values = self.values().to_vec();
        format.round_slice(&mut values, overflow);
        Tensor::from_parts_unchecked(self.shape(), values, format)
    }

    /// Same elements, new shape with the same number of elements.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if shape.iter().product::<usize>() != self.len() {
            return Err(Error::ShapeMismatch {
                what: "reshape".into(),
                expected: shape.to_vec(),
                found: self.shape().to_vec(),
            });
        }
        Ok(Tensor::from_parts_unchecked(
            shape,
            self.values().to_vec(),
            self.format,
        ))
    }

    /// Whether every element is finite.
    pub fn all_finite(&self) -> bool {
        self.values().iter().all(|v| v.is_finite())
    }

    /// Largest absolute value (0 for an empty tensor; NaN if any element is NaN).
    pub fn amax(&self) -> f64 {
        let mut m = 0.0f64;
        for &v in self.values() {
            if v.is_nan() {
                return f64::NAN;
            }
            m = m.max(v.abs());
        }
        m
    }

    /// Check that the tensor has `rank` dimensions and return the shape.
    pub(crate) fn expect_rank(&self, rank: usize, what: &str) -> Result<&[usize]> {
        if self.shape().len() != rank {
            return Err(Error::ShapeMismatch {
                what: format!("{what}: expected a rank-{rank} tensor"),
                expected: vec![rank],
                found: self.shape().to_vec(),
            });
        }
        Ok(self.shape())
    }
}
