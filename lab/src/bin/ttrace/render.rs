//! Reports as text, rendered here from the library's data: a check's verdicts, and the
//! sweep's per-kind, sensitivity and bug tables and its SVG plot of thresholds against
//! observed differences.

use ttrace::check::Detector;
use ttrace_lab::validate::SweepReport;

/// The sensitivity tables (one per perturbation shape), as text.
pub fn render_sensitivity(report: &SweepReport) -> String {
    let mut out = String::new();
    let mut shape = None;
    for r in &report.sensitivity_rows {
        if shape != Some(r.perturbation) {
            shape = Some(r.perturbation);
            out.push_str(&format!(
                "\n{:<12} {:<17} {:>7}",
                "recipe",
                format!("{}:", r.perturbation.name()),
                "tensors"
            ));
            for (name, _, _) in &r.rules {
                out.push_str(&format!(" {name:>16}"));
            }
            out.push('\n');
        }
        out.push_str(&format!("{:<12} {:<17} {:>7}", r.recipe, r.kind, r.tensors));
        for (_, med, fa) in &r.rules {
            let cell = if fa > &0 {
                format!("{} (FA {fa})", fmt_num(*med))
            } else {
                fmt_num(*med)
            };
            out.push_str(&format!(" {cell:>16}"));
        }
        out.push('\n');
    }
    out
}

/// The detection table, as text.
pub fn render_bugs(report: &SweepReport) -> String {
    let mut rows: Vec<Vec<String>> = vec![[
        "bug",
        "runs",
        "end-to-end",
        "detected",
        "localized",
        "min err/thr",
        "torch",
        "megatron",
        "pert",
        "localized at (first run)",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()];
    for r in &report.bug_rows {
        let b = |k: &str| format!("{}/{}", r.baselines.get(k).copied().unwrap_or(0), r.runs);
        rows.push(vec![
            r.bug.name().to_string(),
            r.runs.to_string(),
            format!("{}/{}", r.end_to_end, r.runs),
            format!("{}/{}", r.detected, r.runs),
            format!("{}/{}", r.localized, r.runs),
            fmt_num(r.min_ratio),
            b("torch"),
            b("megatron"),
            b("perturbation"),
            r.example_site.clone(),
        ]);
    }
    render_columns(&rows, true, false)
}

/// Rows of cells as aligned text columns: the first column (and the last, with
/// `last_left`) left-aligned, the others right-aligned, two spaces apart; with `rule_before_last`
/// a dashed line above the last row (a totals row).
fn render_columns(rows: &[Vec<String>], last_left: bool, rule_before_last: bool) -> String {
    let cols = rows.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..cols)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for (i, r) in rows.iter().enumerate() {
        if rule_before_last && i + 1 == rows.len() {
            out.push_str(&"-".repeat(widths.iter().sum::<usize>() + 2 * widths.len()));
            out.push('\n');
        }
        for (c, cell) in r.iter().enumerate() {
            let pad = widths[c] - cell.chars().count();
            if c == 0 || (last_left && c + 1 == r.len()) {
                out.push_str(cell);
                out.push_str(&" ".repeat(pad + 2));
            } else {
                out.push_str(&" ".repeat(pad));
                out.push_str(cell);
                out.push_str("  ");
            }
        }
        out.push('\n');
    }
    out
}

fn fmt_num(x: f64) -> String {
    if x.is_nan() {
        "-".into()
    } else if x.is_infinite() {
        "inf".into()
    } else if x == 0.0 {
        "0".into()
    } else if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 0.01 {
        format!("{x:.2}")
    } else {
        format!("{x:.1e}")
    }
}

/// The per-kind table of a sweep report, as text.
pub fn render_table(report: &SweepReport) -> String {
    let baselines: Vec<String> = {
        let mut names = std::collections::BTreeSet::new();
        for r in report.rows.iter().chain(std::iter::once(&report.total)) {
            names.extend(r.baseline_false_alarms.keys().cloned());
        }
        names.into_iter().collect()
    };
    let mut header = vec![
        "kind".to_string(),
        "tensors".into(),
        "differ".into(),
        "max obs (ε)".into(),
        "med thr (ε)".into(),
        "tight med".into(),
        "tight p90".into(),
        "tight worst".into(),
        "false alarms".into(),
        "pert FA".into(),
        "pert tight med".into(),
    ];
    header.extend(baselines.iter().map(|b| format!("{b} FA")));
    let tests = [
        Detector::Scale,
        Detector::Bias,
        Detector::Channel,
        Detector::Row,
        Detector::Sparse,
    ];
    header.extend(tests.iter().map(|d| format!("{} FA/closest", d.name())));
    let mut rows: Vec<Vec<String>> = vec![header];
    for r in report.rows.iter().chain(std::iter::once(&report.total)) {
        let mut row = vec![
            r.kind.clone(),
            r.compared.to_string(),
            r.differing.to_string(),
            fmt_num(r.max_observed_eps),
            fmt_num(r.median_threshold_eps),
            fmt_num(r.tightness_median),
            fmt_num(r.tightness_p90),
            fmt_num(r.tightness_worst),
            r.false_alarms.to_string(),
            r.perturbation_false_alarms.to_string(),
            fmt_num(r.perturbation_tightness_median),
        ];
        row.extend(baselines.iter().map(|b| {
            r.baseline_false_alarms
                .get(b)
                .copied()
                .unwrap_or(0)
                .to_string()
        }));
        row.extend(tests.iter().map(|d| match r.tests.get(d) {
            Some(c) if c.applied > 0 => format!("{}/{}", c.fired, fmt_num(c.closest)),
            _ => "-".to_string(),
        }));
        rows.push(row);
    }
    render_columns(&rows, false, true)
}

/// An SVG scatter plot of every differing tensor: observed relative error against our
/// threshold, both in units of ε of the tensor's format, log-log, with the line
/// observed = threshold (points above it would be false alarms). Colour by recipe.
pub fn render_svg(report: &SweepReport) -> String {
    let (w, h, m) = (720.0, 560.0, 70.0);
    let mut pts = vec![];
    for run in &report.runs {
        for t in &run.tensors {
            if t.observed > 0.0 && t.threshold > 0.0 && t.threshold.is_finite() {
                pts.push((
                    t.threshold / t.eps,
                    t.observed / t.eps,
                    run.config.recipe.clone(),
                ));
            }
        }
    }
    let lo = pts
        .iter()
        .flat_map(|p| [p.0, p.1])
        .fold(f64::INFINITY, f64::min)
        .log10()
        .floor();
    let hi = pts
        .iter()
        .flat_map(|p| [p.0, p.1])
        .fold(f64::NEG_INFINITY, f64::max)
        .log10()
        .ceil();
    let (lo, hi) = if lo.is_finite() && hi.is_finite() && hi > lo {
        (lo, hi)
    } else {
        (-3.0, 3.0)
    };
    let sx = |v: f64| m + (v.log10() - lo) / (hi - lo) * (w - 2.0 * m);
    let sy = |v: f64| h - m - (v.log10() - lo) / (hi - lo) * (h - 2.0 * m);
    let colour = |r: &str| match r {
        "fp32" => "#1f77b4",
        "bf16" => "#2ca02c",
        _ => "#d62728",
    };
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    s.push_str(&format!(
        "<text x=\"{}\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">ttrace validate: observed error vs threshold ({} tensors that differ)</text>\n",
        w / 2.0,
        pts.len()
    ));
    let mut e = lo;
    while e <= hi {
        let v = 10f64.powf(e);
        s.push_str(&format!(
            "<line x1=\"{x}\" y1=\"{}\" x2=\"{x}\" y2=\"{}\" stroke=\"#ddd\"/><text x=\"{x}\" y=\"{}\" text-anchor=\"middle\">1e{e}</text>\n",
            m,
            h - m,
            h - m + 18.0,
            x = sx(v)
        ));
        s.push_str(&format!(
            "<line x1=\"{}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{}\" text-anchor=\"end\">1e{e}</text>\n",
            m,
            w - m,
            m - 6.0,
            sy(v) + 4.0,
            y = sy(v)
        ));
        e += 1.0;
    }
    let (a, b) = (10f64.powf(lo), 10f64.powf(hi));
    s.push_str(&format!(
        "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\" stroke-dasharray=\"5,4\"/>\n",
        sx(a),
        sy(a),
        sx(b),
        sy(b)
    ));
    for (t, o, r) in &pts {
        s.push_str(&format!(
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"2\" fill=\"{}\" fill-opacity=\"0.5\"/>\n",
            sx(*t),
            sy(*o),
            colour(r)
        ));
    }
    s.push_str(&format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">threshold (units of ε of the training dtype)</text>\n",
        w / 2.0,
        h - 20.0
    ));
    s.push_str(&format!(
        "<text x=\"20\" y=\"{}\" text-anchor=\"middle\" transform=\"rotate(-90 20 {})\">observed ‖cand − ref‖/‖ref‖ (units of ε)</text>\n",
        h / 2.0,
        h / 2.0
    ));
    for (i, (name, c)) in [("fp32", "#1f77b4"), ("bf16", "#2ca02c"), ("fp8", "#d62728")]
        .iter()
        .enumerate()
    {
        let y = m + 10.0 + 18.0 * i as f64;
        s.push_str(&format!(
            "<circle cx=\"{}\" cy=\"{y}\" r=\"5\" fill=\"{c}\"/><text x=\"{}\" y=\"{}\">{name}</text>\n",
            m + 15.0,
            m + 25.0,
            y + 4.0
        ));
    }
    s.push_str(&format!(
        "<text x=\"{}\" y=\"{}\">dashed: observed = threshold</text>\n</svg>\n",
        m + 15.0,
        m + 70.0
    ));
    s
}
