//! A candidate traced under data parallelism whose loss normalization the tracer did not know
//! (`"dp_loss": "auto"`): the checker settles it from the reference. Oracle: the candidate's
//! gradient shards are built from the reference's by a known factor — 2 (each of the two
//! ranks averaged its own half of the batch), 1 (normalized by the global count) or another
//! (a wrong normalization, which must fail).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ttrace::check::{check_dir_paths, PricingMode};
use ttrace::io::write_trace_dir;
use ttrace::trace::{Axis, Layout, Mesh, Placement};
use ttrace::{Format, Tensor};

fn tensor(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut g = ttrace::engine::SplitMix64::for_name("loss", seed);
    let v = (0..n)
        .map(|_| Format::F32.round(4.0 * g.uniform() - 2.0, ttrace::Overflow::Saturating))
        .collect();
    Tensor::from_vec(shape, v, Format::F32).unwrap()
}

fn scaled(t: &Tensor, k: f64) -> Tensor {
    let v = t
        .values()
        .iter()
        .map(|x| Format::F32.round(x * k, ttrace::Overflow::Saturating));
    Tensor::from_vec(t.shape(), v.collect(), Format::F32).unwrap()
}

/// Reference (one rank) and candidate (dp = 2) trace directories of a forward activation and
/// two activation gradients, the candidate's gradients `factor` times the reference's; `auto`
/// marks the candidate's normalization as unknown.
fn traces(dir: &Path, factor: f64, auto: bool) -> (PathBuf, PathBuf) {
    traces_on(dir, factor, auto, Mesh::megatron(1, 1, 2, false).unwrap())
}

/// [`traces`] on `mesh`: the batch (dim 0) split along dp, the sequence (dim 1) cut into
/// context parallelism's load-balanced chunks along cp.
fn traces_on(dir: &Path, factor: f64, auto: bool, mesh: Mesh) -> (PathBuf, PathBuf) {
    let (x, g1, g2) = (tensor(&[4, 8], 1), tensor(&[4, 8], 2), tensor(&[4, 8], 3));
    let ids = ["m|fwd.output.0", "m|grad.output.0", "m|grad.input.0"];
    let mut split = Layout::replicated();
    split.set(Axis::DP, Placement::split(0));
    split.set(Axis::CP, Placement::CpChunks { dim: 1 });
    let none = HashMap::new();
    let (r, c) = (dir.join("reference"), dir.join("candidate"));
    let whole: Vec<_> = ids
        .iter()
        .zip([&x, &g1, &g2])
        .map(|(id, t)| (id.to_string(), Layout::replicated(), vec![t.clone()]))
        .collect();
    write_trace_dir(&r, &Mesh::single(), None, &whole, &HashMap::new(), &none).unwrap();
    let sharded: Vec<_> = ids
        .iter()
        .zip([x, scaled(&g1, factor), scaled(&g2, factor)])
        .map(|(id, t)| {
            let shards = ttrace::trace::shard(&t, &split, &mesh, id).unwrap();
            (id.to_string(), split.clone(), shards)
        })
        .collect();
    write_trace_dir(&c, &mesh, None, &sharded, &HashMap::new(), &none).unwrap();
    if auto {
        let m = c.join("manifest.json");
        let text = std::fs::read_to_string(&m).unwrap();
        let version = format!("\"version\": {},", ttrace::io::VERSION);
        let text = text.replacen(&version, &format!("{version}\n  \"dp_loss\": \"auto\","), 1);
        std::fs::write(&m, text).unwrap();
    }
    (r, c)
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ttrace-loss-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn per_rank_means_are_read_divided_by_dp() {
    let d = temp("local");
    let (r, c) = traces(&d, 2.0, true);
    let check = check_dir_paths(&r, &c, PricingMode::Auto, &|| {}).unwrap();
    let loss = check.loss.as_ref().expect("settled");
    assert!(loss.local_mean);
    assert_eq!(loss.dp, 2);
    assert_eq!(loss.tensors, ["m|grad.output.0", "m|grad.input.0"]);
    // Doubling and halving an FP32 value is exact: nothing is left of the difference.
    assert_eq!(loss.error_local, 0.0);
    assert!((loss.error_global - 1.0).abs() < 1e-12);
    assert_eq!(check.report.failures, 0, "{:?}", check.report);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_globally_normalized_loss_is_read_as_stored() {
    let d = temp("global");
    let (r, c) = traces(&d, 1.0, true);
    let check = check_dir_paths(&r, &c, PricingMode::Auto, &|| {}).unwrap();
    let loss = check.loss.as_ref().expect("settled");
    assert!(!loss.local_mean);
    assert_eq!(loss.error_global, 0.0);
    assert_eq!(check.report.failures, 0);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn any_other_factor_fails_at_the_first_gradient() {
    let d = temp("wrong");
    let (r, c) = traces(&d, 1.5, true);
    let check = check_dir_paths(&r, &c, PricingMode::Auto, &|| {}).unwrap();
    // (The second gradient is judged against the first's difference: it passes on it.)
    assert!(check.report.failures >= 1);
    assert_eq!(
        check.report.first_failure.as_deref(),
        Some("m|grad.output.0")
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_stated_normalization_is_not_second_guessed() {
    // Without "dp_loss": "auto" the trace says its gradients are the reference's: per-rank
    // means recorded undivided are a finding, not a normalization to settle.
    let d = temp("stated");
    let (r, c) = traces(&d, 2.0, false);
    let check = check_dir_paths(&r, &c, PricingMode::Auto, &|| {}).unwrap();
    assert!(check.loss.is_none());
    assert_eq!(
        check.report.first_failure.as_deref(),
        Some("m|grad.output.0")
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn under_context_parallelism_the_divisor_is_the_one_that_fits_among_dp_cp_dp_and_cp() {
    // dp = 2, cp = 2: each rank's own mean (torchtitan: ×4), a mean over the batch shard but a
    // global count over the sequence (×2 = dp, or ×2 = cp: the same reading), the global
    // count (×1). Halving and quartering FP32 values is exact.
    let mesh = Mesh::megatron(1, 2, 2, false).unwrap();
    for (factor, divisor) in [(4.0, 4), (2.0, 2), (1.0, 1)] {
        let d = temp(&format!("cp{divisor}"));
        let (r, c) = traces_on(&d, factor, true, mesh.clone());
        let check = check_dir_paths(&r, &c, PricingMode::Auto, &|| {}).unwrap();
        let loss = check.loss.as_ref().expect("settled");
        assert_eq!(
            (loss.dp, loss.cp, loss.divisor),
            (2, 2, divisor),
            "{loss:?}"
        );
        assert_eq!(loss.local_mean, divisor > 1);
        assert_eq!(loss.error_chosen, 0.0);
        assert_eq!(check.report.failures, 0, "{:?}", check.report);
        let _ = std::fs::remove_dir_all(&d);
    }
    // cp alone (dp = 1) is settled too; a factor no reading explains still fails.
    let cp2 = Mesh::megatron(1, 2, 1, false).unwrap();
    let d = temp("cp-only");
    let (r, c) = traces_on(&d, 2.0, true, cp2);
    let check = check_dir_paths(&r, &c, PricingMode::Auto, &|| {}).unwrap();
    assert_eq!(check.loss.as_ref().map(|l| l.divisor), Some(2));
    assert_eq!(check.report.failures, 0);
    let (r, c) = traces_on(&d.join("odd"), 3.0, true, mesh);
    let check = check_dir_paths(&r, &c, PricingMode::Auto, &|| {}).unwrap();
    assert!(check.report.failures >= 1);
    let _ = std::fs::remove_dir_all(&d);
}
