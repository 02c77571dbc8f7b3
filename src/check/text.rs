//! The text of a check report, as `ttrace check` prints it and the Python package's
//! `str(report)` shows it: the verdict line, the failing tensors, the localization and the
//! pricing rules. Ids, notes and messages come from files: control and bidirectional
//! characters in them are escaped ([`printable`], [`sanitize`]).

use crate::check::{CheckReport, DirCheck, Localization};
use crate::io::{printable, sanitize};
use crate::policy::Pass;
use crate::verdict::findings_note;

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

/// A summary comparison ([`compare_summaries`](crate::check::compare_summaries)) as text: the
/// steps compared, per step the largest relative lower bound and the differences proven (at
/// most 20 steps shown: those with a proven difference first, then those with the largest
/// bounds), the first proven difference, and what a summary comparison cannot conclude.
pub fn render_summary_check(check: &crate::check::SummaryCheck) -> String {
    use crate::check::{Proof, TensorBound};
    let mut out = String::new();
    let (only_r, only_c) = check.unmatched_steps;
    out.push_str(&format!(
        "{} step(s) compared from summaries ({only_r} only in the reference, {only_c} only in \
         the candidate)\n",
        check.steps.len()
    ));
    let bound = |b: &TensorBound| match &b.proof {
        Some(Proof::NonFinite {
            reference,
            candidate,
        }) => format!(
            "{}: NaN/+inf/-inf {}/{}/{} against {}/{}/{} in the reference",
            printable(&b.id),
            candidate[0],
            candidate[1],
            candidate[2],
            reference[0],
            reference[1],
            reference[2]
        ),
        Some(Proof::ReplicasDisagree { run, axis, rank }) => format!(
            "{}: the {run}'s copies along {axis} disagree (rank {rank})",
            printable(&b.id)
        ),
        _ => format!(
            "{}: ‖D‖ ≥ {:.3e} = {:.3e} of ‖r‖ (by {}){}",
            printable(&b.id),
            b.lower,
            b.rel_lower,
            b.by,
            b.threshold
                .map(|t| format!(
                    ", threshold {t:.3e}{}",
                    if b.proof.is_some() { ": beyond" } else { "" }
                ))
                .unwrap_or_default()
        ),
    };
    let mut shown: Vec<usize> = (0..check.steps.len())
        .filter(|&i| !check.steps[i].proven.is_empty())
        .take(10)
        .collect();
    let mut by_size: Vec<usize> = (0..check.steps.len()).collect();
    let rel = |i: usize| check.steps[i].largest.as_ref().map_or(0.0, |b| b.rel_lower);
    by_size.sort_by(|&a, &b| rel(b).total_cmp(&rel(a)));
    for i in by_size {
        if shown.len() >= 20 {
            break;
        }
        if !shown.contains(&i) {
            shown.push(i);
        }
    }
    shown.sort_unstable();
    out.push_str("  step  tensors  proven  largest lower bound\n");
    for &i in &shown {
        let s = &check.steps[i];
        out.push_str(&format!(
            "  {:>4}  {:>7}  {:>6}  {}\n",
            s.step,
            s.compared,
            s.proven.len(),
            s.largest.as_ref().map_or("-".into(), bound)
        ));
    }
    if shown.len() < check.steps.len() {
        out.push_str(&format!(
            "  ({} more steps in the JSON report)\n",
            check.steps.len() - shown.len()
        ));
    }
    let skipped: usize = check.steps.iter().map(|s| s.not_comparable.len()).sum();
    if let Some((id, why)) = check.steps.iter().find_map(|s| s.not_comparable.first()) {
        out.push_str(&format!(
            "not comparable from summaries: {skipped} tensor-step(s), e.g. {}: {}\n",
            printable(id),
            sanitize(why)
        ));
    }
    for n in &check.notes {
        out.push_str(&format!("note: {}\n", sanitize(n)));
    }
    if !check.thresholds {
        out.push_str(
            "no thresholds given (--rtol, or --thresholds with a full check's JSON report): \
             only non-finite counts and replicas can prove a difference\n",
        );
    }
    match check.first_proven() {
        Some((step, b)) => out.push_str(&format!(
            "DIFFERENCE PROVEN: {} tensor-step(s); the first: step {step}, {}\n",
            check.proven(),
            bound(b)
        )),
        None => out.push_str(
            "NO DIFFERENCE PROVEN — not a pass: summaries can prove a difference, never \
             agreement (a permutation of a tensor's elements changes no statistic); check a \
             full trace of a step to pass it\n",
        ),
    }
    out
}
