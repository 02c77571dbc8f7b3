//! Summary traces (`papers/summaries.md`): the format's reader and writer, the merge of shards
//! into the logical tensor's statistics, and the comparison's lower bounds — each lower bound
//! checked against ‖c − r‖ computed from the tensors themselves.

use std::path::Path;

use proptest::prelude::*;
use ttrace::check::{compare_summaries, Proof, SummaryThresholds};
use ttrace::io::summary::{append_summary, Summary, SummaryEntry, SummaryRun, SummaryStep};
use ttrace::trace::{Layout, Mesh, Placement};
use ttrace::{Error, Format};

/// A fresh directory, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> Scratch {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "ttrace-summaries-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The statistics of `x` computed plainly (the oracle's own code: sequential f64 sums, a full
/// sort for the extremes).
fn summarize_oracle(x: &[f64], k: usize) -> Summary {
    let finite: Vec<f64> = x.iter().copied().filter(|v| v.is_finite()).collect();
    let mut sorted = finite.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let kk = k.min(sorted.len());
    Summary {
        nan: x.iter().filter(|v| v.is_nan()).count() as u64,
        pinf: x.iter().filter(|&&v| v == f64::INFINITY).count() as u64,
        ninf: x.iter().filter(|&&v| v == f64::NEG_INFINITY).count() as u64,
        sum: finite.iter().sum(),
        sum_sq: finite.iter().map(|v| v * v).sum(),
        sum_abs: finite.iter().map(|v| v.abs()).sum(),
        k,
        top: sorted.iter().rev().take(kk).copied().collect(),
        bottom: sorted.iter().take(kk).copied().collect(),
    }
}

fn entry(id: &str, shape: Vec<usize>, layout: &Layout, x: &[f64], k: usize) -> SummaryEntry {
    SummaryEntry {
        id: id.into(),
        dtype: Format::F32,
        shape,
        layout: layout.clone(),
        guessed: vec![],
        module: None,
        summary: summarize_oracle(x, k),
    }
}

fn line(step: u64, rank: usize, mesh: &Mesh, tensors: Vec<SummaryEntry>) -> SummaryStep {
    SummaryStep {
        format: "ttrace-summaries".into(),
        version: 1,
        step,
        rank,
        mesh: mesh.clone(),
        tensors,
    }
}

/// A one-rank summary trace of `tensors` (id, values) at each step of `steps`.
fn single(dir: &Path, steps: &[u64], tensors: &[(&str, Vec<f64>)], k: usize) {
    for &s in steps {
        let es = tensors
            .iter()
            .map(|(id, x)| entry(id, vec![x.len()], &Layout::replicated(), x, k))
            .collect();
        append_summary(dir, &line(s, 0, &Mesh::single(), es), false).unwrap();
    }
}

fn compare(r: &Path, c: &Path, rtol: Option<f64>) -> ttrace::Result<ttrace::check::SummaryCheck> {
    let t = SummaryThresholds {
        rtol,
        ..Default::default()
    };
    compare_summaries(&mut SummaryRun::open(r)?, &mut SummaryRun::open(c)?, &t)
}

/// ‖c − r‖₂ of two tensors (f64; its rounding is far below the 1e-12 the tests allow).
fn diff(r: &[f64], c: &[f64]) -> f64 {
    r.iter()
        .zip(c)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f64>()
        .sqrt()
}

fn bound_of(r: &[f64], c: &[f64], k: usize) -> (f64, &'static str) {
    let dir = Scratch::new();
    let (rd, cd) = (dir.path().join("r"), dir.path().join("c"));
    single(&rd, &[0], &[("t", r.to_vec())], k);
    single(&cd, &[0], &[("t", c.to_vec())], k);
    let out = compare(&rd, &cd, None).unwrap();
    let b = out.steps[0].largest.clone().unwrap();
    (b.lower, b.by)
}

fn values(seed: u64, n: usize, scale: f64, offset: f64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 11) as f64 / (1u64 << 53) as f64;
            // f32 values: their differences and squares are exact in f64 at these scales.
            (offset + scale * (2.0 * u - 1.0)) as f32 as f64
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The lower bound never exceeds ‖c − r‖, whatever the difference: a perturbation, a
    /// shift, a scaling, a permutation, or unrelated data.
    #[test]
    fn lower_bound_never_exceeds_the_difference(
        seed in any::<u64>(),
        n in 1usize..300,
        kind in 0u8..5,
        scale in -6i32..6,
        offset in -2.0f64..2.0,
        k in 1usize..12,
    ) {
        let sc = 2f64.powi(scale);
        let r = values(seed, n, sc, offset * sc);
        let c: Vec<f64> = match kind {
            0 => r.iter().zip(values(seed ^ 1, n, sc * 1e-3, 0.0)).map(|(a, b)| ((a + b) as f32) as f64).collect(),
            1 => r.iter().map(|a| ((a + sc * 0.01) as f32) as f64).collect(),
            2 => r.iter().map(|a| ((a * 1.001) as f32) as f64).collect(),
            3 => { let mut c = r.clone(); c.reverse(); c }
            _ => values(seed ^ 7, n, sc, 0.0),
        };
        let (lower, by) = bound_of(&r, &c, k);
        let d = diff(&r, &c);
        prop_assert!(lower <= d * (1.0 + 1e-12), "{by}: {lower} > ‖D‖ = {d}");
    }
}

/// Where a statistic sees the whole difference, the bound is close to ‖D‖: a scaling (the
/// norm), a shift (the spread), a change of the largest element (the extremes).
#[test]
fn lower_bound_is_tight_where_a_statistic_sees_the_difference() {
    let r = values(3, 4096, 1.0, 0.0);
    let scaled: Vec<f64> = r.iter().map(|a| a * 1.25).collect();
    let shifted: Vec<f64> = r.iter().map(|a| a + 0.5).collect();
    let mut spiked = r.clone();
    let top = (0..r.len()).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap();
    spiked[top] += 3.0;
    for (c, name) in [
        (&scaled, "scaled"),
        (&shifted, "shifted"),
        (&spiked, "spiked"),
    ] {
        let (lower, by) = bound_of(&r, c, 8);
        let d = diff(&r, c);
        assert!(
            lower >= 0.999 * d && lower <= d * (1.0 + 1e-12),
            "{name}: {lower} by {by} against ‖D‖ = {d}"
        );
    }
    // The same multiset in another order: nothing provable, the bound 0.
    let mut perm = r.clone();
    perm.rotate_left(17);
    assert_eq!(bound_of(&r, &perm, 8).0, 0.0);
}

/// A reference on one rank against a candidate split over TP 2 and replicated over DP 2:
/// the merged statistics equal the logical tensor's (a zero bound for the same data), and
/// one changed element is proven beyond a threshold it exceeds.
#[test]
fn shards_merge_into_the_logical_tensor() {
    let dir = Scratch::new();
    let (rd, cd, bd) = (
        dir.path().join("r"),
        dir.path().join("c"),
        dir.path().join("bug"),
    );
    // Logical [4, 6], split along dim 1 over tp.
    let logical = values(11, 24, 1.0, 0.3);
    for step in [0, 1] {
        let e = entry("x", vec![4, 6], &Layout::replicated(), &logical, 4);
        append_summary(&rd, &line(step, 0, &Mesh::single(), vec![e]), false).unwrap();
    }
    let mesh = Mesh::megatron(2, 1, 2, false).unwrap();
    let layout = Layout::replicated().with(ttrace::trace::Axis::TP, Placement::split(1));
    let shard = |x: &[f64], tp: usize| -> Vec<f64> {
        (0..4)
            .flat_map(|row| x[row * 6 + tp * 3..row * 6 + tp * 3 + 3].to_vec())
            .collect()
    };
    let mut bad = logical.clone();
    bad[7] += 0.75;
    for (d, x) in [(&cd, &logical), (&bd, &bad)] {
        for step in [0, 1] {
            for rank in 0..4 {
                let tp = mesh.coord(rank, &ttrace::trace::Axis::TP);
                let e = entry("x", vec![4, 3], &layout, &shard(x, tp), 4);
                append_summary(d, &line(step, rank, &mesh, vec![e]), false).unwrap();
            }
        }
    }
    let same = compare(&rd, &cd, Some(1e-6)).unwrap();
    assert_eq!(same.steps.len(), 2);
    assert_eq!(same.proven(), 0);
    assert_eq!(same.steps[0].largest.as_ref().unwrap().lower, 0.0);
    let out = compare(&rd, &bd, Some(1e-6)).unwrap();
    assert_eq!(out.proven(), 2, "{out:?}");
    let b = out.first_proven().unwrap().1;
    assert!(b.lower > 0.0 && b.lower <= 0.75 * (1.0 + 1e-12), "{b:?}");
    assert_eq!(b.proof, Some(Proof::BeyondThreshold));
    // Without a threshold nothing is proven, the bound is still reported.
    let loose = compare(&rd, &bd, None).unwrap();
    assert_eq!(loose.proven(), 0);
    assert!(loose.steps[0].largest.as_ref().unwrap().lower > 0.0);
    assert!(
        ttrace::check::render_summary_check(&loose).contains("NO DIFFERENCE PROVEN — not a pass")
    );
}

/// Replicas whose statistics differ, NaN counts that differ: proven without any threshold.
/// A partial sum cannot be merged; a comparison in which nothing could be compared is an
/// error, never a report.
#[test]
fn replicas_nonfinite_and_partial_sums() {
    let dir = Scratch::new();
    let x = values(5, 8, 1.0, 0.0);
    let rd = dir.path().join("r");
    single(&rd, &[0], &[("a", x.clone()), ("p", x.clone())], 2);
    let cd = dir.path().join("c");
    let mesh = Mesh::megatron(2, 1, 1, false).unwrap();
    let partial = Layout::replicated().with(ttrace::trace::Axis::TP, Placement::Partial);
    for rank in 0..2 {
        let mut a = x.clone();
        if rank == 1 {
            a[0] = f64::NAN; // the second replica differs
        }
        let es = vec![
            entry("a", vec![8], &Layout::replicated(), &a, 2),
            entry("p", vec![8], &partial, &x, 2),
        ];
        append_summary(&cd, &line(0, rank, &mesh, es), false).unwrap();
    }
    let out = compare(&rd, &cd, None).unwrap();
    let p = &out.steps[0];
    assert!(matches!(
        &p.proven[0].proof,
        Some(Proof::ReplicasDisagree {
            run: "candidate",
            axis,
            rank: 1
        }) if axis == "tp"
    ));
    assert_eq!(p.not_comparable.len(), 1);
    assert!(p.not_comparable[0].1.contains("partial sum"));

    let nd = dir.path().join("nan");
    let mut y = x.clone();
    y[3] = f64::NAN;
    single(&nd, &[0], &[("a", y)], 2);
    let out = compare(&rd, &nd, None).unwrap();
    assert!(matches!(
        out.steps[0].proven[0].proof,
        Some(Proof::NonFinite { .. })
    ));

    let pd = dir.path().join("only_partial");
    for rank in 0..2 {
        let e = entry("a", vec![8], &partial, &x, 2);
        append_summary(&pd, &line(0, rank, &mesh, vec![e]), false).unwrap();
    }
    let e = compare(&rd, &pd, None).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidParameter {
                name: "summaries",
                ..
            }
        ),
        "{e}"
    );
    // No step in common: an error too.
    let later = dir.path().join("later");
    single(&later, &[5], &[("a", x.clone())], 2);
    assert!(matches!(
        compare(&rd, &later, None).unwrap_err(),
        Error::InvalidParameter {
            name: "summaries",
            ..
        }
    ));
}

/// A writer that stopped mid-line leaves a torn last line: the reader leaves it out with a
/// note, the next append cuts it off; a step that does not follow the last is refused by the
/// writer and by the reader; a key named twice and inconsistent statistics are refused.
#[test]
fn torn_lines_step_order_and_malformed_lines() {
    use std::io::Write;
    let dir = Scratch::new();
    let d = dir.path().join("s");
    let x = values(9, 16, 1.0, 0.0);
    single(&d, &[0, 1], &[("a", x.clone())], 3);
    let file = d.join("summaries.rank0.jsonl");
    let whole = std::fs::read(&file).unwrap();
    std::fs::OpenOptions::new()
        .append(true)
        .open(&file)
        .unwrap()
        .write_all(&whole[..40])
        .unwrap();
    let mut run = SummaryRun::open(&d).unwrap();
    let mut steps = 0;
    while run.next_step().unwrap().is_some() {
        steps += 1;
    }
    assert_eq!(steps, 2);
    assert!(run.notes[0].contains("incomplete"), "{:?}", run.notes);
    // Appending step 2 cuts the torn line off first.
    single(&d, &[2], &[("a", x.clone())], 3);
    let text = std::fs::read_to_string(&file).unwrap();
    assert_eq!(text.lines().count(), 3);
    assert!(text.ends_with('\n'));
    // Step 2 again: refused, the file untouched.
    let e = append_summary(
        &d,
        &line(
            2,
            0,
            &Mesh::single(),
            vec![entry("a", vec![16], &Layout::replicated(), &x, 3)],
        ),
        false,
    )
    .unwrap_err();
    assert!(
        matches!(e, Error::InvalidParameter { name: "step", .. }),
        "{e}"
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), text);

    let good = String::from_utf8(whole).unwrap();
    let first = good.lines().next().unwrap();
    let bad_lines = [
        first.replacen("\"step\":0", "\"step\":0,\"step\":0", 1),
        first.replacen("\"nan\":0", "\"nan\":99", 1),
        first.replacen("\"k\":3", "\"k\":2", 1),
        first.replacen("\"version\":1", "\"version\":2", 1),
    ];
    for (i, bad) in bad_lines.iter().enumerate() {
        assert_ne!(bad, first, "case {i} did not change the line");
        let d = dir.path().join(format!("bad{i}"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("summaries.rank0.jsonl"), format!("{bad}\n")).unwrap();
        let e = SummaryRun::open(&d).unwrap().next_step().unwrap_err();
        assert!(matches!(e, Error::File { .. }), "case {i}: {e}");
    }
    // Out of order in a file written by hand.
    let d2 = dir.path().join("order");
    std::fs::create_dir_all(&d2).unwrap();
    let second = good.lines().nth(1).unwrap();
    std::fs::write(
        d2.join("summaries.rank0.jsonl"),
        format!("{second}\n{first}\n"),
    )
    .unwrap();
    let mut run = SummaryRun::open(&d2).unwrap();
    run.next_step().unwrap();
    assert!(matches!(run.next_step().unwrap_err(), Error::File { .. }));
}

/// Per-tensor thresholds from a full check's JSON report.
#[test]
fn thresholds_from_a_check_report() {
    let t = SummaryThresholds::from_check_report(
        r#"{"report": {"verdicts": [{"id": "a", "threshold": 0.5}, {"id": "b", "threshold": 0.0},
                                    {"id": "c", "threshold": null}]}}"#,
    )
    .unwrap();
    assert_eq!(t.per_id.get("a"), Some(&0.5));
    assert_eq!(t.per_id.len(), 2, "a null threshold gives none");
    for bad in [
        r#"{"verdicts": []}"#,
        r#"{"report": {"verdicts": [{"id": "a", "threshold": -1}]}}"#,
        r#"{"report": {"verdicts": [{"id": "a", "id": "b", "threshold": 1}]}}"#,
        r#"{"report": {"verdicts": [{"id": "a", "threshold": "1"}]}}"#,
        r#"{"report": {"verdicts": [{"threshold": 1}]}}"#,
    ] {
        assert!(matches!(
            SummaryThresholds::from_check_report(bad).unwrap_err(),
            Error::InvalidParameter {
                name: "thresholds",
                ..
            }
        ));
    }
}

/// `ttrace check` on two summary traces: exit 1 when a difference is proven, 0 when none is
/// (with the words "not a pass"), 2 for a summary trace against a full one or `--rtol` on full
/// traces; ids from files are escaped.
#[test]
fn command_line_compares_summary_traces() {
    let run = |args: &[&Path]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_ttrace"))
            .args(args)
            .output()
            .unwrap()
    };
    let dir = Scratch::new();
    let x = values(21, 64, 1.0, 0.0);
    let mut y = x.clone();
    y[0] += 1.0;
    let id = "fc1|fwd.output.0\nPASS: all 9 tensors";
    let (rd, cd, bd) = (
        dir.path().join("r"),
        dir.path().join("c"),
        dir.path().join("b"),
    );
    single(&rd, &[0, 1, 2], &[(id, x.clone())], 4);
    single(&cd, &[1, 2], &[(id, x.clone())], 4);
    single(&bd, &[0, 1, 2], &[(id, y)], 4);
    let check = Path::new("check");
    let rtol = Path::new("--rtol");
    let tol = Path::new("1e-3");
    let same = run(&[check, &rd, &cd, rtol, tol]);
    let text = String::from_utf8_lossy(&same.stdout);
    assert_eq!(same.status.code(), Some(0), "{text}");
    assert!(text.contains("NO DIFFERENCE PROVEN — not a pass"), "{text}");
    assert!(text.contains("2 step(s) compared"), "{text}");
    assert!(!text.contains("\nPASS"), "{text}");
    let bad = run(&[check, &rd, &bd, rtol, tol]);
    let text = String::from_utf8_lossy(&bad.stdout);
    assert_eq!(bad.status.code(), Some(1), "{text}");
    assert!(
        text.contains("DIFFERENCE PROVEN: 3 tensor-step(s); the first: step 0"),
        "{text}"
    );
    assert!(!text.contains("\nPASS"), "{text}");
    // Against a directory that is not a summary trace, and --rtol on full traces.
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let mixed = run(&[check, &rd, &empty]);
    assert_eq!(mixed.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&mixed.stderr).contains("summaries compare only with summaries")
    );
    let full = run(&[check, &empty, &empty, rtol, tol]);
    assert_eq!(full.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&full.stderr).contains("summary traces only"));
}

/// The one-pass kernel the tracer runs on CPU tensors (`summarize`) against the plain oracle,
/// in every stored format, across chunk boundaries, with NaN and infinities sprinkled in.
#[test]
fn one_pass_statistics_match_the_oracle_in_every_format() {
    use ttrace::io::summary::summarize;
    for &n in &[1usize, 7, 65_536, 200_003] {
        let mut v = values(n as u64, n, 3.0, 0.25);
        for i in (0..n).step_by(9_973) {
            v[i] = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY][i % 3];
        }
        for format in [
            Format::F32,
            Format::BF16,
            Format::F16,
            Format::F64,
            Format::E4M3,
        ] {
            let x: Vec<f64> = v
                .iter()
                .map(|&a| format.round(a, ttrace::Overflow::NonSaturating))
                .collect();
            let bytes: Vec<u8> = match format {
                Format::F64 => x.iter().flat_map(|a| a.to_le_bytes()).collect(),
                Format::F32 => x.iter().flat_map(|&a| (a as f32).to_le_bytes()).collect(),
                Format::BF16 => x
                    .iter()
                    .flat_map(|&a| (((a as f32).to_bits() >> 16) as u16).to_le_bytes())
                    .collect(),
                Format::F16 => x
                    .iter()
                    .flat_map(|&a| half::f16::from_f64(a).to_bits().to_le_bytes())
                    .collect(),
                _ => x.iter().map(|&a| format.encode(a).unwrap() as u8).collect(),
            };
            let got = summarize(&bytes, format, 5).unwrap();
            let want = summarize_oracle(&x, 5);
            assert_eq!(
                (got.nan, got.pinf, got.ninf, &got.top, &got.bottom),
                (want.nan, want.pinf, want.ninf, &want.top, &want.bottom),
                "{format} n = {n}"
            );
            let slack = n as f64 * 2f64.powi(-52);
            assert!(
                (got.sum - want.sum).abs() <= slack * want.sum_abs,
                "{format}"
            );
            assert!(
                (got.sum_sq - want.sum_sq).abs() <= slack * want.sum_sq,
                "{format}"
            );
            assert!(
                (got.sum_abs - want.sum_abs).abs() <= slack * want.sum_abs,
                "{format}"
            );
        }
    }
    assert!(matches!(
        summarize(&[0u8; 3], Format::F32, 4).unwrap_err(),
        Error::InvalidParameter { name: "bytes", .. }
    ));
    assert!(matches!(
        summarize(&[0u8; 4], Format::F32, 0).unwrap_err(),
        Error::InvalidParameter { name: "k", .. }
    ));
}

/// Shapes no tensor could have (a hostile file): a merged shape or element count that
/// overflows is not compared, and a claimed 2⁶⁰ elements proves nothing from identical
/// statistics — never a panic, never a difference that is not there.
#[test]
fn impossible_shapes_are_not_compared_and_prove_nothing() {
    let dir = Scratch::new();
    let x = values(4, 16, 1.0, 0.0);
    let huge = |shape: Vec<usize>, layout: Layout| {
        let mut e = entry("a", shape, &layout, &x, 4);
        e.id = "a".into();
        e
    };
    let rd = dir.path().join("r");
    let big = 1usize << 60;
    append_summary(
        &rd,
        &line(
            0,
            0,
            &Mesh::single(),
            vec![huge(vec![big], Layout::replicated())],
        ),
        false,
    )
    .unwrap();
    let rd2 = dir.path().join("r2");
    append_summary(
        &rd2,
        &line(
            0,
            0,
            &Mesh::single(),
            vec![huge(vec![big], Layout::replicated())],
        ),
        false,
    )
    .unwrap();
    let same = compare(&rd, &rd2, Some(0.0)).unwrap();
    assert_eq!(same.proven(), 0, "{same:?}");
    // One directory twice: refused, as a full check refuses it.
    assert!(matches!(
        compare(&rd, &rd, None).unwrap_err(),
        Error::InvalidParameter {
            name: "candidate",
            ..
        }
    ));
    let cd = dir.path().join("c");
    let mesh = Mesh::megatron(2, 1, 1, false).unwrap();
    let split = Layout::replicated().with(ttrace::trace::Axis::TP, Placement::split(0));
    for rank in 0..2 {
        let e = huge(vec![usize::MAX / 2 + 1], split.clone());
        append_summary(&cd, &line(0, rank, &mesh, vec![e]), false).unwrap();
    }
    let e = compare(&rd, &cd, Some(0.0)).unwrap_err();
    assert!(e.to_string().contains("overflows"), "{e}");
}
