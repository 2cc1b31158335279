//! What a run of an artifact takes, and the refusal of one that cannot have it: before the
//! first allocation, the arenas of every program on every device (the collectives' scratch
//! space is small beside them) and the whole arguments and results, against
//! `--memory-limit`, or what the machine has: the host's available memory (the least of
//! the system's, the cgroup's and the address space's, [`host_limit`]), or the GPU's free
//! memory.

use crate::artifact::Artifact;

/// The bytes of every program's arena on every device (saturating).
pub fn arenas(art: &Artifact) -> u64 {
    art.header.programs.iter().fold(0u64, |n, p| {
        n.saturating_add(p.arena_bytes.saturating_mul(p.devices.len() as u64))
    })
}

/// The bytes a run holds on the host for the whole arguments and results (saturating): an
/// argument twice (its file's bytes and the tensor), a result twice and 4 bytes an
/// element more (its assembly from the devices' pieces, which checks that replicas agree).
pub fn whole_tensors(art: &Artifact) -> u64 {
    let h = &art.header;
    let whole = |p: &crate::artifact::Port| crate::artifact::Buffer {
        shape: p.global_shape.clone(),
        elt: p.elt,
        offset: 0,
    };
    let args = h.inputs.iter().fold(0u64, |n, p| {
        n.saturating_add(whole(p).bytes().saturating_mul(2))
    });
    h.outputs.iter().fold(args, |n, p| {
        let b = whole(p);
        n.saturating_add(
            b.bytes()
                .saturating_mul(2)
                .saturating_add(b.len().saturating_mul(4)),
        )
    })
}

/// Which limit bounds the memory this process may still take on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostLimit {
    /// The system's available memory (`MemAvailable` of `/proc/meminfo`).
    Available,
    /// The process's cgroup (v2): its `memory.max` less its `memory.current`.
    Cgroup,
    /// The address-space limit (`ulimit -v`) less the address space in use: threads'
    /// stacks and malloc arenas count against it, not only tensors.
    AddressSpace,
}

impl std::fmt::Display for HostLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HostLimit::Available => "available system memory (MemAvailable)",
            HostLimit::Cgroup => "the cgroup's memory limit (memory.max)",
            HostLimit::AddressSpace => "the address-space limit (ulimit -v)",
        })
    }
}

/// The memory this process may still allocate on the host, and which limit says so: the
/// smallest of the system's available memory, the cgroup's limit less its use and the
/// address-space limit less the address space in use. `None` when none can be read (not
/// Linux). The one reading of it, for nnscaler-rt's refusals and the CPU runtime's.
pub fn host_limit() -> Option<(u64, HostLimit)> {
    [
        (meminfo_available(), HostLimit::Available),
        (cgroup_available(), HostLimit::Cgroup),
        (address_space_available(), HostLimit::AddressSpace),
    ]
    .into_iter()
    .filter_map(|(b, l)| Some((b?, l)))
    .fold(None, |best: Option<(u64, HostLimit)>, (b, l)| match best {
        Some((x, _)) if x <= b => best,
        _ => Some((b, l)),
    })
}

/// [`host_limit`] as [`check`] takes it: the bytes and what they are.
pub fn host_available() -> Option<(u64, String)> {
    host_limit().map(|(b, l)| (b, l.to_string()))
}

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// `key:   123 kB` from a /proc file, in bytes.
fn proc_kb(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb.saturating_mul(1024))
}

fn meminfo_available() -> Option<u64> {
    proc_kb(&read("/proc/meminfo")?, "MemAvailable:")
}

fn cgroup_available() -> Option<u64> {
    // cgroup v2: the process's group is the line `0::/path` of /proc/self/cgroup.
    let group = read("/proc/self/cgroup")?
        .lines()
        .find_map(|l| l.strip_prefix("0::").map(str::to_string))?;
    let dir = format!("/sys/fs/cgroup{}", group.trim_end_matches('/'));
    let max: u64 = read(&format!("{dir}/memory.max"))?.trim().parse().ok()?;
    let current: u64 = read(&format!("{dir}/memory.current"))
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    Some(max.saturating_sub(current))
}

fn address_space_available() -> Option<u64> {
    let limits = read("/proc/self/limits")?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max address space"))?;
    let soft = line.split_whitespace().nth(3)?;
    let soft: u64 = soft.parse().ok()?; // "unlimited" does not parse: no limit
    let used = proc_kb(&read("/proc/self/status")?, "VmSize:").unwrap_or(0);
    Some(soft.saturating_sub(used))
}

/// Refuses `art` when its arenas need more than `limit` (`--memory-limit`) or, without
/// one, than `available` says the machine has (nothing to compare with: no refusal).
pub fn check(
    art: &Artifact,
    limit: Option<u64>,
    available: Option<(u64, String)>,
) -> Result<(), String> {
    check_all(&[art], limit, available)
}

/// [`check`] for artifacts that run side by side (a training step and its evaluation
/// forward, each with its arenas allocated).
pub fn check_all(
    arts: &[&Artifact],
    limit: Option<u64>,
    available: Option<(u64, String)>,
) -> Result<(), String> {
    let (limit, what) = match (limit, available) {
        (Some(l), _) => (l, "--memory-limit".to_string()),
        (None, Some(a)) => a,
        (None, None) => return Ok(()),
    };
    let sum = |f: fn(&Artifact) -> u64| arts.iter().fold(0u64, |n, a| n.saturating_add(f(a)));
    let (a, w) = (sum(arenas), sum(whole_tensors));
    let need = a.saturating_add(w);
    if need > limit {
        let worst = arts
            .iter()
            .flat_map(|a| &a.header.programs)
            .max_by_key(|p| p.arena_bytes)
            .map(|p| {
                format!(
                    ", the largest program '{}''s {} bytes on each of {} device(s)",
                    p.name,
                    p.arena_bytes,
                    p.devices.len()
                )
            })
            .unwrap_or_default();
        return Err(format!(
            "the run needs {} ({need} bytes: arenas {a}{worst}; whole arguments and results {w}), but {what} leaves {} ({limit} bytes)",
            human(need),
            human(limit)
        ));
    }
    Ok(())
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

/// Bytes in binary units.
fn human(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", units[u])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arenas_past_the_limit_are_refused_naming_need_and_limit() {
        let mut a = crate::artifact::tests_support::sample();
        assert_eq!(arenas(&a), 512);
        // x: 16 bytes twice; y: 16 bytes twice and 4 elements of 4 bytes.
        assert_eq!(whole_tensors(&a), 80);
        assert!(check(&a, Some(592), None).is_ok());
        assert!(check(&a, Some(591), None).is_err());
        a.header.programs[0].arena_bytes = 1 << 52;
        let e = check(&a, None, Some((1 << 30, HostLimit::Available.to_string()))).unwrap_err();
        assert_eq!(
            e,
            "the run needs 4.0 PiB (4503599627370576 bytes: arenas 4503599627370496, the largest program 'f''s 4503599627370496 bytes on each of 1 device(s); whole arguments and results 80), but available system memory (MemAvailable) leaves 1.0 GiB (1073741824 bytes)"
        );
        let e = check(&a, Some(1000), None).unwrap_err();
        assert!(
            e.ends_with("but --memory-limit leaves 1000.0 B (1000 bytes)"),
            "{e}"
        );
        assert!(check(&a, None, None).is_ok());
        assert!(host_available().is_some_and(|(b, _)| b > 0));
    }
}
