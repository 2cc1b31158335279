//! A parse that cannot take the tool down with it.
//!
//! MLIR 19's parser can corrupt its heap and abort while recovering from some malformed
//! inputs (found by the fuzzer: an unterminated function whose values are used before a
//! redefinition; upstream `mlir-opt-19` aborts on the same file). So the command-line tools
//! parse each input once in a forked child first. The child passes every diagnostic to the
//! parent as soon as MLIR reports it; when the child dies, the parent reports what it got
//! plus a note, exits 1, and never runs the parse that would crash it. MLIR 19 also accepts
//! some attribute spellings it cannot print (`array<i1: 0, 1>` segfaults its printer), so
//! the child then prints the module; if that crashes, a second child prints every attribute
//! and type, announcing each first, and the crash is reported at the op and attribute. A
//! valid input is then parsed again in the tool itself (parsing is a small part of any
//! run).
//!
//! Only the tools do this, before they start any thread; the library's
//! [`IrContext::parse`] is unchanged for embedders.

use melior::ir::ValueLike;
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::{Diagnostic, Diagnostics, Severity, SrcLoc};
use nnscaler_dialects::view::walk_nested;

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('\n', "\\n")
        .replace('\t', "\\t")
}

fn unescape(s: &str) -> String {
    let mut out = String::new();
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some(o) => out.push(o),
            None => {}
        }
    }
    out
}

/// A progress record: the child is about to print attribute `key` ("" for types) of the op
/// at `loc`.
fn progress(loc: &SrcLoc, key: &str) -> String {
    format!(
        "P\t{}\t{}\t{}\t{}\n",
        escape(&loc.file),
        loc.line,
        loc.col,
        escape(key)
    )
}

/// A second writer on the child's pipe (the first belongs to the diagnostic observer).
#[cfg(unix)]
fn writer_for_walk(fd: i32) -> std::fs::File {
    use std::os::fd::FromRawFd;
    // SAFETY: dup gives a new descriptor of the pipe that this File then owns.
    unsafe { std::fs::File::from_raw_fd(libc::dup(fd)) }
}

/// One diagnostic as a line: severity, file, line, column, message.
fn encode(d: &Diagnostic) -> String {
    let sev = match d.severity {
        Severity::Error => "E",
        Severity::Warning => "W",
        Severity::Note => "N",
        Severity::Remark => "R",
    };
    format!(
        "{sev}\t{}\t{}\t{}\t{}\n",
        escape(&d.loc.file),
        d.loc.line,
        d.loc.col,
        escape(&d.message)
    )
}

fn decode(line: &str) -> Option<Diagnostic> {
    let mut f = line.splitn(5, '\t');
    let severity = match f.next()? {
        "E" => Severity::Error,
        "W" => Severity::Warning,
        "R" => Severity::Remark,
        _ => Severity::Note,
    };
    let file = unescape(f.next()?);
    let line_no = f.next()?.parse().ok()?;
    let col = f.next()?.parse().ok()?;
    let message = unescape(f.next()?);
    Some(Diagnostic {
        loc: SrcLoc::at(&file, line_no, col),
        severity,
        message,
        facts: Default::default(),
    })
}

/// What the child does after a successful parse.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Print {
    /// Print the whole module once (fast): does MLIR survive printing it?
    Module,
    /// Print every attribute and type, announcing each first: which one kills MLIR?
    EachAttribute,
}

/// The marker the child writes before printing the whole module.
const PRINTING_MODULE: &str = "M\n";

/// Runs the parse (and `print`) in a forked child; returns what it wrote to the pipe and
/// whether it exited normally with code 0, or `None` when no child could be made.
#[cfg(unix)]
fn in_child(source: &str, name: &str, print: Print) -> Option<(String, bool, bool)> {
    use std::io::{Read, Write};
    use std::os::fd::FromRawFd;
    let mut fds = [0i32; 2];
    // SAFETY: pipe() writes two descriptors into the array it is given.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: the tools call this before they start threads of their own, so the child is
    // a copy of a process whose locks nobody holds (glibc's malloc is fork-safe), and it
    // only parses, prints and exits.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        // SAFETY: closing the descriptors pipe() just made.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        return None;
    }
    if pid == 0 {
        // The child: report every diagnostic at once, then exit without unwinding.
        // SAFETY: closing the read end, which the child does not use.
        unsafe { libc::close(fds[0]) };
        // SAFETY: fds[1] is the pipe's write end, owned by this process from here on.
        let out = unsafe { std::fs::File::from_raw_fd(fds[1]) };
        let writer = std::cell::RefCell::new(out);
        let ir = IrContext::with_observer(move |d| {
            let _ = writer.borrow_mut().write_all(encode(d).as_bytes());
        });
        let code = match ir.parse(source, name) {
            Ok(module) => {
                let mut w = writer_for_walk(fds[1]);
                let top = module.as_operation();
                match print {
                    Print::Module => {
                        let _ = w.write_all(PRINTING_MODULE.as_bytes());
                        let _ = top.to_string();
                    }
                    Print::EachAttribute => {
                        let mut print_op = |op: &melior::ir::OperationRef<'_, '_>| {
                            let loc = SrcLoc::from_location(op.location());
                            for (k, v) in op.attributes() {
                                let key = k.as_string_ref().as_str().unwrap_or("?").to_string();
                                let _ = w.write_all(progress(&loc, &key).as_bytes());
                                let _ = v.to_string();
                            }
                            let _ = w.write_all(progress(&loc, "").as_bytes());
                            for r in op.results() {
                                let _ = r.r#type().to_string();
                            }
                            for o in op.operands() {
                                let _ = o.r#type().to_string();
                            }
                        };
                        print_op(&top);
                        walk_nested(&top, &mut print_op);
                    }
                }
                0
            }
            Err(_) => 1,
        };
        // SAFETY: _exit ends the child without running the parent's atexit handlers or
        // destructors twice.
        unsafe { libc::_exit(code) };
    }
    // The parent.
    // SAFETY: closing the write end (the child holds its own copy); fds[0] is the read end,
    // owned by this function from here on.
    unsafe { libc::close(fds[1]) };
    let mut input = unsafe { std::fs::File::from_raw_fd(fds[0]) };
    let mut text = String::new();
    let _ = input.read_to_string(&mut text);
    let mut status = 0i32;
    // SAFETY: waiting for the child forked above.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    Some((text, ok, libc::WIFSIGNALED(status)))
}

/// Parses `source` (named `name`) in a child process. `Ok` when it parses and prints; the
/// parse's diagnostics when it does not, or when MLIR crashed (then with an error saying so,
/// at the op and attribute when printing crashed). Where processes cannot be forked this
/// does nothing and returns `Ok`.
pub fn check_parses(source: &str, name: &str) -> Result<(), Diagnostics> {
    #[cfg(unix)]
    {
        let file = SrcLoc::at(name, 0, 0);
        let Some((text, ok, crashed)) = in_child(source, name, Print::Module) else {
            return Ok(());
        };
        if ok {
            return Ok(());
        }
        if crashed && text.ends_with(PRINTING_MODULE) {
            // The parse succeeded and printing crashed: find the attribute, in a second child.
            let located = in_child(source, name, Print::EachAttribute)
                .and_then(|(t, _, crashed)| crashed.then_some(t))
                .and_then(|t| {
                    t.lines()
                        .last()
                        .and_then(|l| l.strip_prefix("P\t"))
                        .map(str::to_string)
                });
            let (at, what) = match located {
                Some(p) => {
                    let mut f = p.splitn(4, '\t');
                    let file = unescape(f.next().unwrap_or_default());
                    let line = f.next().and_then(|x| x.parse().ok()).unwrap_or(0);
                    let col = f.next().and_then(|x| x.parse().ok()).unwrap_or(0);
                    let what = match unescape(f.next().unwrap_or_default()).as_str() {
                        "" => "the types of this op".to_string(),
                        k => format!("attribute '{k}' of this op"),
                    };
                    (SrcLoc::at(&file, line, col), what)
                }
                None => (file.clone(), "this input".to_string()),
            };
            let mut d = Diagnostics::default();
            d.error(
                &at,
                format!(
                    "MLIR crashes printing {what} (an MLIR 19 bug: it accepts some spellings \
                     it cannot print, such as array<i1: 0, 1>; write array<i1: false, true>)"
                ),
            );
            return Err(d);
        }
        let mut diags = Diagnostics(text.lines().filter_map(decode).collect());
        if crashed {
            diags.error(
                &file,
                "MLIR's parser crashed on this input (an MLIR 19 bug in its error recovery); \
                 fix the errors above, if any, and check that every region is closed",
            );
        }
        if !diags.has_errors() {
            diags.error(&file, "could not parse the input");
        }
        Err(diags)
    }
    #[cfg(not(unix))]
    {
        let _ = (source, name);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diagnostics_cross_the_pipe_intact() {
        let d = Diagnostic {
            loc: SrcLoc::at("a\tb.mlir", 3, 7),
            severity: Severity::Error,
            message: "bad \\ thing\nsecond line".into(),
            facts: Default::default(),
        };
        assert_eq!(decode(encode(&d).trim_end_matches('\n')), Some(d));
    }

    #[test]
    fn good_and_bad_inputs() {
        assert!(check_parses("func.func @f() {\n  return\n}\n", "ok.mlir").is_ok());
        let e = check_parses("func.func @f() {\n  %0 = \n}\n", "bad.mlir").unwrap_err();
        assert_eq!(e.0[0].loc.file, "bad.mlir");
        assert_eq!((e.0[0].loc.line, e.0[0].loc.col), (2, 7));
    }

    #[test]
    fn an_attribute_mlir_cannot_print_is_an_error_at_its_op() {
        let src = "func.func @h() {\n  \"x.y\"() {d = array<i1: 0, 1>} : () -> ()\n  return\n}\n";
        let e = check_parses(src, "arr.mlir").unwrap_err();
        let d = &e.0[0];
        assert_eq!(
            (d.loc.file.as_str(), d.loc.line, d.loc.col),
            ("arr.mlir", 2, 3),
            "{e}"
        );
        assert!(
            d.message.contains("MLIR crashes printing attribute 'd'"),
            "{e}"
        );
    }

    #[test]
    fn a_parser_crash_is_an_error_not_an_abort() {
        // An unterminated function whose values are used before they are redefined:
        // MLIR 19's parser aborts on it (so does upstream mlir-opt-19).
        let src = r#"%48 = "x.a"(%33) : (tensor<5xf32>) -> i32
func.func @train(%arg0: i32, %arg4: i32, %arg6: i32) -> (i32, i32, i32, i32, i32, i32, i32) {
    %33 = "x.s"(%30) : (i32) -> tensor<5xf32>
    %42 = "x.r"(%20) : (i32) -> i32
    %43 = "x.r"(%40) : (i32) -> i32
    %44 = "x.r"(%41) : (i32) -> i32
    %45 = "x.r"(%x) : (i32) -> i32
    %46 = "x.r"(%38) : (i32) -> i32
    %47 = "x.r"(%32) : (i32) -> i32
    %48 = "x.r"(%33) : (i32) -> i32"#;
        let e = check_parses(src, "crash.mlir").unwrap_err();
        assert!(e.has_errors(), "{e}");
    }
}
