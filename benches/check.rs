//! Checking and pricing speed, each beside a baseline measured in the same run. Run with
//! `cargo bench --bench check`.
//!
//! * `compare_4M`: one comparison of two 4M-element tensors (relative Frobenius error, max abs,
//!   ulp distance, NaN/Inf scan, and the scale, bias and sparse tests: as a vector, as a
//!   1024 × 4096 matrix, and with the norm alone) beside a plain 8-lane sum over the same bytes
//!   (the machine's memory bandwidth as our code sees it).
//! * `price`: a matmul threshold from summary statistics (per op), and the local pricing of
//!   every tensor of a 32-layer GPT trace from per-tensor statistics (no data).
//! * `check_dir_256MB`: `ttrace check` on a 128 MB BF16 reference against a 2-rank candidate on
//!   disk (page cache warm) beside reading the same files into memory.
//! * `check_tensor_count`: `ttrace check` of traces of 10,000 and of 100,000 small tensors
//!   (64 BF16 elements, TP 2): the time per tensor of the larger beside the smaller's (the
//!   baseline) — equal for a check linear in the number of tensors.

use std::hint::black_box;
use std::path::Path;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ttrace::bounds::{plan_matmul, Confidence, MatmulPlan, TermStats};
use ttrace::check::{check_dir_paths, compare_tensor, compare_tensor_with, Detection, PricingMode};
use ttrace::check::{price_local, InputIndex, PriceContext, TensorStat};
use ttrace::io::{write_trace_dir, ModuleInfo};
use ttrace::trace::ModuleKind;
use ttrace::trace::{Axis, Layout, Mesh, Placement};
use ttrace::{Format, Overflow};
use ttrace::{Policy, Tensor};

fn values(n: usize, seed: u64, f: Format) -> Vec<f64> {
    let mut g = ttrace::engine::SplitMix64::for_name("bench-check", seed);
    (0..n)
        .map(|_| f.round(4.0 * g.uniform() - 2.0, Overflow::NonSaturating))
        .collect()
}

fn compare(c: &mut Criterion) {
    let n = 1 << 22;
    let r = values(n, 1, Format::BF16);
    let mut cv = r.clone();
    for i in (0..n).step_by(97) {
        cv[i] = Format::BF16.round(cv[i] * (1.0 + 2f64.powi(-7)), Overflow::NonSaturating);
    }
    let rt = Tensor::from_vec(&[n], r.clone(), Format::BF16).unwrap();
    let ct = Tensor::from_vec(&[n], cv.clone(), Format::BF16).unwrap();
    let mut g = c.benchmark_group("compare_4M");
    g.throughput(Throughput::Bytes((2 * n * 8) as u64));
    g.measurement_time(Duration::from_secs(3)).sample_size(20);
    g.bench_function("plain_8lane_sum_baseline", |b| {
        b.iter(|| {
            let mut acc = [0.0f64; 8];
            for (x, y) in black_box(&r)
                .chunks_exact(8)
                .zip(black_box(&cv).chunks_exact(8))
            {
                for l in 0..8 {
                    acc[l] += x[l] + y[l];
                }
            }
            acc.iter().sum::<f64>()
        })
    });
    g.bench_function("ttrace_compare_tensor", |b| {
        b.iter(|| compare_tensor("x", black_box(&rt), black_box(&ct), 1.0, 1.0))
    });
    let off = Detection {
        enabled: false,
        ..Detection::default()
    };
    g.bench_function("ttrace_compare_tensor_norm_only", |b| {
        b.iter(|| compare_tensor_with("x", black_box(&rt), black_box(&ct), 1.0, 1.0, off))
    });
    // The same values as a 1024 × 4096 matrix: the systematic tests' column sums too.
    let rm = Tensor::from_vec(&[1024, 4096], r.clone(), Format::BF16).unwrap();
    let cm = Tensor::from_vec(&[1024, 4096], cv.clone(), Format::BF16).unwrap();
    g.bench_function("ttrace_compare_tensor_matrix", |b| {
        b.iter(|| compare_tensor("x", black_box(&rm), black_box(&cm), 1.0, 1.0))
    });
    g.finish();
}

/// Ids and statistics of a GPT-like trace with `layers` layers, in execution order.
fn gpt_stats(layers: usize) -> (Vec<String>, Vec<TensorStat>) {
    let mut mods: Vec<(String, ModuleKind, usize)> =
        vec![("embedding".into(), ModuleKind::Embedding, 0)];
    for l in 0..layers {
        for (m, k, inputs) in [
            ("ln1", ModuleKind::Norm, 1),
            ("attn.qkv", ModuleKind::Linear, 1),
            ("attn.core", ModuleKind::Attention, 1),
            ("attn.proj", ModuleKind::Linear, 1),
            ("resid1", ModuleKind::Residual, 2),
            ("ln2", ModuleKind::Norm, 1),
            ("mlp.fc1", ModuleKind::Linear, 1),
            ("mlp.act", ModuleKind::Activation, 1),
            ("mlp.fc2", ModuleKind::Linear, 1),
            ("resid2", ModuleKind::Residual, 2),
        ] {
            mods.push((format!("layers.{l}.{m}"), k, inputs));
        }
    }
    mods.push(("final_ln".into(), ModuleKind::Norm, 1));
    mods.push(("lm_head".into(), ModuleKind::Linear, 1));
    mods.push(("loss".into(), ModuleKind::Loss, 1));
    let mut ids = vec![];
    for (m, _, inputs) in &mods {
        for i in 0..*inputs {
            ids.push((format!("{m}|fwd.input.{i}"), m.clone()));
        }
        ids.push((format!("{m}|fwd.output.0"), m.clone()));
    }
    for (m, kind, inputs) in mods.iter().rev() {
        ids.push((format!("{m}|grad.output.0"), m.clone()));
        for i in 0..*inputs {
            ids.push((format!("{m}|grad.input.{i}"), m.clone()));
        }
        if matches!(kind, ModuleKind::Linear | ModuleKind::Norm) {
            ids.push((format!("{m}.weight|param_grad"), m.clone()));
            ids.push((format!("{m}.bias|param_grad"), m.clone()));
        }
    }
    let kinds: std::collections::HashMap<String, ModuleKind> =
        mods.iter().map(|(m, k, _)| (m.clone(), *k)).collect();
    let mut layout = Layout::replicated();
    layout.set(Axis::TP, Placement::split(2));
    let stats = ids
        .iter()
        .map(|(_, m)| TensorStat {
            ref_norm: 100.0,
            ref_max_abs: 4.0,
            diff_norm: 0.3,
            elements: 1 << 20,
            last_dim: 4096,
            ndim: 3,
            format: Format::BF16,
            layout: layout.clone(),
            ref_layout: Layout::replicated(),
            norm_gain: 1.2,
            chain_error: 0.0,
            op: None,
            module: Some(ModuleInfo::of(kinds[m])),
            cand_module: None,
        })
        .collect();
    (ids.into_iter().map(|(i, _)| i).collect(), stats)
}

fn price(c: &mut Criterion) {
    let mut g = c.benchmark_group("price");
    g.measurement_time(Duration::from_secs(3)).sample_size(20);
    let p = Policy::new(Format::BF16, Format::F32, Format::BF16);
    let conf = Confidence::default_probabilistic();
    let stats = TermStats::normal(0.0, 1.0);
    g.bench_function("plan_matmul_from_summary_stats", |b| {
        b.iter(|| {
            plan_matmul(
                &MatmulPlan {
                    m: 4096,
                    k: 4096,
                    n: 4096,
                    a: stats,
                    b: stats,
                },
                black_box(&p),
                &p,
                conf,
            )
            .unwrap()
        })
    });
    let (ids, st) = gpt_stats(32);
    let index: std::collections::HashMap<&str, &TensorStat> =
        ids.iter().map(String::as_str).zip(&st).collect();
    let ctx = PriceContext {
        mesh: Mesh::megatron(2, 1, 1, false).unwrap(),
        ref_mesh: Mesh::single(),
        microbatches: 1,
        ref_microbatches: 1,
        recipe: None,
        log_inv_delta: 1e6f64.ln(),
    };
    g.bench_function(format!("local_pricing_32_layers_{}_ids", ids.len()), |b| {
        b.iter(|| {
            let stat = |j: &str| index.get(j).copied();
            let inputs = InputIndex::new(&ids);
            ids.iter()
                .filter_map(|id| price_local(id, &inputs, &stat, &ctx))
                .map(|p| p.threshold)
                .sum::<f64>()
        })
    });
    g.finish();
}

fn write_trace(dir: &Path) -> u64 {
    let n = 1 << 21; // 2M BF16 elements: 4 MB per tensor
    let (mesh1, mesh2) = (Mesh::single(), Mesh::megatron(2, 1, 1, false).unwrap());
    let mut split = Layout::replicated();
    split.set(Axis::TP, Placement::split(1));
    let (mut re, mut ce) = (vec![], vec![]);
    let mut modules = std::collections::HashMap::new();
    let mut x = values(n, 7, Format::BF16);
    for m in 0..16 {
        let y: Vec<f64> = x
            .iter()
            .map(|v| Format::BF16.round(v * 1.01, Overflow::NonSaturating))
            .collect();
        for (role, v) in [("fwd.input.0", &x), ("fwd.output.0", &y)] {
            let id = format!("m{m}|{role}");
            let t = Tensor::from_vec(&[1024, n / 1024], v.clone(), Format::BF16).unwrap();
            let shards = ttrace::trace::shard(&t, &split, &mesh2, &id).unwrap();
            modules.insert(id.clone(), ModuleKind::Activation);
            re.push((id.clone(), Layout::replicated(), vec![t]));
            ce.push((id, split.clone(), shards));
        }
        x = y;
    }
    let none = std::collections::HashMap::new();
    write_trace_dir(&dir.join("reference"), &mesh1, None, &re, &modules, &none).unwrap();
    write_trace_dir(&dir.join("candidate"), &mesh2, None, &ce, &modules, &none).unwrap();
    (re.len() * n * 2 * 2) as u64
}

fn check_dir(c: &mut Criterion) {
    let dir = std::env::temp_dir().join(format!("ttrace-bench-check-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let bytes = write_trace(&dir);
    let (r, cd) = (dir.join("reference"), dir.join("candidate"));
    let files: Vec<_> = [
        "reference/rank0.safetensors",
        "candidate/rank0.safetensors",
        "candidate/rank1.safetensors",
    ]
    .iter()
    .map(|f| dir.join(f))
    .collect();
    let mut g = c.benchmark_group("check_dir_256MB");
    g.throughput(Throughput::Bytes(bytes));
    g.measurement_time(Duration::from_secs(8)).sample_size(10);
    g.bench_function("read_files_baseline", |b| {
        b.iter(|| {
            files
                .iter()
                .map(|f| std::fs::read(f).unwrap().len())
                .sum::<usize>()
        })
    });
    g.bench_function("ttrace_check_dir_paths", |b| {
        b.iter(|| check_dir_paths(&r, &cd, PricingMode::Auto, &|| {}).unwrap())
    });
    g.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A GPT-like trace of `count` tensors of 64 BF16 elements (linear modules' inputs and
/// outputs), the candidate on 2 ranks.
fn write_many(dir: &Path, count: usize) {
    let (mesh1, mesh2) = (Mesh::single(), Mesh::megatron(2, 1, 1, false).unwrap());
    let mut split = Layout::replicated();
    split.set(Axis::TP, Placement::split(1));
    let (mut re, mut ce) = (vec![], vec![]);
    let mut modules = std::collections::HashMap::new();
    let x = values(64, 3, Format::BF16);
    for m in 0..count / 2 {
        for role in ["fwd.input.0", "fwd.output.0"] {
            let id = format!("layers.{}.m{}|{role}", m / 8, m % 8);
            let t = Tensor::from_vec(&[8, 8], x.clone(), Format::BF16).unwrap();
            let shards = ttrace::trace::shard(&t, &split, &mesh2, &id).unwrap();
            modules.insert(id.clone(), ModuleKind::Linear);
            re.push((id.clone(), Layout::replicated(), vec![t]));
            ce.push((id, split.clone(), shards));
        }
    }
    let none = std::collections::HashMap::new();
    write_trace_dir(&dir.join("reference"), &mesh1, None, &re, &modules, &none).unwrap();
    write_trace_dir(&dir.join("candidate"), &mesh2, None, &ce, &modules, &none).unwrap();
}

fn check_count(c: &mut Criterion) {
    let mut g = c.benchmark_group("check_tensor_count");
    g.measurement_time(Duration::from_secs(10)).sample_size(10);
    for count in [10_000, 100_000] {
        let dir =
            std::env::temp_dir().join(format!("ttrace-bench-count-{count}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write_many(&dir, count);
        let (r, cd) = (dir.join("reference"), dir.join("candidate"));
        g.throughput(Throughput::Elements(count as u64));
        g.bench_function(format!("ttrace_check_{count}_tensors"), |b| {
            b.iter(|| check_dir_paths(&r, &cd, PricingMode::Auto, &|| {}).unwrap())
        });
        let _ = std::fs::remove_dir_all(&dir);
    }
    g.finish();
}

criterion_group!(benches, compare, price, check_dir, check_count);
criterion_main!(benches);
