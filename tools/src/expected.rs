//! `--verify-diagnostics`: checks that the diagnostics produced for a buffer are exactly
//! those its `// expected-error {{...}}` comments announce.
//!
//! Forms: `expected-error`, `expected-warning`, `expected-note`, each optionally followed
//! by `@+N` / `@-N` (relative line), `@below` / `@above` (next / previous line holding
//! code), then `{{message}}`; a diagnostic matches when its message contains the text.

use nnscaler_dialects::diag::{Diagnostic, Severity, SrcLoc};

/// One expectation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expected {
    /// Severity expected.
    pub severity: Severity,
    /// 1-based line the diagnostic must be on.
    pub line: usize,
    /// Text the message must contain.
    pub text: String,
    /// Line of the comment itself.
    pub at: usize,
}

/// Parses the expectations of `source`, whose first line is line `first_line`.
pub fn parse(source: &str, file: &str) -> Result<Vec<Expected>, Diagnostic> {
    let lines: Vec<&str> = source.lines().collect();
    let mut out = Vec::new();
    let is_code = |l: &str| {
        let t = l.trim();
        !t.is_empty() && !t.starts_with("//")
    };
    for (i, line) in lines.iter().enumerate() {
        let lineno = i + 1;
        for (key, sev) in [
            ("expected-error", Severity::Error),
            ("expected-warning", Severity::Warning),
            ("expected-note", Severity::Note),
            ("expected-remark", Severity::Remark),
        ] {
            let Some(pos) = line.find(key) else { continue };
            let rest = &line[pos + key.len()..];
            let bad = |msg: &str| Diagnostic {
                loc: SrcLoc::at(file, lineno, pos + 1),
                severity: Severity::Error,
                message: msg.into(),
                facts: Default::default(),
            };
            let rest = rest.trim_start();
            let (target, rest) = if let Some(r) = rest.strip_prefix('@') {
                let spec: String = r
                    .chars()
                    .take_while(|c| !c.is_whitespace() && *c != '{')
                    .collect();
                let r = &r[spec.len()..];
                let t = match spec.as_str() {
                    "below" => (lineno..lines.len())
                        .find(|&j| is_code(lines[j]))
                        .map(|j| j + 1),
                    "above" => (0..i).rev().find(|&j| is_code(lines[j])).map(|j| j + 1),
                    s => {
                        let off: i64 = s
                            .strip_prefix('+')
                            .unwrap_or(s)
                            .parse()
                            .map_err(|_| bad(&format!("bad line offset '@{s}'")))?;
                        Some((lineno as i64 + off).max(1) as usize)
                    }
                };
                (
                    t.ok_or_else(|| bad(&format!("no code line for '@{spec}'")))?,
                    r,
                )
            } else {
                (lineno, rest)
            };
            let rest = rest.trim_start();
            let Some(body) = rest.strip_prefix("{{") else {
                return Err(bad(&format!("{key} needs a message in {{{{...}}}}")));
            };
            let Some(end) = body.find("}}") else {
                return Err(bad("unterminated '{{' in expectation"));
            };
            out.push(Expected {
                severity: sev,
                line: target,
                text: body[..end].to_string(),
                at: lineno,
            });
        }
    }
    Ok(out)
}

/// Matches `got` against `want`; returns the problems (empty when they agree).
pub fn check(file: &str, want: &[Expected], got: &[Diagnostic]) -> Vec<Diagnostic> {
    let mut used = vec![false; got.len()];
    let mut problems = Vec::new();
    for w in want {
        let hit = got.iter().enumerate().position(|(i, d)| {
            !used[i]
                && d.severity == w.severity
                && d.loc.line == w.line
                && d.message.contains(&w.text)
        });
        match hit {
            Some(i) => used[i] = true,
            None => problems.push(Diagnostic {
                loc: SrcLoc::at(file, w.at, 1),
                severity: Severity::Error,
                message: format!(
                    "expected {} \"{}\" on line {} was not produced",
                    w.severity, w.text, w.line
                ),
                facts: Default::default(),
            }),
        }
    }
    for (i, d) in got.iter().enumerate() {
        if !used[i] {
            problems.push(Diagnostic {
                message: format!("unexpected {}: {}", d.severity, d.message),
                severity: Severity::Error,
                loc: d.loc.clone(),
                facts: Default::default(),
            });
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_forms() {
        let src = "a\n// expected-error @+1 {{bad}}\nx\n// expected-note @below {{n}}\n\ny\nz // expected-warning {{w}}\n";
        let e = parse(src, "f").unwrap();
        assert_eq!(e.iter().map(|e| e.line).collect::<Vec<_>>(), vec![3, 6, 7]);
        assert!(parse("// expected-error @x {{a}}", "f").is_err());
        assert!(parse("// expected-error oops", "f").is_err());
    }
}
