//! The local pricing model's tests: the recorded arithmetic priced as the hardware does it,
//! zero references, roles, norm gains, split factors, and the order and flip terms against
//! executed sums.
#![cfg(test)]

use super::*;

/// The recorded arithmetic moves the threshold the way the hardware moves the error:
/// autocast to FP16 rounds an FP32-stored result to FP16 (the flips of a coarser
/// format), a TF32 candidate against an FP32 reference carries its own input difference,
/// FP8 products on a GPU accumulate in the tensor cores' 14 bits.
#[test]
fn recorded_arithmetic_prices_what_the_hardware_does() {
    use crate::io::manifest::{ModuleArith, ModuleInfo};
    let info = |arith: ModuleArith, quantize: Option<Format>| ModuleInfo {
        quantize,
        arith,
        ..ModuleInfo::of(ModuleKind::Linear)
    };
    let stat = |format: Format, module: ModuleInfo, cand: Option<ModuleInfo>| TensorStat {
        ref_norm: 64.0,
        ref_max_abs: 4.0,
        diff_norm: 64.0 * 1e-6,
        elements: 4096,
        last_dim: 64,
        ndim: 2,
        format,
        layout: Layout::replicated(),
        ref_layout: Layout::replicated(),
        norm_gain: 1.0,
        chain_error: 0.0,
        op: None,
        module: Some(module),
        cand_module: cand,
    };
    let ids = vec!["l|fwd.input.0".to_string(), "l|fwd.output.0".to_string()];
    let index = InputIndex::new(&ids);
    let ctx = PriceContext {
        mesh: Mesh::single(),
        ref_mesh: Mesh::single(),
        microbatches: 1,
        ref_microbatches: 1,
        recipe: None,
        log_inv_delta: (1e6f64).ln(),
    };
    let price = |input: &TensorStat, out: &TensorStat| -> f64 {
        let lookup = |j: &str| -> Option<&TensorStat> {
            Some(if j == "l|fwd.input.0" { input } else { out })
        };
        price_local("l|fwd.output.0", &index, &lookup, &ctx)
            .unwrap()
            .threshold
    };
    let plain = ModuleArith::default();
    let f16 = ModuleArith {
        autocast: Some(Format::F16),
        ..ModuleArith::default()
    };
    let tf32 = ModuleArith {
        fp32_matmul: Some(Format::TF32),
        ..ModuleArith::default()
    };
    let cuda = ModuleArith {
        device: Some("cuda".into()),
        ..ModuleArith::default()
    };
    let x = stat(Format::F32, info(plain.clone(), None), None);
    let base = price(&x, &stat(Format::F32, info(plain.clone(), None), None));
    // Autocast FP16: the FP32-stored result was rounded to FP16 (u = 2^-11 instead of 2^-24).
    let auto = price(&x, &stat(Format::F32, info(f16.clone(), None), None));
    assert!(auto > 30.0 * base, "{auto} vs {base}");
    // TF32 on both sides: the carried difference flips TF32 roundings; on one side only:
    // an input difference of its own, larger still.
    let both = price(
        &x,
        &stat(
            Format::F32,
            info(tf32.clone(), None),
            Some(info(tf32.clone(), None)),
        ),
    );
    let one = price(
        &x,
        &stat(
            Format::F32,
            info(plain.clone(), None),
            Some(info(tf32, None)),
        ),
    );
    assert!(both > 3.0 * base && one > both, "{base} {both} {one}");
    // FP8 products: on a GPU the kernel term is the tensor cores' 2^-13, not FP32's 2^-24.
    let x8 = stat(Format::BF16, info(plain.clone(), Some(Format::E4M3)), None);
    let cpu8 = price(
        &x8,
        &stat(Format::BF16, info(plain, Some(Format::E4M3)), None),
    );
    let gpu8 = price(
        &x8,
        &stat(Format::BF16, info(cuda, Some(Format::E4M3)), None),
    );
    assert!(gpu8 > 1.2 * cpu8, "{gpu8} vs {cpu8}");
}

/// An input whose reference is all zero but which differs: the output is priced (by the
/// fallback rule, `None` here), not left unjudged as if an input had failed; an input that
/// failed (non-finite difference) leaves it unjudged.
#[test]
fn zero_reference_inputs_are_not_failures() {
    let stat = |ref_norm: f64, diff_norm: f64| TensorStat {
        ref_norm,
        ref_max_abs: ref_norm,
        diff_norm,
        elements: 16,
        last_dim: 4,
        ndim: 2,
        format: Format::BF16,
        layout: Layout::replicated(),
        ref_layout: Layout::replicated(),
        norm_gain: 1.0,
        chain_error: 0.0,
        op: None,
        module: Some(crate::io::manifest::ModuleInfo::of(ModuleKind::Linear)),
        cand_module: None,
    };
    let ids = vec!["l|fwd.input.0".to_string(), "l|fwd.output.0".to_string()];
    let index = InputIndex::new(&ids);
    let ctx = PriceContext {
        mesh: Mesh::single(),
        ref_mesh: Mesh::single(),
        microbatches: 1,
        ref_microbatches: 1,
        recipe: None,
        log_inv_delta: (1.0 / (crate::verdict::detect::DEFAULT_DELTA * crate::check::NORM_SHARE))
            .ln(),
    };
    let out = stat(1.0, 0.01);
    for (input, expect) in [
        (stat(0.0, 0.5), None),
        (stat(1.0, f64::INFINITY), Some(Pricing::InputFailed)),
        (stat(1.0, 0.001), Some(Pricing::Local)),
    ] {
        let lookup = |j: &str| -> Option<&TensorStat> {
            if j == "l|fwd.input.0" {
                Some(&input)
            } else {
                Some(&out)
            }
        };
        let p = price_local("l|fwd.output.0", &index, &lookup, &ctx);
        assert_eq!(p.map(|p| p.pricing), expect);
    }
}

#[test]
fn roles_follow_the_naming_convention() {
    let r = role("layers.0.mlp.fc1.weight|param_grad").unwrap();
    assert_eq!(r.module, "layers.0.mlp.fc1");
    assert!(r.param_grad && r.produced && r.pass == Pass::Backward);
    let r = role("a.b|fwd.input.1").unwrap();
    assert!(!r.produced && r.pass == Pass::Forward);
    assert!(role("no-bar").is_none());
    assert!(role("a|fwd.output.x").is_none());
    let ids: Vec<String> = [
        "m|fwd.input.0",
        "m|fwd.output.0",
        "m|grad.output.0",
        "m|grad.input.0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let index = InputIndex::new(&ids);
    assert_eq!(index.of("m|fwd.output.0"), vec!["m|fwd.input.0"]);
    assert_eq!(
        index.of("m|grad.input.0"),
        vec!["m|fwd.input.0", "m|grad.output.0"]
    );
    assert!(index.of("m|fwd.input.0").is_empty());
}

#[test]
fn norm_gain_measures_the_row_spread() {
    // Centred rows: gain 1; a row with mean 3 and spread 1 per element: sqrt(10).
    assert!((measured_norm_gain(&[1.0, -1.0, 2.0, -2.0], 2) - 1.0).abs() < 1e-15);
    let g = measured_norm_gain(&[4.0, 2.0], 2);
    assert!((g - 10f64.sqrt()).abs() < 1e-12);
    assert_eq!(measured_norm_gain(&[5.0, 5.0], 2), 1.0);
}

#[test]
fn split_factor_counts_axes_where_a_reduced_dimension_is_split() {
    let mesh = Mesh::megatron(2, 3, 1, false).unwrap();
    let rep = Layout::replicated();
    let row_in = rep
        .clone()
        .with(Axis::TP, Placement::split(2))
        .with(Axis::CP, Placement::CpChunks { dim: 1 });
    let out = rep.clone().with(Axis::CP, Placement::CpChunks { dim: 1 });
    let last = Some(Reduced::Last);
    let row = || [(row_in.clone(), 3)];
    // Row-parallel: contraction split over tp, tokens stay split over cp.
    assert_eq!(split_factor(&out, &row(), &mesh, last), 2);
    // With sequence parallelism the output is reduce-scattered: still split over tp.
    let sp_out = out.clone().with(Axis::TP, Placement::split(1));
    assert_eq!(split_factor(&sp_out, &row(), &mesh, last), 2);
    // A weight gradient reduces over the tokens (cp), not over the features (tp).
    let tokens = Some(Reduced::AllButLast);
    assert_eq!(split_factor(&rep, &row(), &mesh, tokens), 3);
    // Column-parallel forward: nothing reduced across ranks.
    let col_out = out.clone().with(Axis::TP, Placement::split(2));
    assert_eq!(split_factor(&col_out, &[(out.clone(), 3)], &mesh, last), 1);
    // Unknown kind: judged by the output being replicated where an input is split.
    assert_eq!(split_factor(&rep, &row(), &mesh, None), 6);
    // A partial output is a split reduction whatever the inputs.
    let partial = out.clone().with(Axis::TP, Placement::Partial);
    assert_eq!(
        split_factor(&partial, &[(out, 3)], &mesh, Some(Reduced::Nothing)),
        2
    );
}

use crate::format::Overflow;
use proptest::prelude::*;

fn rel(a: &[f64], b: &[f64]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let n: f64 = a.iter().map(|x| x * x).sum();
    (d / n).sqrt()
}

fn tail(m: f64) -> f64 {
    let x = 1e6f64.ln();
    (1.0 + 2.0 * (x / m).sqrt() + 2.0 * x / m).sqrt()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// The order term for a combination in a coarser format: rows of K products summed in
    /// FP32 (sequentially) then rounded to BF16 (the reference) against s partial sums each
    /// rounded to BF16 and combined by BF16 additions (Megatron's BF16 all-reduce). The
    /// relative Frobenius difference, from exact (f64) sums of FP32-exact terms, stays
    /// within u_bf16·sqrt(2s/3) times the tail for N rows.
    #[test]
    fn bf16_combination_of_split_sums_is_within_the_order_term(
        seed in any::<u64>(), s in 2usize..5, k in 8usize..64, offset in -1.0f64..1.0)
    {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (bf, f32f) = (Format::BF16, Format::F32);
        let n = 256;
        let (mut reference, mut candidate) = (vec![], vec![]);
        for _ in 0..n {
            let terms: Vec<f64> = (0..k * s)
                .map(|_| f32f.round(rng.random_range(-1.0..1.0) + offset, Overflow::NonSaturating))
                .collect();
            let seq = terms.iter().fold(0.0, |a, t| f32f.round(a + t, Overflow::NonSaturating));
            reference.push(bf.round(seq, Overflow::NonSaturating));
            let mut acc = 0.0;
            for part in terms.chunks(k) {
                let p = part.iter().fold(0.0, |a, t| f32f.round(a + t, Overflow::NonSaturating));
                acc = bf.round(acc + bf.round(p, Overflow::NonSaturating), Overflow::NonSaturating);
            }
            candidate.push(acc);
        }
        let bound = bf.unit_roundoff() * (2.0 * s as f64 / 3.0).sqrt() * tail(n as f64);
        prop_assert!(rel(&reference, &candidate) <= bound,
            "{} > {bound}", rel(&reference, &candidate));
    }

    /// The flip term: values that differ by a relative ρ before rounding to BF16 differ
    /// after it by at most the χ²-tailed ρ plus the Bernstein bound on the flip energy,
    /// down to differences so small that less than one flip is expected.
    #[test]
    fn rounding_a_small_difference_stays_within_the_flip_term(
        seed in any::<u64>(), log_rho in -9.0f64..-3.0)
    {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let bf = Format::BF16;
        let rho = 10f64.powf(log_rho);
        let n = 512usize;
        let x: Vec<f64> = (0..n).map(|_| rng.random_range(-4.0..4.0)).collect();
        let y: Vec<f64> = x.iter().map(|v| v * (1.0 + rho * rng.random_range(-1.0..1.0))).collect();
        let pre = rel(&x, &y);
        let rx: Vec<f64> = x.iter().map(|v| bf.round(*v, Overflow::NonSaturating)).collect();
        let ry: Vec<f64> = y.iter().map(|v| bf.round(*v, Overflow::NonSaturating)).collect();
        let u = bf.unit_roundoff();
        let norm = x.iter().map(|v| v * v).sum::<f64>().sqrt();
        let max = x.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let (xl, mu, w) = (1e6f64.ln(), 2.0 * u * pre, (2.0 * u * max / norm).powi(2));
        let flips = mu + w * xl / 3.0 + (w * w * xl * xl / 9.0 + 2.0 * w * mu * xl).sqrt();
        let bound = (pre * pre * tail(n as f64).powi(2) + flips).sqrt();
        prop_assert!(rel(&rx, &ry) <= bound, "{} > {bound}", rel(&rx, &ry));
    }
}

/// A norm's parameter gradient summed in BF16 on the CPU is priced at least at twice the
/// stagnation the arriving gradient's chain measured (`check::chain`): the two runs' sums may
/// each stagnate that much. Not where the chain measured nothing, nor on a GPU (whose kernels
/// sum in FP32), nor where the module declares its accumulator.
#[test]
fn a_narrow_cpu_chain_prices_the_norm_gradients_it_sums() {
    use crate::io::manifest::{ModuleArith, ModuleInfo};
    let info = |device: &str, accumulate: Option<Format>| ModuleInfo {
        arith: ModuleArith {
            device: Some(device.into()),
            ..ModuleArith::default()
        },
        accumulate,
        ..ModuleInfo::of(ModuleKind::Norm)
    };
    let stat = |elements: usize, chain: f64, module: &ModuleInfo| TensorStat {
        ref_norm: 100.0,
        ref_max_abs: 10.0,
        diff_norm: 100.0 * 2f64.powi(-8),
        elements,
        last_dim: 256,
        ndim: 2,
        format: Format::BF16,
        layout: Layout::replicated(),
        ref_layout: Layout::replicated(),
        norm_gain: 1.0,
        chain_error: chain,
        op: None,
        module: Some(module.clone()),
        cand_module: None,
    };
    let ids: Vec<String> = ["n|fwd.input.0", "n|grad.output.0", "n.bias|param_grad"]
        .map(String::from)
        .to_vec();
    let index = InputIndex::new(&ids);
    let ctx = PriceContext {
        mesh: Mesh::single(),
        ref_mesh: Mesh::single(),
        microbatches: 1,
        ref_microbatches: 1,
        recipe: None,
        log_inv_delta: (1e6f64).ln(),
    };
    let price = |chain: f64, module: &ModuleInfo| -> f64 {
        let (x, dy, out) = (
            stat(4096 * 256, 0.0, module),
            stat(4096 * 256, chain, module),
            stat(256, 0.0, module),
        );
        let lookup = |j: &str| -> Option<&TensorStat> {
            Some(match j {
                "n|fwd.input.0" => &x,
                "n|grad.output.0" => &dy,
                _ => &out,
            })
        };
        price_local("n.bias|param_grad", &index, &lookup, &ctx)
            .unwrap()
            .threshold
    };
    let cpu = info("cpu", None);
    let (none, chained) = (price(0.0, &cpu), price(0.25, &cpu));
    assert!(chained >= 2.0 * 0.25 * 100.0, "{chained}");
    assert!(none < 0.5 * chained, "{none} vs {chained}");
    let cuda = info("cuda", None);
    assert_eq!(price(0.25, &cuda), price(0.0, &cuda));
    let declared = info("cpu", Some(Format::F32));
    assert_eq!(price(0.25, &declared), price(0.0, &declared));
}
