//! `ttrace._ttrace`: the Python bindings of the ttrace library.
//!
//! A thin layer: it converts arrays and policy texts, calls the library and converts results
//! and errors back. The Python package (`python/ttrace/`) wraps these functions with keyword
//! arguments, torch support and documentation; nothing here is meant to be called directly.
//!
//! * Arrays arrive as NumPy arrays of float64, float32, float16, or of uint16 / uint8 holding
//!   BF16 / FP8 bit patterns, with the format name beside them; they are read in place (any
//!   strides) and widened to the library's exact `f64` values.
//! * Errors become the exception classes of `ttrace.errors`, chosen by the library's error
//!   variant. A Rust panic is caught at the boundary and raised as `ttrace.errors.InternalError`
//!   — it never unwinds into the interpreter.
//! * Long calls (checking trace directories, writing a rank's trace) release the GIL.

mod online;
mod share;
mod summaries;
mod writing;

use std::panic::{catch_unwind, AssertUnwindSafe};

use numpy::{PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use ttrace::bounds::{self, Confidence, Op, OpOptions, OpSide};
use ttrace::{Error, Format, Policy, Tensor};

/// The exception class of `ttrace.errors` that stands for a library error.
fn error_class(e: &Error) -> &'static str {
    match e {
        Error::File { .. }
        | Error::Layout { .. }
        | Error::ReplicaMismatch { .. }
        | Error::UnpricedArithmetic { .. } => "TraceError",
        Error::Overflow { .. } | Error::NoFiniteBound { .. } => "NoFiniteBoundError",
        _ => "InvalidInputError",
    }
}

/// Raise `ttrace.errors.<class>(message)` with the library variant's name as `.kind`.
fn raise(py: Python<'_>, class: &str, kind: &str, message: String) -> PyErr {
    let made = py
        .import("ttrace.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.call1((message.clone(), kind)));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => PyRuntimeError::new_err(message),
    }
}

fn kind_of(e: &Error) -> String {
    let debug = format!("{e:?}");
    debug
        .split(|c: char| !c.is_alphanumeric())
        .next()
        .unwrap_or("Error")
        .to_string()
}

fn to_py(py: Python<'_>, e: Error) -> PyErr {
    raise(py, error_class(&e), &kind_of(&e), e.to_string())
}

/// Run `f`, turning a library error into its exception and a panic into `InternalError`.
fn guard<T>(py: Python<'_>, f: impl FnOnce() -> ttrace::Result<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py(py, e)),
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown".into());
            Err(raise(
                py,
                "InternalError",
                "Panic",
                format!("internal error in ttrace (please report it): {what}"),
            ))
        }
    }
}

/// [`guard`] with the GIL released while `f` runs (it must not touch Python objects).
fn guard_detached<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> ttrace::Result<T> + Send,
) -> PyResult<T> {
    let out = py.detach(|| catch_unwind(AssertUnwindSafe(f)));
    match out {
        Ok(r) => guard(py, || r),
        Err(p) => guard(py, || std::panic::resume_unwind(p)),
    }
}

fn invalid(py: Python<'_>, name: &'static str, reason: String) -> PyErr {
    to_py(py, Error::InvalidParameter { name, reason })
}

/// A NumPy array holding values of `format` (see the module docs) as an exact tensor.
fn tensor(py: Python<'_>, array: &Bound<'_, PyAny>, format: &str, what: &str) -> PyResult<Tensor> {
    let fmt: Format = guard(py, || format.parse())?;
    let shape: Vec<usize>;
    // Values decoded from their own format's encoding (every format but TF32, whose values
    // arrive as FP32 and are checked) are that format's values by construction.
    let decoded = fmt != Format::TF32;
    let values: Vec<f64> = match fmt {
        Format::F64 => {
            let a: PyReadonlyArrayDyn<'_, f64> = extract(py, array, "float64", what)?;
            shape = a.shape().to_vec();
            widened(&a, |v| v)
        }
        Format::F32 | Format::TF32 => {
            let a: PyReadonlyArrayDyn<'_, f32> = extract(py, array, "float32", what)?;
            shape = a.shape().to_vec();
            widened(&a, f64::from)
        }
        Format::F16 => {
            let a: PyReadonlyArrayDyn<'_, half::f16> = extract(py, array, "float16", what)?;
            shape = a.shape().to_vec();
            widened(&a, f64::from)
        }
        Format::BF16 => {
            let a: PyReadonlyArrayDyn<'_, u16> =
                extract(py, array, "uint16 (BF16 bit patterns)", what)?;
            shape = a.shape().to_vec();
            widened(&a, |p| f64::from(f32::from_bits(u32::from(p) << 16)))
        }
        Format::E4M3 | Format::E5M2 => {
            let a: PyReadonlyArrayDyn<'_, u8> =
                extract(py, array, "uint8 (FP8 bit patterns)", what)?;
            shape = a.shape().to_vec();
            let decode = |bytes: &[u8]| ttrace::io::safetensors::decode_values(bytes, fmt);
            // In row-major order: `as_slice` of the ndarray view is `None` for any other
            // layout (a transposed, Fortran-ordered array is read element by element).
            let view = a.as_array();
            match view.as_slice() {
                Some(bytes) => guard(py, || decode(bytes))?,
                None => {
                    let bytes: Vec<u8> = view.iter().copied().collect();
                    guard(py, || decode(&bytes))?
                }
            }
        }
        other => {
            return Err(invalid(
                py,
                "format",
                format!("{what}: arrays of {other} are not supported"),
            ))
        }
    };
    if decoded {
        // (The shape is the array's own: it holds exactly these elements.)
        return Ok(Tensor::from_parts_unchecked(&shape, values, fmt));
    }
    guard(py, || Tensor::from_vec(&shape, values, fmt))
}

/// An array's elements in row-major order, each widened to `f64` by `f`: straight from its
/// memory when it is contiguous in that order (vectorized), element by element otherwise.
fn widened<T: numpy::Element + Copy>(
    a: &PyReadonlyArrayDyn<'_, T>,
    f: impl Fn(T) -> f64,
) -> Vec<f64> {
    // ndarray's `as_slice`: `Some` only in standard (row-major) layout, where NumPy's would
    // also take a Fortran-ordered array's memory as it lies.
    let view = a.as_array();
    match view.as_slice() {
        Some(values) => values.iter().map(|&v| f(v)).collect(),
        None => view.iter().map(|&v| f(v)).collect(),
    }
}

fn extract<'py, T: numpy::Element>(
    py: Python<'py>,
    array: &Bound<'py, PyAny>,
    expected: &str,
    what: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    array.extract::<PyReadonlyArrayDyn<'py, T>>().map_err(|_| {
        let found = array
            .getattr("dtype")
            .map(|d| d.to_string())
            .unwrap_or_else(|_| array.get_type().to_string());
        invalid(
            py,
            "array",
            format!("{what}: expected a NumPy array of {expected}, got {found}"),
        )
    })
}

fn policy(py: Python<'_>, text: &str, what: &str) -> PyResult<Policy> {
    match guard(py, || Ok(text.parse::<Policy>()))? {
        Ok(p) => Ok(p),
        Err(e) => Err(raise(
            py,
            error_class(&e),
            &kind_of(&e),
            format!("{what} policy '{text}': {e}"),
        )),
    }
}

/// One side of an op from its text (`what` names it in errors).
fn side(py: Python<'_>, text: &str, what: &str) -> PyResult<OpSide> {
    match guard(py, || Ok(text.parse::<OpSide>()))? {
        Ok(s) => Ok(s),
        Err(e) => Err(raise(
            py,
            error_class(&e),
            &kind_of(&e),
            format!("{what} policy '{text}': {e}"),
        )),
    }
}

fn confidence(py: Python<'_>, delta: Option<f64>) -> PyResult<Confidence> {
    match delta {
        None => Ok(Confidence::Guaranteed),
        Some(d) => guard(py, || Confidence::probabilistic(d)),
    }
}

/// A priced threshold on ‖candidate − reference‖_F, with the verdict on a pair of outputs.
#[pyclass(module = "ttrace._ttrace", frozen)]
struct Threshold {
    inner: bounds::Threshold,
}

#[pymethods]
impl Threshold {
    /// Both sides compute bit-identical results: any difference is a bug.
    #[getter]
    fn identical(&self) -> bool {
        self.inner.identical
    }
    /// The failure probability δ (None for a guaranteed threshold).
    #[getter]
    fn delta(&self) -> Option<f64> {
        match self.inner.confidence {
            Confidence::Guaranteed => None,
            Confidence::Probabilistic { delta } => Some(delta),
        }
    }
    /// The threshold on ‖candidate − reference‖_F.
    #[getter]
    fn abs_frobenius(&self) -> f64 {
        self.inner.abs_frobenius
    }
    /// `abs_frobenius / ‖reference‖_F`.
    #[getter]
    fn relative(&self) -> f64 {
        self.inner.relative
    }
    /// ‖reference‖_F of the exact result.
    #[getter]
    fn reference_norm(&self) -> f64 {
        self.inner.reference_norm
    }
    /// A bound on any one element's difference.
    #[getter]
    fn per_element(&self) -> f64 {
        self.inner.per_element
    }
    /// The expected relative difference (root mean square).
    #[getter]
    fn expected_relative(&self) -> f64 {
        self.inner.expected_relative
    }
    /// The worst-case relative difference.
    #[getter]
    fn guaranteed_relative(&self) -> f64 {
        self.inner.guaranteed_relative
    }
    /// Elements of the output.
    #[getter]
    fn elements(&self) -> usize {
        self.inner.elements
    }

    /// The verdict on a pair of outputs, as a dict of the library's `TensorVerdict` fields.
    fn check<'py>(
        &self,
        py: Python<'py>,
        reference: &Bound<'py, PyAny>,
        reference_format: &str,
        candidate: &Bound<'py, PyAny>,
        candidate_format: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        let r = tensor(py, reference, reference_format, "reference")?;
        let c = tensor(py, candidate, candidate_format, "candidate")?;
        if r.shape() != c.shape() {
            return Err(to_py(
                py,
                Error::ShapeMismatch {
                    what: "check: the candidate's shape differs from the reference's".into(),
                    expected: r.shape().to_vec(),
                    found: c.shape().to_vec(),
                },
            ));
        }
        let v = guard(py, || Ok(self.inner.check(&r, &c)))?;
        json_to_py(py, &guard(py, || json(&v))?)
    }

    /// The threshold's fields as a dict.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        json_to_py(py, &guard(py, || json(&self.inner))?)
    }
}

fn json<T: serde::Serialize>(v: &T) -> ttrace::Result<String> {
    serde_json::to_string(v).map_err(|e| Error::InvalidParameter {
        name: "report",
        reason: format!("cannot serialize: {e}"),
    })
}

fn json_to_py<'py>(py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?.call_method1("loads", (text,))
}

/// The canonical text of a policy (parsing and validating it); `side` names it in errors.
#[pyfunction]
#[pyo3(signature = (text, side = "the"))]
fn parse_policy(py: Python<'_>, text: &str, side: &str) -> PyResult<String> {
    let p = policy(py, text, side)?;
    guard(py, || p.validate())?;
    Ok(p.to_string())
}

/// A threshold's [`bounds::Pricing`] from its name.
fn parse_pricing(py: Python<'_>, pricing: &str) -> PyResult<bounds::Pricing> {
    match pricing {
        "auto" => Ok(bounds::Pricing::Auto),
        "walk" => Ok(bounds::Pricing::Walk),
        "fast" => Ok(bounds::Pricing::Fast),
        other => Err(invalid(
            py,
            "pricing",
            format!("unknown pricing '{other}' (auto, walk, fast)"),
        )),
    }
}

/// The threshold of `op` (the library's op registry, [`bounds::Op`]) on `inputs` (arrays with
/// their format names, in the op's operand order), between two sides given as text (a
/// policy with the keys `form=` and `variance=`; [`bounds::OpSide`]).
#[pyfunction]
#[pyo3(signature = (op, inputs, reference, candidate, delta, pricing = "auto", norm_eps = 1e-5))]
#[allow(clippy::too_many_arguments)]
fn threshold(
    py: Python<'_>,
    op: &str,
    inputs: Vec<(Bound<'_, PyAny>, String)>,
    reference: &str,
    candidate: &str,
    delta: Option<f64>,
    pricing: &str,
    norm_eps: f64,
) -> PyResult<Threshold> {
    let op: Op = guard(py, || op.parse())?;
    let names = op.operand_names();
    let tensors = inputs
        .iter()
        .enumerate()
        .map(|(i, (a, f))| {
            let what = names
                .get(i)
                .map_or(format!("operand {i}"), |n| n.to_string());
            tensor(py, a, f, &what)
        })
        .collect::<PyResult<Vec<_>>>()?;
    let refs: Vec<&Tensor> = tensors.iter().collect();
    let rs = side(py, reference, "reference")?;
    let cs = side(py, candidate, "candidate")?;
    let conf = confidence(py, delta)?;
    let options = OpOptions {
        norm_eps,
        pricing: parse_pricing(py, pricing)?,
    };
    let inner = guard(py, || {
        bounds::op_threshold(op, &refs, &rs, &cs, &options, conf)
    })?;
    Ok(Threshold { inner })
}

/// Every op's text, from the library's registry.
#[pyfunction]
fn ops() -> Vec<&'static str> {
    Op::NAMES.to_vec()
}

/// The canonical text of a side (a policy with `form=` and `variance=`), validated.
#[pyfunction]
#[pyo3(signature = (text, which = "the"))]
fn parse_side(py: Python<'_>, text: &str, which: &str) -> PyResult<String> {
    let s = side(py, text, which)?;
    guard(py, || s.policy.validate())?;
    Ok(s.to_string())
}

/// Check a candidate trace directory against a reference one: (report as JSON, report as
/// the CLI's text).
#[pyfunction]
fn check_dirs(
    py: Python<'_>,
    reference: std::path::PathBuf,
    candidate: std::path::PathBuf,
    pricing: &str,
) -> PyResult<(String, String)> {
    let mode = pricing_mode(py, pricing)?;
    trace_guard(py, move || {
        let out = ttrace::check::check_dir_paths(&reference, &candidate, mode, &|| {})?;
        Ok((json(&out)?, ttrace::check::render_dir_check(&out)))
    })
}

/// `auto` or `local`.
fn pricing_mode(py: Python<'_>, pricing: &str) -> PyResult<ttrace::check::PricingMode> {
    match pricing {
        "auto" => Ok(ttrace::check::PricingMode::Auto),
        "local" => Ok(ttrace::check::PricingMode::Local),
        other => Err(invalid(
            py,
            "pricing",
            format!("unknown pricing '{other}' (auto, local)"),
        )),
    }
}

/// Run a check's `f` with the GIL released: whatever stops it (a missing tensor, an
/// unreadable or unmergeable file, shares that do not fit together) is a problem of the
/// traces — `TraceError`, with the core's variant as its kind; a panic is `InternalError`.
fn trace_guard<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> ttrace::Result<T> + Send,
) -> PyResult<T> {
    match py.detach(move || catch_unwind(AssertUnwindSafe(f))) {
        Ok(Err(e)) => Err(raise(py, "TraceError", &kind_of(&e), e.to_string())),
        Ok(Ok(v)) => Ok(v),
        Err(p) => guard(py, || std::panic::resume_unwind(p)),
    }
}

/// Logical (merged) tensors of a trace directory as float64 arrays, in trace order: `ids`, or
/// every id when `ids` is None. With `reference`, layouts the writer could only guess are first
/// inferred against that trace's shapes (as the checker does).
#[pyfunction]
#[pyo3(signature = (directory, ids = None, reference = None))]
fn load_logical<'py>(
    py: Python<'py>,
    directory: std::path::PathBuf,
    ids: Option<Vec<String>>,
    reference: Option<std::path::PathBuf>,
) -> PyResult<Vec<(String, Bound<'py, numpy::PyArrayDyn<f64>>)>> {
    use numpy::{IntoPyArray, PyArrayMethods};
    let out = py.detach(move || {
        catch_unwind(AssertUnwindSafe(
            || -> ttrace::Result<Vec<(String, ttrace::Tensor)>> {
                let dir = ttrace::io::TraceDir::open(&directory)?;
                let mut dir = match reference {
                    Some(r) => dir.infer_guessed(&ttrace::io::TraceDir::open(&r)?)?.0,
                    None => dir,
                };
                let ids = ids.unwrap_or_else(|| dir.ids().to_vec());
                ids.into_iter()
                    .map(|id| {
                        let t = dir.logical(&id)?;
                        Ok((id, t))
                    })
                    .collect()
            },
        ))
    });
    let tensors = match out {
        Ok(Err(e)) => return Err(raise(py, "TraceError", &kind_of(&e), e.to_string())),
        Ok(Ok(t)) => t,
        Err(p) => return guard(py, || std::panic::resume_unwind(p)),
    };
    tensors
        .into_iter()
        .map(|(id, t)| {
            let shape = t.shape().to_vec();
            Ok((id, t.into_values().into_pyarray(py).reshape(shape)?))
        })
        .collect()
}

/// `text` for a terminal, on one line (the CLI's escaping: control characters but tab, and
/// bidirectional controls, written as `\u{…}`).
#[pyfunction]
fn sanitize(text: &str) -> String {
    ttrace::io::sanitize(text).into_owned()
}

/// The exact values of an array of `format` as float64, in its shape.
#[pyfunction]
fn to_float64<'py>(
    py: Python<'py>,
    array: &Bound<'py, PyAny>,
    format: &str,
) -> PyResult<Bound<'py, numpy::PyArrayDyn<f64>>> {
    use numpy::{IntoPyArray, PyArrayMethods};
    let t = tensor(py, array, format, "array")?;
    let shape = t.shape().to_vec();
    t.into_values().into_pyarray(py).reshape(shape)
}

/// Panics inside the boundary guard: the tests check that the panic arrives as
/// `ttrace.errors.InternalError` and the interpreter goes on.
#[pyfunction]
fn _panic_for_tests(py: Python<'_>, detached: bool) -> PyResult<()> {
    let boom = || -> ttrace::Result<()> { panic!("a deliberate panic (test of the boundary)") };
    if detached {
        guard_detached(py, boom)
    } else {
        guard(py, boom)
    }
}

/// The library version and the formats it reads.
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", env!("CARGO_PKG_VERSION"))?;
    Ok(d)
}

#[pymodule]
fn _ttrace(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Threshold>()?;
    m.add_function(wrap_pyfunction!(parse_policy, m)?)?;
    m.add_function(wrap_pyfunction!(parse_side, m)?)?;
    m.add_function(wrap_pyfunction!(threshold, m)?)?;
    m.add_function(wrap_pyfunction!(ops, m)?)?;
    m.add_function(wrap_pyfunction!(check_dirs, m)?)?;
    m.add_function(wrap_pyfunction!(share::check_share, m)?)?;
    m.add_function(wrap_pyfunction!(share::combine_shares, m)?)?;
    m.add_function(wrap_pyfunction!(share::share_owners, m)?)?;
    m.add_function(wrap_pyfunction!(load_logical, m)?)?;
    m.add_function(wrap_pyfunction!(writing::write_step, m)?)?;
    m.add_function(wrap_pyfunction!(online::encode_header, m)?)?;
    m.add_class::<online::OnlineTrace>()?;
    m.add_function(wrap_pyfunction!(writing::merge_manifests, m)?)?;
    m.add_function(wrap_pyfunction!(summaries::append_summaries, m)?)?;
    m.add_function(wrap_pyfunction!(summaries::is_summary_dir, m)?)?;
    m.add_function(wrap_pyfunction!(summaries::check_summaries, m)?)?;
    m.add_function(wrap_pyfunction!(summaries::summarize, m)?)?;
    m.add_function(wrap_pyfunction!(writing::write_atomic, m)?)?;
    m.add_function(wrap_pyfunction!(sanitize, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(to_float64, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_for_tests, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
