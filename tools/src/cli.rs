//! What both command-line tools share: exit codes, signals, argument parsers.

use std::process::ExitCode;

/// Restores the default action of SIGPIPE (Rust ignores it), so that a tool whose reader
/// went away (`nnscaler-opt --list-ops | head -5`) ends quietly as Unix tools do, instead
/// of failing on the broken pipe.
pub fn default_sigpipe() {
    // SAFETY: setting a signal's disposition to SIG_DFL at start-up, before any thread
    // exists, has no memory-safety preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Prints a clap outcome: `--help` and `--version` exit 0, a usage error exits 1 (not
/// clap's 2: every bad input of nnscaler exits 1).
pub fn clap_exit(e: clap::Error) -> ExitCode {
    let _ = e.print();
    if e.use_stderr() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// Parses a byte count (`512M`, `2GiB`, `1073741824`): nnscaler-rt's, shared by every
/// `--memory-limit` and `--memory-cap`.
pub use nnscaler_rt::memory::parse_bytes;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5k"), Ok(1536));
        for bad in ["", "0", "-1G", "12Q", "G", "nan", "1e30T"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }
}
