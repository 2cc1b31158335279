//! Located diagnostics: what every error, warning and note of nnscaler looks like.
//!
//! MLIR reports parse errors through the context's diagnostic handler; our verifier and
//! passes report through [`Diagnostics`]. Both end up as [`Diagnostic`] values, rendered as
//! `file:line:col: error: message` followed by the source line and a caret, like mlir-opt.

use melior::ir::Location;
use std::fmt;

/// The MLIR location a [`SrcLoc`] was read from, kept so that ops made from it (a backward
/// op from its forward op, a split op from the original) get the exact location back —
/// fused, name and call-site locations included — when a pass writes IR in place.
///
/// A handle into the `MlirContext` that produced it, valid while that context lives. It is
/// only read by the thread writing IR into that context (never dereferenced elsewhere),
/// which is why it may be sent with the diagnostics and graphs that carry it.
#[derive(Clone, Copy, Debug)]
pub struct RawLoc(pub mlir_sys::MlirLocation);

// SAFETY: see the type's docs: the handle is an opaque, immutable (uniqued) MLIR location
// that other threads only copy, never use.
unsafe impl Send for RawLoc {}
// SAFETY: as above.
unsafe impl Sync for RawLoc {}

/// A position in a source buffer. `line` and `col` are 1-based; 0 means unknown.
/// Equality and hashing look at the position only, not at [`SrcLoc::raw`].
#[derive(Clone, Debug, Default)]
pub struct SrcLoc {
    /// The buffer name (the file path, or `-` for standard input).
    pub file: String,
    /// 1-based line, 0 when unknown.
    pub line: usize,
    /// 1-based column, 0 when unknown.
    pub col: usize,
    /// The MLIR location it was read from, when it was read from IR.
    pub raw: Option<RawLoc>,
}

impl PartialEq for SrcLoc {
    fn eq(&self, o: &Self) -> bool {
        (&self.file, self.line, self.col) == (&o.file, o.line, o.col)
    }
}

impl Eq for SrcLoc {}

impl std::hash::Hash for SrcLoc {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        (&self.file, self.line, self.col).hash(h);
    }
}

impl SrcLoc {
    /// A position in `file`.
    pub fn at(file: &str, line: usize, col: usize) -> Self {
        SrcLoc {
            file: file.to_string(),
            line,
            col,
            raw: None,
        }
    }

    /// Extracts the first `"file":line:col` from an MLIR location (file-line-col, name,
    /// call-site and fused locations all carry one); unknown locations give line 0. The
    /// location itself is kept in [`SrcLoc::raw`].
    pub fn from_location(loc: Location<'_>) -> Self {
        SrcLoc {
            raw: Some(RawLoc(loc.to_raw())),
            ..Self::from_location_text(&loc.to_string())
        }
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
                        return SrcLoc::at(&text[start + 1..end], line, col);
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Severity {
    /// Attached to another diagnostic.
    Note,
    /// What a pass decided on its own that the user may want to know (not a problem).
    Remark,
    /// Suspicious but not fatal.
    Warning,
    /// The input is wrong.
    Error,
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Severity::Note => "note",
            Severity::Remark => "remark",
            Severity::Warning => "warning",
            Severity::Error => "error",
        })
    }
}

/// One located message.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Diagnostic {
    /// Where.
    pub loc: SrcLoc,
    /// How serious.
    pub severity: Severity,
    /// What.
    pub message: String,
    /// What a tool reads from the diagnostic instead of its wording: a pass's decision as
    /// named values (`--plan=auto`'s chosen plan). Not rendered.
    pub facts: std::collections::BTreeMap<String, String>,
}

impl Diagnostic {
    /// Renders `file:line:col: error: message`, then the source line and a caret when
    /// `source` (the whole buffer) is given and the location is known.
    pub fn render(&self, source: Option<&str>) -> String {
        // A diagnostic without any location reads `error: ...`, never `<unknown>: error:`
        // (the tools name their input file in such diagnostics first: `in_file`).
        let mut out = if self.loc.file.is_empty() && self.loc.line == 0 {
            format!("{}: {}", self.severity, self.message)
        } else {
            format!("{}: {}: {}", self.loc, self.severity, self.message)
        };
        if let (Some(src), true) = (source, self.loc.line > 0) {
            if let Some(line) = src.lines().nth(self.loc.line - 1) {
                let (shown, caret) = window(line, self.loc.col.saturating_sub(1));
                out.push('\n');
                out.push_str(&shown);
                out.push('\n');
                out.push_str(&" ".repeat(caret));
                out.push('^');
            }
        }
        out
    }
}

/// How many characters of a source line a diagnostic shows; longer lines (a 70B model's
/// function signature is one line of ~100 kB) are cut to a window around the column.
const MAX_SHOWN: usize = 120;

/// The part of `line` to show for a caret at character `col` (0-based), and the caret's
/// column in it. Long lines are cut to [`MAX_SHOWN`] characters, marked with `...`.
fn window(line: &str, col: usize) -> (String, usize) {
    let chars: Vec<char> = line.chars().collect();
    if chars.len() <= MAX_SHOWN {
        return (line.to_string(), col);
    }
    let col = col.min(chars.len());
    let start = col.saturating_sub(MAX_SHOWN / 3);
    let end = (start + MAX_SHOWN).min(chars.len());
    let mut shown = String::new();
    let mut caret = col - start;
    if start > 0 {
        shown.push_str("...");
        caret += 3;
    }
    shown.extend(&chars[start..end]);
    if end < chars.len() {
        shown.push_str("...");
    }
    (shown, caret)
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

    /// Records a remark at `loc`.
    pub fn remark(&mut self, loc: &SrcLoc, message: impl Into<String>) {
        self.push(loc, Severity::Remark, message);
    }

    /// Records a remark at `loc` that carries `facts` ([`Diagnostic::facts`]).
    pub fn remark_with(
        &mut self,
        loc: &SrcLoc,
        message: impl Into<String>,
        facts: std::collections::BTreeMap<String, String>,
    ) {
        self.push(loc, Severity::Remark, message);
        if let Some(d) = self.0.last_mut() {
            d.facts = facts;
        }
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
            facts: Default::default(),
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

    /// Names `file` in every diagnostic that has no location (a module-level problem), so
    /// that no message reads `<unknown>:`.
    pub fn in_file(mut self, file: &str) -> Self {
        for d in &mut self.0 {
            if d.loc.file.is_empty() {
                d.loc.file = file.to_string();
            }
        }
        self
    }

    /// Renders the diagnostics for a terminal, in the order they were found (the first cause
    /// first): repeated diagnostics (same place, severity and message) are shown once, notes
    /// stay with the error or warning they follow, and after `limit` errors (0: no limit)
    /// the rest are counted in a last line, `... and N more errors (--error-limit=0 shows
    /// all)`. `source` (the whole buffer) adds the source line and a caret.
    pub fn render_limited(&self, source: Option<&str>, limit: usize) -> String {
        let mut seen = std::collections::HashSet::new();
        let mut lines: Vec<String> = Vec::new();
        let (mut errors, mut hidden) = (0usize, 0usize);
        // Whether the diagnostic a note would attach to was shown.
        let mut parent_shown = true;
        for d in &self.0 {
            if d.severity == Severity::Note {
                if parent_shown && seen.insert(d) {
                    lines.push(d.render(source));
                }
                continue;
            }
            parent_shown = false;
            if !seen.insert(d) {
                continue;
            }
            if d.severity == Severity::Error {
                if limit > 0 && errors >= limit {
                    hidden += 1;
                    continue;
                }
                errors += 1;
            }
            parent_shown = true;
            lines.push(d.render(source));
        }
        if hidden > 0 {
            lines.push(format!(
                "... and {hidden} more error{} (--error-limit=0 shows all)",
                if hidden == 1 { "" } else { "s" }
            ));
        }
        lines.join("\n")
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
    fn repeated_errors_are_shown_once_and_capped() {
        let at = |line| SrcLoc::at("f", line, 1);
        let mut d = Diagnostics::default();
        d.error(&at(1), "first cause");
        d.note(&at(1), "why");
        for i in 0..5 {
            d.error(&at(2), "same");
            d.error(&at(3 + i), format!("other {i}"));
        }
        let text = d.render_limited(None, 3);
        assert_eq!(
            text,
            "f:1:1: error: first cause\nf:1:1: note: why\nf:2:1: error: same\nf:3:1: error: other 0\n\
             ... and 4 more errors (--error-limit=0 shows all)"
        );
        assert_eq!(d.render_limited(None, 0).lines().count(), 8);
    }

    #[test]
    fn long_lines_are_cut_around_the_caret() {
        let line = format!("{}HERE{}", "a".repeat(500), "b".repeat(500));
        let d = Diagnostic {
            loc: SrcLoc::at("f", 1, 501),
            severity: Severity::Error,
            message: "bad".into(),
            facts: Default::default(),
        };
        let text = d.render(Some(&line));
        let shown: Vec<&str> = text.lines().collect();
        assert!(shown[1].len() <= MAX_SHOWN + 6, "{}", shown[1].len());
        assert!(shown[1].starts_with("...") && shown[1].ends_with("..."));
        let caret = shown[2].len() - 1;
        assert_eq!(&shown[1][caret..caret + 4], "HERE");
    }

    #[test]
    fn renders_caret() {
        let d = Diagnostic {
            loc: SrcLoc::at("f", 2, 3),
            severity: Severity::Error,
            message: "bad".into(),
            facts: Default::default(),
        };
        assert_eq!(
            d.render(Some("one\n  two\n")),
            "f:2:3: error: bad\n  two\n  ^"
        );
    }
}
