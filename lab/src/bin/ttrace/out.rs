//! Writing to standard output and report files.

/// `println!` that returns a write error (a closed pipe, a full disk, `> /dev/full`) as the
/// command's error (exit code 2) instead of panicking.
macro_rules! outln {
    () => {
        writeln!(io::stdout().lock()).map_err(stdout_error)?
    };
    ($($t:tt)*) => {
        writeln!(io::stdout().lock(), $($t)*).map_err(stdout_error)?
    };
}

/// `print!` with the same error handling as [`outln!`].
macro_rules! out {
    ($($t:tt)*) => {
        write!(io::stdout().lock(), $($t)*).map_err(stdout_error)?
    };
}

use ttrace::Format;

/// The message of a failed write to standard output.
pub fn stdout_error(e: std::io::Error) -> String {
    format!("writing to standard output: {e}")
}

/// A recipe name ttrace knows (`ttrace::Recipe::by_name`), for clap.
pub fn parse_recipe(s: &str) -> Result<String, String> {
    ttrace::Recipe::by_name(s).map_err(|e| e.to_string())?;
    Ok(s.to_string())
}

/// A format name, for clap.
pub fn parse_format(s: &str) -> Result<Format, String> {
    s.parse::<Format>().map_err(|e| e.to_string())
}

/// Write a report atomically (see [`ttrace::io::write_atomic`]).
pub fn write_atomic(path: &std::path::Path, contents: &[u8]) -> Result<(), String> {
    ttrace::io::write_atomic(path, contents).map_err(|e| e.to_string())
}

/// A report is never written into a trace directory being read: it could replace one of the
/// inputs (the manifest, a rank file) of this or a later check.
pub fn refuse_report_inside(
    report: &std::path::Path,
    dirs: &[&std::path::Path],
) -> Result<(), String> {
    let parent = report
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let Ok(parent) = std::fs::canonicalize(parent) else {
        // A missing parent directory fails when the report is written, with its own message.
        return Ok(());
    };
    let target = parent.join(report.file_name().unwrap_or_default());
    for dir in dirs {
        if let Ok(d) = std::fs::canonicalize(dir) {
            if target.starts_with(&d) {
                return Err(format!(
                    "{}: refusing to write the report inside the trace directory {} (it could \
                     replace one of its files); write it elsewhere",
                    report.display(),
                    dir.display()
                ));
            }
        }
    }
    Ok(())
}
