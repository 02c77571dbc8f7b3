//! `ttrace bugs`: the catalog of injectable silent bugs.

use std::io::{self, Write};

use serde::Serialize;

use crate::out::stdout_error;
use crate::Outcome;

/// The options of `ttrace bugs`.
#[derive(clap::Args)]
pub struct Args {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Print the catalog.
pub fn run(a: Args) -> Result<Outcome, String> {
    let json = a.json;
    use ttrace_lab::bugs::Bug;
    #[derive(Serialize)]
    struct Row {
        name: &'static str,
        needs: &'static str,
        models: &'static str,
        localized_at: String,
    }
    let rows: Vec<Row> = Bug::ALL
        .iter()
        .map(|b| {
            let s = b.site();
            Row {
                name: b.name(),
                needs: b.needs(),
                models: b.models(),
                localized_at: format!(
                    "{:?} {}{}",
                    s.kind,
                    if s.pass == ttrace::engine::Pass::Forward {
                        "fwd"
                    } else {
                        "bwd"
                    },
                    s.name_suffix.map(|x| format!(" ({x})")).unwrap_or_default()
                )
                .to_lowercase(),
            }
        })
        .collect();
    if json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?
        );
        return Ok(Outcome::Pass);
    }
    for r in &rows {
        outln!(
            "{:<32} needs {:<40} expected at {}",
            r.name,
            r.needs,
            r.localized_at
        );
        outln!("{:<32} models {}", "", r.models);
    }
    Ok(Outcome::Pass)
}
