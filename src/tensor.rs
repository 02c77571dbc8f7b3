//! Tensors: n-dimensional arrays of `f64` that hold exact values of a declared [`Format`].

use crate::error::{Error, Result};
use crate::format::{Format, Overflow};

/// An n-dimensional array (row-major, contiguous) whose every element is a value of `format`.
///
/// The invariant is checked when a tensor is built from outside data ([`Tensor::from_vec`],
/// [`Tensor::from_vec`]); operations produce tensors by rounding into their output format.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    values: Vec<f64>,
    format: Format,
}

/// The number of elements of `shape`, if it is a shape an array can have: the product of its
/// non-zero dimensions must fit in `isize` (the limit of an allocation, applied even when
/// another dimension is zero). `None` otherwise — file readers turn that into an error instead of
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
    /// A tensor of the given shape from row-major values, checking that they are as many as
    /// the shape holds ([`Error::ShapeMismatch`]) and that every one is a value of `format`
    /// ([`Error::NotRepresentable`] names the first that is not).
    ///
    /// # Examples
    ///
    /// ```
    /// use ttrace::{Format, Tensor};
    /// let t = Tensor::from_vec(&[2, 2], vec![1.0, 0.5, -2.0, 0.25], Format::BF16)?;
    /// assert_eq!(t.shape(), &[2, 2]);
    /// // 0.1 is not a BF16 value: round it first (`Tensor::rounded`).
    /// assert!(matches!(
    ///     Tensor::from_vec(&[1], vec![0.1], Format::BF16),
    ///     Err(ttrace::Error::NotRepresentable { .. })
    /// ));
    /// # Ok::<(), ttrace::Error>(())
    /// ```
    pub fn from_vec(shape: &[usize], values: Vec<f64>, format: Format) -> Result<Tensor> {
        if element_count(shape) != Some(values.len()) {
            return Err(Error::ShapeMismatch {
                what: "Tensor::from_vec".into(),
                expected: shape.to_vec(),
                found: vec![values.len()],
            });
        }
        if let Some(i) = format.first_unrepresentable(&values) {
            return Err(Error::NotRepresentable {
                value: values[i],
                format,
                what: format!("tensor element {i} (flat index, shape {shape:?})"),
            });
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            values,
            format,
        })
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

    /// A tensor of zeros. A shape no array can have (its element count overflows, see
    /// `element_count`) gives the empty tensor of shape `[0]`.
    pub fn zeros(shape: &[usize], format: Format) -> Tensor {
        match element_count(shape) {
            Some(n) => Tensor {
                shape: shape.to_vec(),
                values: vec![0.0; n],
                format,
            },
            None => Tensor {
                shape: vec![0],
                values: vec![],
                format,
            },
        }
    }

    /// Internal constructor for values already known to be in `format`, with `shape` holding
    /// exactly `values.len()` elements (callers guarantee it; readers validate shapes first). Should the guarantee ever fail, the result is poisoned rather
    /// than plausible: a flat tensor of NaNs, which no comparison accepts (its shape and
    /// values both mismatch), instead of silently wrong data.
    pub fn from_parts_unchecked(shape: &[usize], values: Vec<f64>, format: Format) -> Tensor {
        debug_assert_eq!(shape.iter().product::<usize>(), values.len());
        debug_assert!(format.first_unrepresentable(&values).is_none());
        if element_count(shape) != Some(values.len()) {
            let len = values.len();
            return Tensor {
                shape: vec![len],
                values: vec![f64::NAN; len],
                format,
            };
        }
        Tensor {
            shape: shape.to_vec(),
            values,
            format,
        }
    }

    /// The element format.
    pub fn format(&self) -> Format {
        self.format
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The elements in row-major order.
    pub fn values(&self) -> &[f64] {
        &self.values
    }

    /// Take the elements out, in row-major order (the buffer can be reused, e.g. in the spare
    /// pool of [`merge_reusing`](crate::trace::merge_reusing)).
    pub fn into_values(self) -> Vec<f64> {
        self.values
    }

    /// Round every element into `format` (a no-op copy when the format already contains
    /// this tensor's format).
    pub fn cast(&self, format: Format, overflow: Overflow) -> Tensor {
        if self.format.is_subset_of(format) {
            return Tensor {
                shape: self.shape.clone(),
                values: self.values.clone(),
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
