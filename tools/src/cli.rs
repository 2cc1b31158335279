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

/// Parses a byte count: a number with an optional K, M, G or T suffix (powers of 1024,
/// `B`/`iB` allowed: `512M`, `2GiB`, `1073741824`).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("'{text}': unknown unit '{c}' (use K, M, G or T)")),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: f64 = num
        .parse()
        .ok()
        .filter(|n: &f64| n.is_finite() && *n > 0.0)
        .ok_or_else(|| format!("'{text}' is not a positive size (e.g. 512M, 2G)"))?;
    let bytes = n * (1u64 << shift) as f64;
    if bytes >= u64::MAX as f64 {
        return Err(format!("'{text}' is too large"));
    }
    Ok(bytes as u64)
}

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
