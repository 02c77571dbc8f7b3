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
use ttrace::trace::{Layout, Mesh};
use ttrace::{sum, Accumulation, Error, Format, Overflow};
use ttrace::{Policy, Tensor};

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

#[test]
fn nan_in_the_candidate_fails_at_its_position_whatever_the_threshold() {
    let r = t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], Format::F32);
    let c = t(&[1.0, 2.0, 3.0, 4.0, 5.0, f64::NAN], Format::F32);
    let v = compare_tensor("x", &r, &c, f64::INFINITY, 1.0);
    assert!(!v.passed);
    assert_eq!(v.first_nonfinite, Some(5));
    assert_eq!(v.nonfinite_mismatches, 1);
    // The finite part is still measured (no NaN leaks into the numbers).
    assert_eq!(v.rel_error, 0.0);
}

#[test]
fn nan_or_infinity_in_the_reference_against_finite_values_fails() {
    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let r = t(&[bad, 1.0], Format::F32);
        let c = t(&[1.0, 1.0], Format::F32);
        let v = compare_tensor("x", &r, &c, f64::INFINITY, 1.0);
        assert!(!v.passed, "{bad}");
        assert_eq!(v.first_nonfinite, Some(0));
    }
}

/// The documented policy: NaN matches NaN (any payload), an infinity matches the same
/// infinity; −∞ vs +∞ and ∞ vs NaN are mismatches.
#[test]
fn matching_non_finite_values_follow_the_policy() {
    let quiet = f64::NAN;
    let other_payload = f64::from_bits(f64::NAN.to_bits() | 0x1234);
    let r = t(&[quiet, f64::INFINITY, f64::NEG_INFINITY, 2.0], Format::F64);
    let c = t(
        &[other_payload, f64::INFINITY, f64::NEG_INFINITY, 2.0],
        Format::F64,
    );
    assert!(compare_tensor("x", &r, &c, 0.0, 1.0).passed);
    for (a, b) in [
        (f64::INFINITY, f64::NEG_INFINITY),
        (f64::INFINITY, f64::NAN),
        (f64::NAN, f64::NEG_INFINITY),
    ] {
        let v = compare_tensor(
            "x",
            &t(&[a], Format::F64),
            &t(&[b], Format::F64),
            1e300,
            1.0,
        );
        assert!(!v.passed && v.nonfinite_mismatches == 1, "{a} vs {b}");
    }
}

// ---- Zero and near-zero references ------------------------------------------------------------

#[test]
fn all_zero_references_never_divide_by_zero() {
    let zero = t(&[0.0, -0.0, 0.0], Format::BF16);
    let v = compare_tensor("x", &zero, &zero, 0.0, 1.0);
    assert!(v.passed && v.rel_error == 0.0 && v.ratio == 0.0);
    // A non-zero candidate: infinite relative error (not NaN), fails any finite threshold …
    let c = t(&[0.0, 2f64.powi(-20), 0.0], Format::BF16);
    let v = compare_tensor("x", &zero, &c, 1e-9, 1.0);
    assert!(!v.passed && v.rel_error == f64::INFINITY && !v.ratio.is_nan());
    assert_eq!(v.max_abs, 2f64.powi(-20));
    // … and passes an absolute threshold that covers it.
    let v = compare_tensor("x", &zero, &c, 1e-6, 1.0);
    assert!(v.passed && !v.ratio.is_nan());
}

#[test]
fn near_zero_references_keep_finite_relative_errors() {
    // Subnormal F32 values (the smallest is 2^-149).
    let tiny = 2f64.powi(-149);
    let r = t(&[tiny, 3.0 * tiny], Format::F32);
    let c = t(&[2.0 * tiny, 3.0 * tiny], Format::F32);
    let v = compare_tensor("x", &r, &c, 2.0 * tiny, 1.0);
    assert!(v.rel_error.is_finite() && v.rel_error > 0.0 && v.passed);
    assert_eq!(v.max_ulp, 1);
}

fn stat(ref_norm: f64, diff_norm: f64, kind: Option<ttrace::trace::ModuleKind>) -> TensorStat {
    TensorStat {
        ref_norm,
        ref_max_abs: ref_norm,
        diff_norm,
        elements: 16,
        last_dim: 4,
        ndim: 2,
        format: Format::BF16,
        layout: Layout::replicated(),
        norm_gain: 1.0,
        module: kind.map(ModuleInfo::of),
        cand_module: None,
    }
}

/// A residual whose reference output is exactly zero (x + (−x)) is priced by an absolute
/// bound from its inputs' differences: ‖Δout‖ ≤ (1 + u)(‖Δx‖ + ‖Δy‖) — never 0 (a false
/// alarm) and never ∞ (a blind spot).
#[test]
fn a_zero_residual_output_gets_an_absolute_floor() {
    use ttrace::trace::ModuleKind;
    let ids: Vec<String> = ["r|fwd.input.0", "r|fwd.input.1", "r|fwd.output.0"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut stats = HashMap::new();
    stats.insert(ids[0].clone(), stat(4.0, 1e-3, None));
    stats.insert(ids[1].clone(), stat(4.0, 2e-3, None));
    stats.insert(ids[2].clone(), stat(0.0, 0.0, Some(ModuleKind::Residual)));
    let index = InputIndex::new(&ids);
    let ctx = PriceContext {
        mesh: Mesh::single(),
        recipe: None,
        log_inv_delta: (1e6f64).ln(),
    };
    let get = |id: &str| stats.get(id);
    let p = price_local(&ids[2], &index, &get, &ctx).unwrap();
    let u = Format::BF16.unit_roundoff();
    assert_eq!(p.threshold, 3e-3 * (1.0 + u));
}

// ---- Subnormals --------------------------------------------------------------------------------

#[test]
fn subnormals_round_and_compare_across_zero() {
    let s = 2f64.powi(-133); // BF16's smallest subnormal
    assert_eq!(Format::BF16.round(0.75 * s, Overflow::NonSaturating), s);
    assert_eq!(Format::BF16.round(0.5 * s, Overflow::NonSaturating), 0.0); // tie to even (0)
    let v = compare_tensor(
        "x",
        &t(&[s], Format::BF16),
        &t(&[-s], Format::BF16),
        1.0,
        1.0,
    );
    assert_eq!(v.max_ulp, 2, "−s, 0, s: two steps");
}

// ---- FP8 saturation and overflow ------------------------------------------------------------

#[test]
fn fp8_overflow_follows_the_overflow_policy() {
    assert_eq!(Format::E4M3.round(1000.0, Overflow::Saturating), 448.0);
    assert_eq!(Format::E4M3.round(-1e30, Overflow::Saturating), -448.0);
    // E4M3 has no infinity: a non-saturating overflow is NaN.
    assert!(Format::E4M3.round(1000.0, Overflow::NonSaturating).is_nan());
    assert_eq!(
        Format::E5M2.round(1e6, Overflow::NonSaturating),
        f64::INFINITY
    );
    assert_eq!(Format::E5M2.round(1e6, Overflow::Saturating), 57344.0);
    // Values past FP8's range, not quantizable as FP8: a typed error, not a silent clamp.
    let e = Tensor::from_vec(&[1], vec![1000.0], Format::E4M3).unwrap_err();
    assert!(matches!(e, Error::NotRepresentable { .. }), "{e}");
}

// ---- Empty tensors and reductions -------------------------------------------------------------

#[test]
fn empty_tensors_compare_store_and_multiply() {
    let e = Tensor::from_vec(&[0, 3], vec![], Format::BF16).unwrap();
    let v = compare_tensor("x", &e, &e, 0.0, 1.0);
    assert!(v.passed && v.rel_error == 0.0 && v.elements == 0);
    let d = tmp("empty");
    let p = d.join("e.safetensors");
    safetensors::write(&p, &[("e", &e)], &Default::default()).unwrap();
    let back = safetensors::SafetensorsFile::open(&p)
        .unwrap()
        .read("e")
        .unwrap();
    assert_eq!(back.shape(), &[0, 3]);
    // An empty reduction is exactly zero in any order.
    let a = Tensor::zeros(&[2, 0], Format::BF16);
    let b = Tensor::zeros(&[0, 3], Format::BF16);
    let c = matmul(
        &a,
        &b,
        &Policy::new(Format::BF16, Format::F32, Format::BF16),
    )
    .unwrap();
    assert_eq!(c.values(), &[0.0; 6]);
    assert_eq!(
        sum(
            &[],
            &Accumulation::new(Format::BF16, Format::BF16, ttrace::Order::Sequential)
        )
        .unwrap(),
        0.0
    );
}

// ---- Threshold requests -------------------------------------------------------------------------

#[test]
fn invalid_threshold_requests_are_typed_errors() {
    let p = Policy::new(Format::BF16, Format::F32, Format::BF16);
    let q = Policy::new(Format::BF16, Format::BF16, Format::BF16);
    let x = TermStats::normal(0.0, 1.0);
    let conf = Confidence::default_probabilistic();
    // Zero length (nothing to price), and a huge one: refused up front, not an hour of work
    // or an allocation failure. The plan's fields are public, so plan_matmul checks too.
    let plan = |k| MatmulPlan {
        m: 4,
        k,
        n: 4,
        a: x,
        b: x,
    };
    for k in [0, MAX_PLANNED_TERMS + 1] {
        let e = plan_matmul(&plan(k), &p, &q, conf).unwrap_err();
        assert!(
            matches!(e, Error::InvalidParameter { name: "k", .. }),
            "{e}"
        );
    }
    assert!(plan_matmul(&plan(MAX_PLANNED_TERMS.min(1 << 16)), &p, &q, conf).is_ok());
    // A plan is checked where it is built, too: zero rows, an output that overflows.
    for (m, n, name) in [(0, 4, "m"), (usize::MAX, 2, "n")] {
        let e = MatmulPlan::new(m, 16, n, x, x).unwrap_err();
        assert!(
            matches!(e, Error::InvalidParameter { name: got, .. } if got == name),
            "{e}"
        );
    }
    // δ outside (0, 1).
    for d in [0.0, 1.0, -0.5, 2.0, f64::NAN] {
        assert!(
            Confidence::probabilistic(d)
                .err()
                .is_some_and(|e| matches!(e, ttrace::Error::InvalidParameter { .. })),
            "{d}"
        );
    }
    // Unknown formats.
    assert!(matches!(
        "bf17".parse::<Format>(),
        Err(ttrace::Error::UnknownFormat(..))
    ));
    assert!(matches!(
        "".parse::<Format>(),
        Err(ttrace::Error::UnknownFormat(..))
    ));
}

// ---- Atomic reports, deterministic results ---------------------------------------------------

#[test]
fn atomic_writes_leave_the_old_file_or_the_new_one() {
    let d = tmp("atomic");
    let p = d.join("report.json");
    write_atomic(&p, b"old").unwrap();
    write_atomic(&p, b"new contents").unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), b"new contents");
    // A failing write (the target is a directory) leaves no temporary file behind.
    let target = d.join("sub");
    std::fs::create_dir_all(target.join("x")).unwrap();
    assert!(matches!(
        write_atomic(&target, b"data"),
        Err(ttrace::Error::File { .. })
    ));
    let left: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert!(
        left.iter().all(|n| !n.contains(".tmp")),
        "temporary files left: {left:?}"
    );
    assert_eq!(std::fs::read(&p).unwrap(), b"new contents");
}

/// A trace pair checked twice and on 1 and 3 threads gives byte-identical JSON reports.
#[test]
fn check_reports_are_identical_across_runs_and_thread_counts() {
    let d = tmp("determinism");
    let single = Mesh::single();
    let tp2 = Mesh::new(2, 1, 1, false).unwrap();
    let mut split = Layout::replicated();
    split.tp = ttrace::trace::Placement::split(1);
    let mut re = vec![];
    let mut ce = vec![];
    let mut g = ttrace::engine::SplitMix64::for_name("robust", 3);
    for m in 0..6 {
        let v: Vec<f64> = (0..64)
            .map(|_| Format::BF16.round(g.uniform() - 0.5, Overflow::Saturating))
            .collect();
        let c: Vec<f64> = v
            .iter()
            .map(|x| Format::BF16.round(x * (1.0 + 2f64.powi(-8)), Overflow::Saturating))
            .collect();
        let id = format!("m{m}|fwd.output.0");
        let rt = Tensor::from_vec(&[8, 8], v, Format::BF16).unwrap();
        let ct = Tensor::from_vec(&[8, 8], c, Format::BF16).unwrap();
        re.push((id.clone(), Layout::replicated(), vec![rt]));
        let shards = ttrace::trace::shard(&ct, &split, &tp2, &id).unwrap();
        ce.push((id, split, shards));
    }
    let none = HashMap::new();
    write_trace_dir(&d.join("r"), &single, None, &re, &HashMap::new(), &none).unwrap();
    write_trace_dir(&d.join("c"), &tp2, None, &ce, &HashMap::new(), &none).unwrap();
    let run = |threads: usize| {
        let out = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| check_dir_paths(&d.join("r"), &d.join("c"), PricingMode::Auto, &|| {}))
            .unwrap();
        serde_json::to_string(&out).unwrap()
    };
    let first = run(1);
    assert_eq!(first, run(1));
    assert_eq!(first, run(3));
}

/// A file the operating system refuses keeps its `io::Error` as the error's source.
#[test]
fn file_errors_keep_the_operating_systems_error_as_source() {
    use std::error::Error as _;
    let missing = tmp("no-such-dir").join("missing.safetensors");
    let e = ttrace::io::safetensors::SafetensorsFile::open(&missing).unwrap_err();
    assert!(
        matches!(e, ttrace::Error::File { io: Some(_), .. }),
        "{e:?}"
    );
    let io = e.source().and_then(|s| s.downcast_ref::<std::io::Error>());
    assert_eq!(
        io.map(|e| e.kind()),
        Some(std::io::ErrorKind::NotFound),
        "{e:?}"
    );
}

/// Write a one-rank trace directory of `entries` (no module kinds, no producer thresholds).
fn write_single(dir: &std::path::Path, entries: &[(String, Layout, Vec<Tensor>)]) {
    write_trace_dir(
        dir,
        &Mesh::single(),
        None,
        entries,
        &HashMap::new(),
        &HashMap::new(),
    )
    .unwrap();
}

/// A tensor stored in another dtype by the candidate than by the reference is judged, priced
/// at the wider of the two (issue 33: a dtype change was refused as unusable input): the same
/// values stored wider pass; a value that differs fails with both dtypes named.
#[test]
fn a_dtype_that_differs_between_the_runs_is_judged() {
    let d = tmp("mixed-dtypes");
    let v: Vec<f64> = (0..16).map(|i| f64::from(i) / 4.0).collect();
    let entry = |f: Format, v: &[f64]| {
        vec![(
            "m|fwd.output.0".to_string(),
            Layout::replicated(),
            vec![Tensor::from_vec(&[16], v.to_vec(), f).unwrap()],
        )]
    };
    write_single(&d.join("r"), &entry(Format::F32, &v));
    write_single(&d.join("c"), &entry(Format::F64, &v));
    let out = check_dir_paths(&d.join("r"), &d.join("c"), PricingMode::Auto, &|| {}).unwrap();
    assert!(out.report.passed());
    let mut bad = v.clone();
    bad[3] += 0.5;
    write_single(&d.join("c"), &entry(Format::F64, &bad));
    let out = check_dir_paths(&d.join("r"), &d.join("c"), PricingMode::Auto, &|| {}).unwrap();
    let verdict = &out.report.verdicts[0];
    assert!(!verdict.passed);
    let note = verdict.problem.as_deref().unwrap_or("");
    assert!(note.contains("f64") && note.contains("f32"), "{note}");
}

/// A module's input that differs from the traced output it equals in the reference was
/// changed in untraced code: the localization names the gap (after which module, before which).
#[test]
fn a_difference_born_between_traced_modules_is_localized_to_the_gap() {
    let d = tmp("born-between");
    let v: Vec<f64> = (0..64).map(|i| f64::from(i) / 8.0 - 3.0).collect();
    let changed: Vec<f64> = v
        .iter()
        .map(|x| Format::F32.round(x * 1.01, Overflow::Saturating))
        .collect();
    let t = |values: &[f64]| vec![Tensor::from_vec(&[8, 8], values.to_vec(), Format::F32).unwrap()];
    let trace = |input_of_b: &[f64]| {
        vec![
            ("a|fwd.input.0".to_string(), Layout::replicated(), t(&v)),
            ("a|fwd.output.0".to_string(), Layout::replicated(), t(&v)),
            (
                "b|fwd.input.0".to_string(),
                Layout::replicated(),
                t(input_of_b),
            ),
            (
                "b|fwd.output.0".to_string(),
                Layout::replicated(),
                t(input_of_b),
            ),
        ]
    };
    write_single(&d.join("r"), &trace(&v));
    write_single(&d.join("c"), &trace(&changed));
    let out = check_dir_paths(&d.join("r"), &d.join("c"), PricingMode::Auto, &|| {}).unwrap();
    assert_eq!(out.report.first_failure.as_deref(), Some("b|fwd.input.0"));
    let l = out.localization.expect("a failure is localized");
    assert_eq!(l.module, "b");
    assert_eq!(l.born_after.as_deref(), Some("a"));
    assert!(
        l.detail
            .starts_with("born in untraced code between module a and module b"),
        "{}",
        l.detail
    );
}

/// Consumed tensors that untraced code made are listed as the trace's gaps, with the modules
/// on each side, and named in the report's text.
#[test]
fn untraced_gaps_are_listed_with_the_modules_around_them() {
    let d = tmp("untraced-gaps");
    let v: Vec<f64> = (0..64).map(|i| f64::from(i) / 8.0 - 3.0).collect();
    let doubled: Vec<f64> = v.iter().map(|x| x * 2.0).collect();
    let t = |values: &[f64]| vec![Tensor::from_vec(&[8, 8], values.to_vec(), Format::F32).unwrap()];
    // b's input is a's output doubled by code nobody traced.
    let entries = vec![
        ("a|fwd.input.0".to_string(), Layout::replicated(), t(&v)),
        ("a|fwd.output.0".to_string(), Layout::replicated(), t(&v)),
        (
            "b|fwd.input.0".to_string(),
            Layout::replicated(),
            t(&doubled),
        ),
        (
            "b|fwd.output.0".to_string(),
            Layout::replicated(),
            t(&doubled),
        ),
    ];
    write_single(&d.join("r"), &entries);
    write_single(&d.join("c"), &entries);
    let out = check_dir_paths(&d.join("r"), &d.join("c"), PricingMode::Auto, &|| {}).unwrap();
    assert!(out.report.passed());
    assert_eq!(
        out.untraced,
        vec![ttrace::check::UntracedGap {
            after: Some("a".into()),
            before: "b".into(),
            tensor: "b|fwd.input.0".into()
        }]
    );
    let text = ttrace::check::render_dir_check(&out);
    assert!(
        text.contains("untraced code made 1 of the consumed tensors (the first between module a and module b)"),
        "{text}"
    );
}

// ---- Layouts a tracer could only guess --------------------------------------------------------

/// Mark the entries of `id` (of the ranks in `ranks`) in `dir`'s manifest as guessed along
/// `axes`, optionally replacing their layout.
fn mark_guessed(
    dir: &std::path::Path,
    id: &str,
    ranks: &[usize],
    axes: &[&str],
    layout: Option<Layout>,
) {
    let path = dir.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for e in m["tensors"].as_array_mut().unwrap() {
        let rank = e["rank"].as_u64().unwrap() as usize;
        if e["id"] == id && ranks.contains(&rank) {
            e["guessed"] = serde_json::json!(axes);
            if let Some(l) = layout {
                e["layout"] = serde_json::to_value(l).unwrap();
            }
        }
    }
    std::fs::write(&path, serde_json::to_string(&m).unwrap()).unwrap();
}

/// Write a trace directory on `mesh` (no module kinds, no producer thresholds).
fn write_mesh(dir: &std::path::Path, mesh: &Mesh, entries: &[(String, Layout, Vec<Tensor>)]) {
    write_trace_dir(dir, mesh, None, entries, &HashMap::new(), &HashMap::new()).unwrap();
}

/// A one-rank reference holding the whole [rows, cols] matrix `v` as `id`.
fn write_whole(dir: &std::path::Path, id: &str, v: &[f64], rows: usize, cols: usize) {
    let whole = block(v, rows, cols, (0, 1), (0, 1));
    write_single(dir, &[(id.to_string(), Layout::replicated(), vec![whole])]);
}

/// Cut a row-major [rows, cols] matrix into the block of rows `r` of `nr` and columns `c` of `nc`.
fn block(
    v: &[f64],
    rows: usize,
    cols: usize,
    (r, nr): (usize, usize),
    (c, nc): (usize, usize),
) -> Tensor {
    let (h, w) = (rows / nr, cols / nc);
    let mut out = vec![];
    for i in r * h..(r + 1) * h {
        out.extend_from_slice(&v[i * cols + c * w..i * cols + (c + 1) * w]);
    }
    Tensor::from_vec(&[h, w], out, Format::F32).unwrap()
}

/// A tensor split along its columns across two TP ranks, written as "replicated, guessed":
/// the checker finds the split from the shapes and compares the merged tensor — equal to the
/// reference, so it passes; unmarked, the same shards are a shape mismatch.
#[test]
fn a_guessed_layout_is_inferred_from_the_shapes() {
    let d = tmp("guessed-split");
    let v: Vec<f64> = (0..32).map(|i| f64::from(i) - 10.0).collect();
    let id = "m|fwd.output.0".to_string();
    write_whole(&d.join("r"), &id, &v, 4, 8);
    let mesh = Mesh::new(2, 1, 1, false).unwrap();
    let shards = vec![
        block(&v, 4, 8, (0, 1), (0, 2)),
        block(&v, 4, 8, (0, 1), (1, 2)),
    ];
    let entries = [(id.clone(), Layout::replicated(), shards)];
    write_mesh(&d.join("c"), &mesh, &entries);
    let unmarked = check_dir_paths(&d.join("r"), &d.join("c"), PricingMode::Auto, &|| {});
    assert!(unmarked.is_err() || !unmarked.unwrap().report.passed());
    mark_guessed(&d.join("c"), &id, &[0, 1], &["tp"], None);
    let out = check_dir_paths(&d.join("r"), &d.join("c"), PricingMode::Auto, &|| {}).unwrap();
    assert!(
        out.report.passed(),
        "{}",
        ttrace::check::render_dir_check(&out)
    );
    assert_eq!(out.inferred.len(), 1);
    assert_eq!(
        out.inferred[0].layout.tp,
        ttrace::trace::Placement::split(1)
    );
    assert_eq!(out.inferred[0].fitting, 1);
    assert!(ttrace::check::render_dir_check(&out).contains("layouts inferred from shapes: 1"));
}

/// dp = tp = 2 and both dimensions halved: the shapes fit two layouts (dp on rows and tp on
/// columns, or the reverse); the values settle it — the merged tensor equal to the
/// reference's wins, whichever order the candidates are listed in.
#[test]
fn an_ambiguous_guess_is_settled_by_the_values() {
    let d = tmp("guessed-ambiguous");
    let v: Vec<f64> = (0..64).map(|i| f64::from(i) * 0.5 - 7.0).collect();
    let id = "m|fwd.output.0".to_string();
    write_whole(&d.join("r"), &id, &v, 8, 8);
    let mesh = Mesh::new(2, 1, 2, false).unwrap();
    for (name, rows_by_dp) in [("c-dp-rows", true), ("c-dp-cols", false)] {
        // Rank = dp * tp_size + tp (ttrace's rank order).
        let shards: Vec<Tensor> = (0..4)
            .map(|rank| {
                let (dp, tp) = (rank / 2, rank % 2);
                let (r, c) = if rows_by_dp { (dp, tp) } else { (tp, dp) };
                block(&v, 8, 8, (r, 2), (c, 2))
            })
            .collect();
        let entries = [(id.clone(), Layout::replicated(), shards)];
        write_mesh(&d.join(name), &mesh, &entries);
        mark_guessed(&d.join(name), &id, &[0, 1, 2, 3], &["dp", "tp"], None);
        let out = check_dir_paths(&d.join("r"), &d.join(name), PricingMode::Auto, &|| {}).unwrap();
        assert!(
            out.report.passed(),
            "{name}: {}",
            ttrace::check::render_dir_check(&out)
        );
        let l = out.inferred[0].layout;
        let want = if rows_by_dp { (0, 1) } else { (1, 0) };
        assert_eq!(
            (l.dp, l.tp),
            (
                ttrace::trace::Placement::split(want.0),
                ttrace::trace::Placement::split(want.1)
            ),
            "{name}"
        );
        assert_eq!(out.inferred[0].fitting, 2);
    }
}

/// One rank knew the layout, another only guessed it (a tracer that recognized the tensor on
/// one rank only): the rank that knew settles it, instead of "ranks declare different layouts".
#[test]
fn a_rank_that_knew_the_layout_settles_the_others_guess() {
    let d = tmp("guessed-settled");
    let v: Vec<f64> = (0..32).map(|i| f64::from(i) / 4.0).collect();
    let id = "m|fwd.output.0".to_string();
    write_whole(&d.join("r"), &id, &v, 4, 8);
    let mesh = Mesh::new(2, 1, 1, false).unwrap();
    let split = Layout {
        tp: ttrace::trace::Placement::split(1),
        ..Layout::replicated()
    };
    let shards = vec![
        block(&v, 4, 8, (0, 1), (0, 2)),
        block(&v, 4, 8, (0, 1), (1, 2)),
    ];
    write_trace_dir(
        &d.join("c"),
        &mesh,
        None,
        &[(id.clone(), split, shards)],
        &HashMap::new(),
        &HashMap::new(),
    )
    .unwrap();
    mark_guessed(&d.join("c"), &id, &[1], &["tp"], Some(Layout::replicated()));
    let out = check_dir_paths(&d.join("r"), &d.join("c"), PricingMode::Auto, &|| {}).unwrap();
    assert!(
        out.report.passed(),
        "{}",
        ttrace::check::render_dir_check(&out)
    );
    assert!(out.inferred.is_empty());
    // Two ranks that knew different layouts still disagree: an error.
    mark_guessed(&d.join("c"), &id, &[1], &[], Some(Layout::replicated()));
    match check_dir_paths(&d.join("r"), &d.join("c"), PricingMode::Auto, &|| {}) {
        Err(Error::File { reason, .. }) => {
            assert!(reason.contains("different layouts"), "{reason}")
        }
        other => panic!("expected a file error, got {other:?}"),
    }
}

/// Replicas that differ along a guessed axis are read as partial sums (what a collective not
/// yet done leaves: the gradient of all-gathered keys under context parallelism) — except for
/// a parameter gradient, which nothing later checks: there a missing reduction must fail.
#[test]
fn differing_replicas_along_a_guessed_axis_are_partial_sums_but_not_for_parameters() {
    let d = tmp("guessed-partial");
    let v: Vec<f64> = (0..16).map(|i| f64::from(i) - 4.0).collect();
    let half: Vec<f64> = v.iter().map(|x| (x * 0.25).floor()).collect();
    let rest: Vec<f64> = v.iter().zip(&half).map(|(x, h)| x - h).collect();
    let t = |values: &[f64]| Tensor::from_vec(&[4, 4], values.to_vec(), Format::F32).unwrap();
    let mesh = Mesh::new(1, 2, 1, false).unwrap();
    for (id, passes) in [("m|grad.input.0", true), ("m.weight|param_grad", false)] {
        let name = if passes { "activation" } else { "param" };
        write_single(
            &d.join(format!("r-{name}")),
            &[(id.to_string(), Layout::replicated(), vec![t(&v)])],
        );
        let c = d.join(format!("c-{name}"));
        let entries = [(
            id.to_string(),
            Layout::replicated(),
            vec![t(&half), t(&rest)],
        )];
        write_mesh(&c, &mesh, &entries);
        mark_guessed(&c, id, &[0, 1], &["cp"], None);
        let out =
            check_dir_paths(&d.join(format!("r-{name}")), &c, PricingMode::Auto, &|| {}).unwrap();
        assert_eq!(
            out.report.passed(),
            passes,
            "{}",
            ttrace::check::render_dir_check(&out)
        );
        if passes {
            assert_eq!(out.inferred[0].layout.cp, ttrace::trace::Placement::Partial);
        } else {
            let problem = out.report.verdicts[0].problem.as_deref().unwrap_or("");
            assert!(
                problem.contains("declared replicated along cp"),
                "{problem}"
            );
        }
    }
}

/// A manifest's module information may leave the kind out (generic pricing) and still carry
/// the formats the pricing needs.
#[test]
fn module_information_without_a_kind_is_read() {
    let text = r#"{"format": "ttrace-trace", "version": 1, "mesh": {"tp": 1, "cp": 1, "dp": 1, "sp": false},
        "tensors": [{"id": "m.w|param_grad", "rank": 0, "file": "rank0.safetensors", "dtype": "f32",
                     "layout": {"dp": {"kind": "replicate"}, "cp": {"kind": "replicate"}, "tp": {"kind": "replicate"}},
                     "module": {"combine": "bf16"}, "guessed": ["tp"]}]}"#;
    let m = ttrace::io::Manifest::parse(text, std::path::Path::new("manifest.json")).unwrap();
    let e = &m.tensors[0];
    let module = e.module.as_ref().unwrap();
    assert_eq!(module.kind, None);
    assert_eq!(module.combine, Some(Format::BF16));
    assert_eq!(e.guessed, vec![ttrace::trace::Axis::Tp]);
    let bad = text.replace(r#""guessed": ["tp"]"#, r#""guessed": ["xp"]"#);
    assert!(matches!(
        ttrace::io::Manifest::parse(&bad, std::path::Path::new("manifest.json")),
        Err(Error::File { .. })
    ));
}

/// The Megatron fallback is dtype-aware: a tensor stored in BF16 in an FP32 run was rounded to
/// BF16 at least once, so one BF16 ulp of difference passes (priced at BF16's ε, where the
/// training dtype's would fail it at ~2,000 times the threshold); one stored in FP32 in a BF16
/// run keeps BF16's ε (storage does not say it was computed in FP32).
#[test]
fn the_fallback_is_priced_at_the_coarser_of_training_and_stored_dtypes() {
    let d = tmp("fallback-dtype");
    let ones = vec![1.0; 64];
    let mut one_ulp = ones.clone();
    one_ulp[5] = 1.0 + 2f64.powi(-7);
    let write = |dir: &std::path::Path, recipe: &str, v: &[f64], f: Format| {
        write_trace_dir(
            dir,
            &Mesh::single(),
            Some(recipe),
            &[(
                "weird_tensor".to_string(),
                Layout::replicated(),
                vec![t(v, f)],
            )],
            &HashMap::new(),
            &HashMap::new(),
        )
        .unwrap()
    };
    let run = |recipe: &str, f: Format, cand: &[f64]| {
        write(&d.join("r"), recipe, &ones, f);
        write(&d.join("c"), recipe, cand, f);
        let out = check_dir_paths(&d.join("r"), &d.join("c"), PricingMode::Local, &|| {}).unwrap();
        assert_eq!(out.pricing, vec![ttrace::check::Pricing::Megatron]);
        out.report.verdicts[0].clone()
    };
    // FP32 run, BF16 tensor: threshold 4·1.03·2⁻⁷ relative (‖ref‖ = 8) against a difference
    // of 2⁻⁷/8.
    let v = run("fp32", Format::BF16, &one_ulp);
    let bf16 = 4.0 * 1.03 * 2f64.powi(-7);
    assert!(v.passed, "{v:?}");
    assert!((v.threshold - bf16).abs() <= 1e-12 * bf16, "{v:?}");
    // BF16 run, FP32 tensor: BF16's ε all the same; an element off by 0.5 fails.
    let v = run("bf16", Format::F32, &one_ulp);
    assert!((v.threshold - bf16).abs() <= 1e-12 * bf16, "{v:?}");
    let mut far = ones.clone();
    far[5] = 1.0 + 0.5;
    assert!(!run("bf16", Format::F32, &far).passed);
    // FP32 run, FP32 tensor: FP32's ε, and one BF16 ulp fails.
    let v = run("fp32", Format::F32, &one_ulp);
    assert!(
        !v.passed && (v.threshold - bf16 * 2f64.powi(-16)).abs() <= 1e-12 * bf16,
        "{v:?}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// Differences whose squares underflow are not lost: a candidate differing from the reference
/// only by subnormal amounts, or in a tensor of magnitude 1e-170 (every square below the
/// smallest `f64`), fails a zero threshold and reports its relative error — checked against
/// the same norms computed on the values scaled by 2^600 (exact for these magnitudes).
#[test]
fn differences_whose_squares_underflow_are_measured() {
    let exact = |r: &[f64], c: &[f64]| {
        let k = 2f64.powi(600);
        let dn = r
            .iter()
            .zip(c)
            .map(|(a, b)| ((b - a) * k).powi(2))
            .sum::<f64>()
            .sqrt();
        let rn = r.iter().map(|a| (a * k).powi(2)).sum::<f64>().sqrt();
        dn / rn
    };
    let sub: Vec<f64> = (0..512).map(|i| i as f64 * 1e-310).collect();
    let mut sub_c = sub.clone();
    sub_c[7] = 3e-310;
    sub_c[300] = sub[300] + 5e-324;
    let tiny: Vec<f64> = (0..512).map(|i| (1.0 + i as f64) * 1e-170).collect();
    let tiny_c: Vec<f64> = tiny.iter().map(|x| x * (1.0 + 1e-3)).collect();
    for (r, c) in [(&sub, &sub_c), (&tiny, &tiny_c)] {
        let v = compare_tensor(
            "x",
            &Tensor::from_vec(&[64, 8], r.clone(), Format::F64).unwrap(),
            &Tensor::from_vec(&[64, 8], c.clone(), Format::F64).unwrap(),
            0.0,
            1.0,
        );
        assert!(!v.passed, "{v:?}");
        let want = exact(r, c);
        assert!(
            (v.rel_error - want).abs() <= 1e-12 * want,
            "{} against {want}",
            v.rel_error
        );
    }
    // The overflow side: a difference beyond the largest f64 is an infinite norm, never a pass.
    let (mut r, mut c) = (vec![1.0; 16], vec![1.0; 16]);
    r[3] = 1e308;
    c[3] = -1e308;
    let v = compare_tensor("x", &t(&r, Format::F64), &t(&c, Format::F64), f64::MAX, 1.0);
    assert!(!v.passed && v.rel_error.is_infinite(), "{v:?}");
}

// ---- Biased rounding: reductions accumulated below FP32 ----------------------------------------

/// A [256, 256] × [256, 64] matmul of positive operands rounded to BF16, accumulated in `acc`
/// with output in `out`: sequentially (the reference) and pairwise (the candidate). Both are
/// correct arithmetic.
fn positive_matmul(acc: Format, out: Format) -> (Tensor, Tensor) {
    let (rows, k, cols) = (256, 256, 64);
    let mut g = ttrace::engine::SplitMix64::for_name("positive", 7);
    let mut draw = |n: usize| -> Vec<f64> {
        (0..n)
            .map(|_| Format::BF16.round(g.uniform(), Overflow::Saturating))
            .collect()
    };
    let a = Tensor::from_vec(&[rows, k], draw(rows * k), Format::BF16).unwrap();
    let b = Tensor::from_vec(&[k, cols], draw(k * cols), Format::BF16).unwrap();
    let p = Policy::new(Format::BF16, acc, out);
    let r = matmul(&a, &b, &p).unwrap();
    let c = matmul(&a, &b, &p.with_order(ttrace::Order::Pairwise { base: 8 })).unwrap();
    (r, c)
}

fn systematic(v: &ttrace::check::TensorVerdict) -> Vec<Detector> {
    v.findings
        .iter()
        .map(|f| f.detector)
        .filter(|d| matches!(d, Detector::Scale | Detector::Bias))
        .collect()
}

#[test]
fn accumulation_below_fp32_rounds_one_way_and_has_no_systematic_test() {
    let id = "layers.0.fc1|fwd.output.0";
    // In BF16 the long positive sums stagnate (terms below half an ulp of the running sum are
    // lost): the two orders differ in one direction, and the symmetric model of the scale and
    // bias tests does not hold — they fire on correct arithmetic.
    let (r, c) = positive_matmul(Format::BF16, Format::BF16);
    let eps = Format::BF16.machine_epsilon();
    // A norm threshold far above the difference (2.8%) but below the reference's own norm
    // (at which any scale would be allowed).
    let norm = |t: &Tensor| t.values().iter().map(|x| x * x).sum::<f64>().sqrt();
    let th = 0.5 * norm(&r);
    let v = compare_tensor_with(id, &r, &c, th, eps, Detection::default());
    assert_eq!(v.fired(), vec![Detector::Scale, Detector::Bias], "{v:?}");
    let d = v
        .findings
        .iter()
        .find(|f| f.detector == Detector::Bias)
        .unwrap();
    assert!(d.estimate > 0.0 && d.ratio > 1.0, "{d:?}");
    // Told the accumulation, the check keeps the norm and the sparse test only.
    let off = Detection::default().accumulated_in(Format::BF16);
    let v = compare_tensor_with(id, &r, &c, th, eps, off);
    assert!(v.passed && systematic(&v).is_empty(), "{v:?}");
    assert!(v.findings.iter().any(|f| f.detector == Detector::Sparse));
    // Accumulated in FP32, the same operands round symmetrically: both tests apply and hold.
    let (r, c) = positive_matmul(Format::F32, Format::F32);
    let on = Detection::default().accumulated_in(Format::F32);
    let th = 0.5 * norm(&r);
    let v = compare_tensor_with(id, &r, &c, th, Format::F32.machine_epsilon(), on);
    assert_ne!(r.values(), c.values());
    assert!(v.passed, "{v:?}");
    assert_eq!(systematic(&v), vec![Detector::Scale, Detector::Bias]);
}

#[test]
fn a_trace_that_declares_an_accumulation_below_fp32_is_checked_without_systematic_tests() {
    let id = "layers.0.fc1|fwd.output.0".to_string();
    let (r, c) = positive_matmul(Format::BF16, Format::BF16);
    let kinds: HashMap<String, ttrace::trace::ModuleKind> =
        [(id.clone(), ttrace::trace::ModuleKind::Linear)].into();
    // A producer threshold far above the difference (2.8%) but below the reference's norm:
    // only the tests beyond the norm can fire.
    let rn = r.values().iter().map(|x| x * x).sum::<f64>().sqrt();
    let threshold: HashMap<String, f64> = [(id.clone(), 0.5 * rn)].into();
    let write = |dir: &std::path::Path, t: &Tensor, recipe: Option<&str>| {
        let entries = [(id.clone(), Layout::replicated(), vec![t.clone()])];
        write_trace_dir(dir, &Mesh::single(), recipe, &entries, &kinds, &threshold).unwrap();
    };
    let verdict = |d: &std::path::Path| {
        let out = check_dir_paths(&d.join("r"), &d.join("c"), PricingMode::Auto, &|| {}).unwrap();
        out.report.verdicts[0].clone()
    };
    // Nothing declared: FP32 accumulation is assumed, and the stagnation reads as a bias.
    let d = tmp("acc-undeclared");
    write(&d.join("r"), &r, None);
    write(&d.join("c"), &c, None);
    let v = verdict(&d);
    assert!(!v.passed && v.fired().contains(&Detector::Bias), "{v:?}");
    // The candidate's module declares BF16 accumulation: no scale or bias test.
    let path = d.join("c").join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for e in m["tensors"].as_array_mut().unwrap() {
        e["module"]["accumulate"] = serde_json::json!("bf16");
    }
    std::fs::write(&path, serde_json::to_string(&m).unwrap()).unwrap();
    let v = verdict(&d);
    assert!(v.passed && systematic(&v).is_empty(), "{v:?}");
    // Likewise a recipe that accumulates in BF16.
    let d = tmp("acc-recipe");
    write(&d.join("r"), &r, Some("uniform-bf16"));
    write(&d.join("c"), &c, Some("uniform-bf16"));
    let v = verdict(&d);
    assert!(v.passed && systematic(&v).is_empty(), "{v:?}");
}
