//! Trace directories: atomic and reproducible reports, file errors, dtypes that differ, untraced gaps, guessed layouts, module information.

use super::*;

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
    let tp2 = Mesh::megatron(2, 1, 1, false).unwrap();
    let mut split = Layout::replicated();
    split.set(Axis::TP, ttrace::trace::Placement::split(1));
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
        ce.push((id, split.clone(), shards));
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
            if let Some(l) = &layout {
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
    let mesh = Mesh::megatron(2, 1, 1, false).unwrap();
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
        out.inferred[0].layout.along(&Axis::TP),
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
    let mesh = Mesh::megatron(2, 1, 2, false).unwrap();
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
        let l = &out.inferred[0].layout;
        let want = if rows_by_dp { (0, 1) } else { (1, 0) };
        assert_eq!(
            (l.along(&Axis::DP), l.along(&Axis::TP)),
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
    let mesh = Mesh::megatron(2, 1, 1, false).unwrap();
    let split = Layout::replicated().with(Axis::TP, ttrace::trace::Placement::split(1));
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
    let mesh = Mesh::megatron(1, 2, 1, false).unwrap();
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
            assert_eq!(
                out.inferred[0].layout.along(&Axis::CP),
                ttrace::trace::Placement::Partial
            );
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
    assert_eq!(e.guessed, vec![ttrace::trace::Axis::TP]);
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
