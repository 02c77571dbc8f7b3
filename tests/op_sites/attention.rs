//! Attention sites priced through the registry's attention op (`check::attention_site`): a
//! manifest whose attention core names its op (`"op": "attention:causal"`) has its output
//! judged against the exact attention of both runs' inputs plus the op's own rounding.
//!
//! Oracle: the runs' outputs are made here by two kernels written in this file in `f32`
//! arithmetic — the standard form (a full-row softmax) on the reference, the online form over
//! key blocks of 8 on the candidate, whose heads are split over two tensor-parallel ranks (the
//! shards cut by index arithmetic) and whose inputs differ from the reference's by a rounding
//! or a few ulps — and the exact attention the difference is measured against is a naive f64
//! loop here too. A correct candidate must pass with a threshold no smaller than the exact
//! carried difference; a candidate whose output is off by a small factor, or whose kernel used
//! the wrong scale, must fail at the site; a site with a mask is left to the local model; an op
//! the registry does not know is refused.

use std::collections::HashMap;
use std::path::Path;

use ttrace::check::{check_dir_paths, Pricing, PricingMode};
use ttrace::io::write_trace_dir;
use ttrace::trace::{Axis, Layout, Mesh, ModuleKind, Placement};
use ttrace::{Error, Format, Overflow, Tensor};

const SITE: &str = "layers.0.attention.sdpa";
const B: usize = 2;
const H: usize = 4;
const S: usize = 24;
const D: usize = 16;

/// `n` normal values (SplitMix64 and Box–Muller) with standard deviation `std`.
fn gaussian(name: &str, seed: u64, n: usize, std: f64) -> Vec<f64> {
    let mut state = name.bytes().fold(seed ^ 0x9E37_79B9_7F4A_7C15, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (a, b) = (next().max(1e-300), next());
            std * (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()
        })
        .collect()
}

/// [B, H, S, D] values, normal with standard deviation `std`, rounded to `f`.
fn normal(name: &str, seed: u64, std: f64, f: Format) -> Vec<f64> {
    gaussian(name, seed, B * H * S * D, std)
        .into_iter()
        .map(|x| f.round(x, Overflow::Saturating))
        .collect()
}

/// One head's attention in f64 (the exact value the check measures against).
fn exact(q: &[f64], k: &[f64], v: &[f64], causal: bool, scale: f64) -> Vec<f64> {
    let mut o = vec![0.0; S * D];
    for i in 0..S {
        let keys = if causal { i + 1 } else { S };
        let s: Vec<f64> = (0..keys)
            .map(|j| scale * (0..D).map(|t| q[i * D + t] * k[j * D + t]).sum::<f64>())
            .collect();
        let m = s.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let l: f64 = e.iter().sum();
        for (j, ej) in e.iter().enumerate() {
            for c in 0..D {
                o[i * D + c] += ej / l * v[j * D + c];
            }
        }
    }
    o
}

/// One head's attention as a kernel computes it in f32: scores, then either a full-row softmax
/// (`block` None) or online blocks of `block` keys; the probabilities rounded to `input`
/// before P·V; the output rounded to `input`.
fn kernel(
    (q, k, v): Head<'_>,
    causal: bool,
    block: Option<usize>,
    input: Format,
    scale: f32,
) -> Vec<f64> {
    let r = |x: f32| input.round(x as f64, Overflow::Saturating) as f32;
    let mut out = vec![0.0; S * D];
    for i in 0..S {
        let keys = if causal { i + 1 } else { S };
        let s: Vec<f32> = (0..keys)
            .map(|j| {
                let dot = (0..D).fold(0.0f32, |a, t| a + q[i * D + t] as f32 * k[j * D + t] as f32);
                dot * scale
            })
            .collect();
        let row: Vec<f32> = match block {
            None => {
                let m = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
                let l: f32 = e.iter().sum();
                (0..D)
                    .map(|c| (0..keys).fold(0.0f32, |a, j| a + r(e[j] / l) * v[j * D + c] as f32))
                    .collect()
            }
            Some(bk) => {
                let (mut m, mut l, mut o) = (f32::NEG_INFINITY, 0.0f32, vec![0.0f32; D]);
                for j0 in (0..keys).step_by(bk) {
                    let j1 = (j0 + bk).min(keys);
                    let mb = s[j0..j1].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                    let e: Vec<f32> = s[j0..j1].iter().map(|x| (x - mb).exp()).collect();
                    let lb: f32 = e.iter().sum();
                    let mn = m.max(mb);
                    let (al, be) = ((m - mn).exp(), (mb - mn).exp());
                    l = l * al + lb * be;
                    for (c, oc) in o.iter_mut().enumerate() {
                        let ob =
                            (j0..j1).fold(0.0f32, |a, j| a + r(e[j - j0]) * v[j * D + c] as f32);
                        *oc = *oc * al + ob * be;
                    }
                    m = mn;
                }
                o.iter().map(|x| x / l).collect()
            }
        };
        for (c, x) in row.into_iter().enumerate() {
            out[i * D + c] = input.round(x as f64, Overflow::Saturating);
        }
    }
    out
}

/// One head's (q, k, v).
type Head<'a> = (&'a [f64], &'a [f64], &'a [f64]);

/// Apply `f` to every head of [B, H, S, D] operands.
fn per_head((q, k, v): Head<'_>, f: &dyn Fn(Head<'_>) -> Vec<f64>) -> Vec<f64> {
    let n = S * D;
    (0..B * H)
        .flat_map(|h| f((&q[h * n..][..n], &k[h * n..][..n], &v[h * n..][..n])))
        .collect()
}

/// Heads `h0..h1` of a [B, H, S, D] tensor (a tensor-parallel shard split along dim 1).
fn heads(x: &[f64], h0: usize, h1: usize, f: Format) -> Tensor {
    let n = S * D;
    let v = (0..B)
        .flat_map(|b| x[(b * H + h0) * n..(b * H + h1) * n].to_vec())
        .collect();
    Tensor::from_vec(&[B, h1 - h0, S, D], v, f).unwrap()
}

/// A trace of the site: its inputs (and a mask, with `mask`) and output; one rank, or `tp`
/// ranks holding head shards; the module's op written as `op`.
fn write(dir: &Path, tensors: &[Vec<f64>], f: Format, tp: usize, op: &str, mask: bool) {
    let mesh = if tp > 1 {
        Mesh::new([(Axis::TP, tp)]).unwrap()
    } else {
        Mesh::single()
    };
    let mut layout = Layout::replicated();
    if tp > 1 {
        layout.set(Axis::TP, Placement::Split { dim: 1, groups: 1 });
    }
    let mut ids: Vec<String> = (0..3).map(|i| format!("{SITE}|fwd.input.{i}")).collect();
    let mut tensors = tensors.to_vec();
    if mask {
        ids.push(format!("{SITE}|fwd.input.3"));
        tensors.insert(3, vec![0.0; B * H * S * D]);
    }
    ids.push(format!("{SITE}|fwd.output.0"));
    let entries: Vec<(String, Layout, Vec<Tensor>)> = ids
        .iter()
        .zip(&tensors)
        .map(|(id, x)| {
            let shards = (0..tp)
                .map(|t| heads(x, t * H / tp, (t + 1) * H / tp, f))
                .collect();
            (id.clone(), layout.clone(), shards)
        })
        .collect();
    let kinds: HashMap<String, ModuleKind> = ids
        .iter()
        .map(|id| (id.clone(), ModuleKind::Attention))
        .collect();
    write_trace_dir(dir, &mesh, None, &entries, &kinds, &HashMap::new()).unwrap();
    super::name_op(dir, op);
}

struct Case {
    f: Format,
    causal: bool,
    seed: u64,
}

impl Case {
    fn op(&self) -> &'static str {
        if self.causal {
            "attention:causal"
        } else {
            "attention"
        }
    }

    /// The reference's inputs and the candidate's: the reference's moved by `moved` of an
    /// ulp-scale relative amount (re-rounded), as upstream rounding differences move them.
    fn inputs(&self) -> ([Vec<f64>; 3], [Vec<f64>; 3]) {
        let name = |s: &str| format!("{s}-{}-{}", self.f, self.seed);
        let r = [
            normal(&name("q"), self.seed, 1.5, self.f),
            normal(&name("k"), self.seed, 1.5, self.f),
            normal(&name("v"), self.seed, 1.0, self.f),
        ];
        let u = self.f.unit_roundoff();
        let c = r.clone().map(|x| {
            let noise = gaussian(&name("noise"), 7, x.len(), 4.0 * u);
            x.iter()
                .zip(noise)
                .map(|(a, e)| self.f.round(a * (1.0 + e), Overflow::Saturating))
                .collect()
        });
        (r, c)
    }
}

fn ops(x: &[Vec<f64>; 3]) -> Head<'_> {
    (&x[0], &x[1], &x[2])
}

/// Write both runs, check them, and return the site output's (verdict, pricing) and
/// ‖ref output‖.
fn judge(
    case: &Case,
    name: &str,
    cand_out: &dyn Fn(&[Vec<f64>; 3]) -> Vec<f64>,
    mask: bool,
) -> (ttrace::check::TensorVerdict, Pricing, f64, f64) {
    let (ri, ci) = case.inputs();
    let scale = (1.0 / (D as f64).sqrt()) as f32;
    let ro = per_head(ops(&ri), &|h| kernel(h, case.causal, None, case.f, scale));
    let co = cand_out(&ci);
    let (rd, cd) = (
        super::temp("attn-sites", &format!("{name}-ref")),
        super::temp("attn-sites", &format!("{name}-cand")),
    );
    let mut rt = ri.to_vec();
    rt.push(ro.clone());
    let mut ct = ci.to_vec();
    ct.push(co);
    write(&rd, &rt, case.f, 1, case.op(), mask);
    write(&cd, &ct, case.f, 2, case.op(), mask);
    let check = check_dir_paths(&rd, &cd, PricingMode::Auto, &|| {}).unwrap();
    let out = format!("{SITE}|fwd.output.0");
    let k = check
        .report
        .verdicts
        .iter()
        .position(|v| v.id == out)
        .unwrap();
    // The exact carried difference, here.
    let s = 1.0 / (D as f64).sqrt();
    let er = per_head(ops(&ri), &|h| exact(h.0, h.1, h.2, case.causal, s));
    let ec = per_head(ops(&ci), &|h| exact(h.0, h.1, h.2, case.causal, s));
    let carried = er
        .iter()
        .zip(&ec)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f64>()
        .sqrt();
    let norm = ro.iter().map(|x| x * x).sum::<f64>().sqrt();
    for d in [rd, cd] {
        let _ = std::fs::remove_dir_all(d);
    }
    (
        check.report.verdicts[k].clone(),
        check.pricing[k],
        norm,
        carried,
    )
}

fn cases() -> Vec<Case> {
    let mut out = vec![];
    for f in [Format::F32, Format::BF16] {
        for causal in [true, false] {
            for seed in 0..3 {
                out.push(Case { f, causal, seed });
            }
        }
    }
    out
}

#[test]
fn a_correct_candidate_passes_with_a_threshold_above_the_exact_carried_difference() {
    let scale = (1.0 / (D as f64).sqrt()) as f32;
    for case in cases() {
        let online = |i: &[Vec<f64>; 3]| {
            per_head(ops(i), &|h| kernel(h, case.causal, Some(8), case.f, scale))
        };
        let (v, pricing, norm, carried) = judge(&case, "clean", &online, false);
        let what = format!("{} causal={} seed={}", case.f, case.causal, case.seed);
        assert_eq!(pricing, Pricing::Op, "{what}");
        assert!(v.passed, "{what}: ratio {}", v.ratio);
        assert!(carried > 0.0, "{what}");
        assert!(
            v.threshold * norm >= carried,
            "{what}: {} < {carried}",
            v.threshold * norm
        );
        // The op's own part is a few units of the format, not an allowance of percent.
        assert!(
            v.threshold < 64.0 * case.f.unit_roundoff(),
            "{what}: {}",
            v.threshold
        );
    }
}

#[test]
fn a_wrong_scale_or_a_scaled_output_fails_at_the_site() {
    for case in cases() {
        let what = format!("{} causal={} seed={}", case.f, case.causal, case.seed);
        // The scale from half the head dimension (a local width), in the candidate's kernel.
        let wrong = (1.0 / (D as f64 / 2.0).sqrt()) as f32;
        let bug = |i: &[Vec<f64>; 3]| {
            per_head(ops(i), &|h| kernel(h, case.causal, Some(8), case.f, wrong))
        };
        let (v, pricing, _, _) = judge(&case, "scale", &bug, false);
        assert_eq!(pricing, Pricing::Op, "{what}");
        assert!(!v.passed && v.ratio > 2.0, "{what}: ratio {}", v.ratio);
        // One head's output (of eight) off by a relative 64 units of the format in BF16, 256
        // in FP32 (the clean thresholds are about 11 u and 30 to 45 u): a wrong buffer.
        let u = case.f.unit_roundoff() * if case.f == Format::F32 { 256.0 } else { 64.0 };
        let scale = (1.0 / (D as f64).sqrt()) as f32;
        let off = |i: &[Vec<f64>; 3]| {
            let mut o = per_head(ops(i), &|h| kernel(h, case.causal, Some(8), case.f, scale));
            for x in &mut o[..S * D] {
                *x = case.f.round(*x * (1.0 + u), Overflow::Saturating);
            }
            o
        };
        let (v, _, _, _) = judge(&case, "off", &off, false);
        assert!(!v.passed, "{what}: ratio {}", v.ratio);
    }
}

#[test]
fn a_masked_site_is_left_to_the_local_model_and_an_unknown_op_is_refused() {
    let case = Case {
        f: Format::F32,
        causal: true,
        seed: 0,
    };
    let scale = (1.0 / (D as f64).sqrt()) as f32;
    let online = |i: &[Vec<f64>; 3]| per_head(ops(i), &|h| kernel(h, true, Some(8), case.f, scale));
    let (_, pricing, _, _) = judge(&case, "mask", &online, true);
    assert_eq!(pricing, Pricing::Local);
    // An op the registry does not know.
    let d = super::temp("attn-sites", "unknown-op");
    let (ri, _) = case.inputs();
    let mut t = ri.to_vec();
    t.push(per_head(ops(&ri), &|h| {
        kernel(h, true, None, case.f, scale)
    }));
    write(&d, &t, case.f, 1, "flash_attention", false);
    match check_dir_paths(&d, &d, PricingMode::Auto, &|| {}) {
        Err(Error::File { reason, .. }) => assert!(reason.contains("flash_attention"), "{reason}"),
        other => panic!("expected a refusal naming the op, got {other:?}"),
    }
    let _ = std::fs::remove_dir_all(d);
}
