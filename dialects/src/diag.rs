//! Located diagnostics: what every error, warning and note of nnscaler looks like.
//!
//! MLIR reports parse errors through the context's diagnostic handler; our verifier and
//! passes report through [`Diagnostics`]. Both end up as [`Diagnostic`] values, rendered as
//! `file:line:col: error: message` followed by the source line and a caret, like mlir-opt.

use melior::ir::Location;
use std::fmt;

/// A position in a source buffer. `line` and `col` are 1-based; 0 means unknown.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct SrcLoc {
    /// The buffer name (the file path, or `-` for standard input).
    pub file: String,
    /// 1-based line, 0 when unknown.
    pub line: usize,
    /// 1-based column, 0 when unknown.
    pub col: usize,
}

impl SrcLoc {
    /// Extracts the first `"file":line:col` from an MLIR location (file-line-col, name,
    /// call-site and fused locations all carry one); unknown locations give line 0.
    pub fn from_location(loc: Location<'_>) -> Self {
        Self::from_location_text(&loc.to_string())
    }

    /// Like [`SrcLoc::from_location`], from the printed form `loc("f.mlir":3:7)`.
    pub fn from_location_text(text: &str) -> Self {
        let bytes = text.as_bytes();
        let mut i = 0;
        while let Some(start) = text[i..].find('"').map(|p| p + i) {
            let Some(end) = text[start + 1..].find('"').map(|p| p + start + 1) else {
                break;
            };
            let rest = &text[end + 1..];
            if let Some(rest) = rest.strip_prefix(':') {
                let line: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
                let after = &rest[line.len()..];
                if let Some(after) = after.strip_prefix(':') {
                    let col: String = after.chars().take_while(|c| c.is_ascii_digit()).collect();
                    if let (Ok(line), Ok(col)) = (line.parse(), col.parse()) {
                        return SrcLoc {
                            file: text[start + 1..end].to_string(),
                            line,
                            col,
                        };
                    }
                }
            }
            i = end + 1;
            if i >= bytes.len() {
                break;
            }
        }
        SrcLoc::default()
    }
}

impl fmt::Display for SrcLoc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(
                f,
                "{}",
                if self.file.is_empty() {
                    "<unknown>"
                } else {
                    &self.file
                }
            )
        } else {
            write!(f, "{}:{}:{}", self.file, self.line, self.col)
        }
    }
}

/// How serious a diagnostic is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// Attached to another diagnostic.
    Note,
    /// Suspicious but not fatal.
    Warning,
    /// The input is wrong.
    Error,
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Severity::Note => "note",
            Severity::Warning => "warning",
            Severity::Error => "error",
        })
    }
}

/// One located message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    /// Where.
    pub loc: SrcLoc,
    /// How serious.
    pub severity: Severity,
    /// What.
    pub message: String,
}

impl Diagnostic {
    /// Renders `file:line:col: error: message`, then the source line and a caret when
    /// `source` (the whole buffer) is given and the location is known.
    pub fn render(&self, source: Option<&str>) -> String {
        let mut out = format!("{}: {}: {}", self.loc, self.severity, self.message);
        if let (Some(src), true) = (source, self.loc.line > 0) {
            if let Some(line) = src.lines().nth(self.loc.line - 1) {
                out.push('\n');
                out.push_str(line);
                out.push('\n');
                out.push_str(&" ".repeat(self.loc.col.saturating_sub(1)));
                out.push('^');
            }
        }
        out
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render(None))
    }
}

/// A list of diagnostics being collected (the verifier reports every problem, not the first).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Diagnostics(pub Vec<Diagnostic>);

impl Diagnostics {
    /// Records an error at `loc`.
    pub fn error(&mut self, loc: &SrcLoc, message: impl Into<String>) {
        self.push(loc, Severity::Error, message);
    }

    /// Records a warning at `loc`.
    pub fn warning(&mut self, loc: &SrcLoc, message: impl Into<String>) {
        self.push(loc, Severity::Warning, message);
    }

    /// Records a note at `loc`.
    pub fn note(&mut self, loc: &SrcLoc, message: impl Into<String>) {
        self.push(loc, Severity::Note, message);
    }

    fn push(&mut self, loc: &SrcLoc, severity: Severity, message: impl Into<String>) {
        self.0.push(Diagnostic {
            loc: loc.clone(),
            severity,
            message: message.into(),
        });
    }

    /// Whether any error was recorded.
    pub fn has_errors(&self) -> bool {
        self.0.iter().any(|d| d.severity == Severity::Error)
    }

    /// Appends all of `other`.
    pub fn extend(&mut self, other: Diagnostics) {
        self.0.extend(other.0);
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for d in &self.0 {
            writeln!(f, "{d}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extracts_file_line_col() {
        let l = SrcLoc::from_location_text(r#"loc("a/b.mlir":3:7)"#);
        assert_eq!(l.to_string(), "a/b.mlir:3:7");
        let l = SrcLoc::from_location_text(r#"loc("name"("x.mlir":10:2))"#);
        assert_eq!(l.to_string(), "x.mlir:10:2");
        assert_eq!(SrcLoc::from_location_text("loc(unknown)").line, 0);
    }

    #[test]
    fn renders_caret() {
        let d = Diagnostic {
            loc: SrcLoc {
                file: "f".into(),
                line: 2,
                col: 3,
            },
            severity: Severity::Error,
            message: "bad".into(),
        };
        assert_eq!(
            d.render(Some("one\n  two\n")),
            "f:2:3: error: bad\n  two\n  ^"
        );
    }
}
