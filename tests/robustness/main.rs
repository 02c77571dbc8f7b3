//! Edge cases that must give a typed error or a documented verdict — never a panic, a NaN
//! verdict, or a silent wrong answer: non-finite values, zero and near-zero references,
//! subnormals, FP8 saturation, empty tensors, huge and empty reductions, invalid threshold
//! requests; reports written atomically and identical from run to run.

use std::collections::HashMap;

use ttrace::bounds::{plan_matmul, Confidence, MatmulPlan, TermStats, MAX_PLANNED_TERMS};
use ttrace::check::{check_dir_paths, compare_tensor, compare_tensor_with, PricingMode};
use ttrace::check::{price_local, InputIndex, PriceContext, TensorStat};
use ttrace::check::{Detection, Detector};
use ttrace::engine::matmul;
use ttrace::io::{safetensors, write_atomic, write_trace_dir, ModuleInfo};
use ttrace::trace::{Axis, Layout, Mesh};
use ttrace::{sum, Accumulation, Error, Format, Overflow};
use ttrace::{Policy, Tensor};

mod accumulation;
mod files;
mod values;

fn t(v: &[f64], f: Format) -> Tensor {
    Tensor::from_vec(&[v.len()], v.to_vec(), f).unwrap()
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ttrace-robust-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

// ---- Non-finite values -----------------------------------------------------------------------

// ---- Zero and near-zero references ------------------------------------------------------------

// ---- Subnormals --------------------------------------------------------------------------------

// ---- FP8 saturation and overflow ------------------------------------------------------------

// ---- Empty tensors and reductions -------------------------------------------------------------

// ---- Threshold requests -------------------------------------------------------------------------

// ---- Atomic reports, deterministic results ---------------------------------------------------

// ---- Layouts a tracer could only guess --------------------------------------------------------

// ---- Biased rounding: reductions accumulated below FP32 ----------------------------------------
