//! The text of a check report, as `ttrace check` prints it and the Python package's
//! `str(report)` shows it: the verdict line, the failing tensors, the localization and the
//! pricing rules. Ids, notes and messages come from files: control and bidirectional
//! characters in them are escaped ([`printable`], [`sanitize`]).

use crate::check::{CheckReport, Detector, DirCheck, Localization, TensorVerdict};
use crate::io::{printable, sanitize};
use crate::policy::Pass;

/// The report of [`check_dir_traces`](crate::check::check_dir_traces) as text: the verdict,
/// the failing tensors (all of them) with error and threshold in ε, the localization of the
/// first failure, and how many tensors each pricing rule judged.
pub fn render_dir_check(check: &DirCheck) -> String {
    let mut out = render_check(&check.report);
    if let Some(l) = &check.localization {
        out.push_str(&localization_line(l));
        out.push('\n');
    }
    out.push_str("thresholds:\n");
    for (_, n, rule) in &check.pricing_summary {
        out.push_str(&format!("  {n:>6} tensors: {rule}\n"));
    }
    if !check.arithmetic.is_empty() {
        let parts: Vec<String> = check
            .arithmetic
            .iter()
            .map(|(side, setting, n)| format!("{side} {setting} ({n} tensors)"))
            .collect();
        out.push_str(&format!("arithmetic priced: {}\n", parts.join("; ")));
    }
    if let Some(first) = check.untraced.first() {
        let between = match &first.after {
            Some(a) => format!(
                "between module {} and module {}",
                printable(a),
                printable(&first.before)
            ),
            None => format!("before module {}", printable(&first.before)),
        };
        out.push_str(&format!(
            "untraced code made {} of the consumed tensors (the first {between}); a bug there \
             is caught where its output is consumed\n",
            check.untraced.len()
        ));
    }
    if let Some(first) = check.inferred.first() {
        out.push_str(&format!(
            "layouts inferred from shapes: {} tensors the tracer could not see the layout of \
             (the first {})\n",
            check.inferred.len(),
            printable(&first.tensor)
        ));
    }
    if let Some(loss) = &check.loss {
        out.push_str(&printable(&loss.describe()));
        out.push('\n');
    }
    out
}

/// The report as a table: the failing tensors first (all of them), then a count of passes.
/// Ids and notes come from files: control characters in them are escaped
/// (`ttrace::io::printable`).
pub fn render_check(report: &CheckReport) -> String {
    let mut out = String::new();
    let n = report.verdicts.len();
    if report.passed() {
        out.push_str(&format!(
            "PASS: all {n} tensors within their thresholds, no scale, bias or sparse test fired \
             (ε = {:e})\n",
            report.eps
        ));
        return out;
    }
    out.push_str(&format!(
        "FAIL: {} of {n} tensors outside their thresholds; first in execution order: {}\n",
        report.failures,
        printable(report.first_failure.as_deref().unwrap_or("-"))
    ));
    out.push_str(&format!(
        "{:<44} {:>11} {:>11} {:>9} {:>10} {:>8}  {:<12} note\n",
        "tensor", "error (ε)", "thresh (ε)", "ratio", "max abs", "max ulp", "fired"
    ));
    for v in report.verdicts.iter().filter(|v| !v.passed) {
        let note = match (&v.problem, v.first_nonfinite) {
            (Some(p), _) => p.clone(),
            (None, Some(i)) => format!(
                "{} non-finite mismatches, first at {i}",
                v.nonfinite_mismatches
            ),
            _ => findings_note(v),
        };
        let fired: Vec<&str> = v.fired().iter().map(|d| d.name()).collect();
        out.push_str(&format!(
            "{:<44} {:>11.3} {:>11.3} {:>9.3} {:>10.3e} {:>8}  {:<12} {}\n",
            printable(&v.id),
            v.rel_error_eps,
            v.threshold / report.eps,
            v.ratio,
            v.max_abs,
            if v.max_ulp == u64::MAX {
                "-".to_string()
            } else {
                v.max_ulp.to_string()
            },
            if fired.is_empty() {
                "-".to_string()
            } else {
                fired.join("+")
            },
            sanitize(&note)
        ));
    }
    out
}

/// What the tests beyond the norm that fired measured, in ε: "scale 0.31 > 0.05; sparse: 4
/// elements, worst at 1234: 7.1 > 2.3".
pub(crate) fn findings_note(v: &TensorVerdict) -> String {
    v.findings
        .iter()
        .filter(|f| f.fired)
        .map(|f| match f.detector {
            Detector::Sparse => format!(
                "sparse: {} element{}, worst at {}: {:.3} > {:.3}",
                f.count,
                if f.count == 1 { "" } else { "s" },
                f.at.map_or("-".to_string(), |i| i.to_string()),
                f.estimate,
                f.threshold
            ),
            d => format!("{} {:.3} > {:.3}", d.name(), f.estimate, f.threshold),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The one line that says where the first failure was localized (by `ttrace check` or the
/// simulator's localizer), ids and text escaped for the terminal.
pub fn localization_line(l: &Localization) -> String {
    let kind = l.kind.map(|k| format!(" ({k:?})")).unwrap_or_default();
    let pass = match l.pass {
        Some(Pass::Forward) => " forward",
        Some(Pass::Backward) => " backward",
        _ => "",
    };
    let rank = l.rank.map(|r| format!(", rank {r}")).unwrap_or_default();
    let parameter = l
        .parameter
        .as_ref()
        .map(|p| format!(", parameter {}", printable(p)))
        .unwrap_or_default();
    format!(
        "localized: module {}{kind}{pass}, tensor {}{rank}{parameter}: {}",
        printable(&l.module),
        printable(&l.tensor),
        sanitize(&l.detail)
    )
}
