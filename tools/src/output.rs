//! Writing a command's output files: all of them or none, and never damaging the target.
//!
//! A command stages every output first ([`Outputs::stage`]) and commits them together
//! ([`Outputs::commit`]) once everything has succeeded, so a failure leaves nothing
//! half-written and no output of a failed command on disk.
//!
//! How a target is written depends on what it is:
//! - a regular file, or a path that does not exist yet: the data goes to a temporary file in
//!   the same directory, which is renamed over the target at commit (atomic; the existing
//!   file's permissions are kept);
//! - a symbolic link: the link is followed (to its final target, even a dangling one) and
//!   that target is written as above; the link itself stays a link;
//! - anything else (a character device such as `/dev/null`, a FIFO, a socket): written
//!   through, in place, never renamed over. Write errors are reported (`/dev/full` fails);
//! - `-`: standard output, flushed, with write errors reported.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// How many symbolic links a path may go through (as Linux's `MAXSYMLINKS`).
const MAX_LINKS: usize = 40;

#[derive(Debug)]
enum Target {
    /// Standard output.
    Stdout,
    /// Renamed from `tmp` onto `dest` at commit.
    Atomic { tmp: PathBuf, dest: PathBuf },
    /// Written in place at commit (devices, FIFOs, sockets), through the handle opened when
    /// staged (a FIFO is opened once: closing it would end its reader's input).
    Through { file: File },
}

#[derive(Debug)]
struct Staged {
    /// The path as the user gave it, for messages.
    shown: String,
    target: Target,
    /// Data still to write (for `Stdout` and `Through`; `Atomic` data is already in `tmp`).
    data: Vec<u8>,
}

/// The output files of one command, staged until all of them can be written.
#[derive(Debug, Default)]
pub struct Outputs {
    staged: Vec<Staged>,
    seen: HashSet<PathBuf>,
}

/// What `write` writes, in memory.
fn collect(write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> std::io::Result<Vec<u8>> {
    let mut data = Vec::new();
    write(&mut data).map(|()| data)
}

/// Follows symbolic links from `path` to the file that would really be written. A dangling
/// link resolves to the path it points at (which will be created).
fn resolve(path: &Path) -> Result<PathBuf, String> {
    let mut p = path.to_path_buf();
    for _ in 0..MAX_LINKS {
        match fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let to = fs::read_link(&p).map_err(|e| e.to_string())?;
                p = match p.parent() {
                    Some(dir) if to.is_relative() => dir.join(to),
                    _ => to,
                };
            }
            _ => return Ok(p),
        }
    }
    Err("too many levels of symbolic links".into())
}

impl Outputs {
    /// No outputs yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stages `data` for `path` (`-` is standard output). Regular files are written to a
    /// temporary file now, so that a full disk or a missing directory shows up before
    /// anything is committed. Errors name the path.
    pub fn stage(&mut self, path: &str, data: Vec<u8>) -> Result<(), String> {
        self.stage_with(path, |w| w.write_all(&data))
    }

    /// [`Outputs::stage`] with the data written by `write` as it is made: to a regular
    /// file's temporary through a buffer (nothing of it held in memory whole), to standard
    /// output or a device into memory until the commit.
    pub fn stage_with(
        &mut self,
        path: &str,
        write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
    ) -> Result<(), String> {
        let fail = |e: &dyn std::fmt::Display| format!("cannot write '{path}': {e}");

        if path == "-" {
            if self
                .staged
                .iter()
                .any(|s| matches!(s.target, Target::Stdout))
            {
                return Err("two outputs go to standard output ('-')".into());
            }
            let data = collect(write).map_err(|e| fail(&e))?;
            self.staged.push(Staged {
                shown: path.into(),
                target: Target::Stdout,
                data,
            });
            return Ok(());
        }
        if path.is_empty() {
            return Err("an output file name is empty".into());
        }
        let dest = resolve(Path::new(path)).map_err(|e| fail(&e))?;
        let key = dest
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .and_then(|d| fs::canonicalize(d).ok())
            .map(|d| d.join(dest.file_name().unwrap_or_default()))
            .unwrap_or_else(|| dest.clone());
        if !self.seen.insert(key) {
            return Err(format!(
                "'{path}' is given as more than one output; each output needs its own file"
            ));
        }
        let existing = fs::metadata(&dest).ok();
        if existing.as_ref().is_some_and(|m| m.is_dir()) {
            return Err(fail(&"is a directory"));
        }
        if existing.as_ref().is_some_and(|m| !m.is_file()) {
            // A device, FIFO or socket: opened now (so a permission problem shows before
            // anything is committed), written at commit.
            let file = OpenOptions::new()
                .write(true)
                .open(&dest)
                .map_err(|e| fail(&e))?;
            let data = collect(write).map_err(|e| fail(&e))?;
            self.staged.push(Staged {
                shown: path.into(),
                target: Target::Through { file },
                data,
            });
            return Ok(());
        }
        let dir = dest
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let file_name = dest
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| fail(&"not a file name"))?;
        let tmp = dir.join(format!(
            ".{file_name}.nnscaler-{}-{}.tmp",
            std::process::id(),
            self.staged.len()
        ));
        let written = (|| -> std::io::Result<()> {
            let f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
            let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
            write(&mut w)?;
            let f = w.into_inner().map_err(|e| e.into_error())?;
            f.sync_all()?;
            if let Some(m) = &existing {
                f.set_permissions(m.permissions())?;
            }
            Ok(())
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(fail(&e));
        }
        self.staged.push(Staged {
            shown: path.into(),
            target: Target::Atomic { tmp, dest },
            data: Vec::new(),
        });
        Ok(())
    }

    /// Writes every staged output: renames the temporary files into place, then writes
    /// devices, FIFOs and standard output. The first error is returned (naming the path).
    pub fn commit(mut self) -> Result<(), String> {
        let (atomic, rest): (Vec<Staged>, Vec<Staged>) = std::mem::take(&mut self.staged)
            .into_iter()
            .partition(|s| matches!(s.target, Target::Atomic { .. }));
        // Renames first: until one succeeds nothing of ours is on its target. After a failed
        // rename the remaining temporaries are removed and nothing else is written.
        let mut failed: Option<String> = None;
        for s in &atomic {
            let Target::Atomic { tmp, dest } = &s.target else {
                continue;
            };
            if failed.is_none() {
                if let Err(e) = fs::rename(tmp, dest) {
                    failed = Some(format!("cannot write '{}': {e}", s.shown));
                } else {
                    continue;
                }
            }
            let _ = fs::remove_file(tmp);
        }
        if let Some(e) = failed {
            return Err(e);
        }
        // The renames made durable: each directory they changed is synced (a crash after
        // this leaves the new files, not the old ones or none). Filesystems that cannot
        // sync a directory say so with EINVAL; that is not an error here.
        let mut dirs: Vec<&Path> = atomic
            .iter()
            .filter_map(|s| match &s.target {
                Target::Atomic { dest, .. } => Some(
                    dest.parent()
                        .filter(|d| !d.as_os_str().is_empty())
                        .unwrap_or(Path::new(".")),
                ),
                _ => None,
            })
            .collect();
        dirs.sort();
        dirs.dedup();
        for d in dirs {
            let synced = fs::File::open(d).and_then(|f| f.sync_all());
            if let Err(e) = synced {
                if e.raw_os_error() != Some(libc::EINVAL) {
                    return Err(format!("cannot sync directory '{}': {e}", d.display()));
                }
            }
        }
        for mut s in rest {
            let written = match &mut s.target {
                Target::Stdout => {
                    let mut out = std::io::stdout().lock();
                    out.write_all(&s.data).and_then(|()| out.flush())
                }
                Target::Through { file } => file.write_all(&s.data).and_then(|()| file.flush()),
                Target::Atomic { .. } => Ok(()),
            };
            written.map_err(|e| match s.target {
                Target::Stdout => format!("cannot write to standard output: {e}"),
                _ => format!("cannot write '{}': {e}", s.shown),
            })?;
        }
        Ok(())
    }
}

impl Drop for Outputs {
    /// Outputs never committed (the command failed) leave no temporary files behind.
    fn drop(&mut self) {
        for s in &self.staged {
            if let Target::Atomic { tmp, .. } = &s.target {
                let _ = fs::remove_file(tmp);
            }
        }
    }
}

/// Writes one output (see the module docs): `-` is standard output.
pub fn write_one(path: &str, data: Vec<u8>) -> Result<(), String> {
    let mut o = Outputs::new();
    o.stage(path, data)?;
    o.commit()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, FileTypeExt, PermissionsExt};

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("nnscaler-out-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect()
    }

    #[test]
    fn regular_files_are_replaced_atomically_keeping_permissions() {
        let d = scratch("regular");
        let f = d.join("out.txt");
        fs::write(&f, "old").unwrap();
        fs::set_permissions(&f, fs::Permissions::from_mode(0o640)).unwrap();
        write_one(f.to_str().unwrap(), b"new".to_vec()).unwrap();
        assert_eq!(fs::read_to_string(&f).unwrap(), "new");
        assert_eq!(
            fs::metadata(&f).unwrap().permissions().mode() & 0o777,
            0o640
        );
        write_one(d.join("fresh").to_str().unwrap(), b"x".to_vec()).unwrap();
        assert_eq!(fs::read_to_string(d.join("fresh")).unwrap(), "x");
        assert!(leftovers(&d).is_empty());
    }

    #[test]
    fn symlinks_stay_links_and_their_targets_are_written() {
        let d = scratch("links");
        let target = d.join("target.txt");
        fs::write(&target, "old").unwrap();
        let link = d.join("link.txt");
        symlink("target.txt", &link).unwrap();
        let chain = d.join("chain.txt");
        symlink(&link, &chain).unwrap();
        write_one(chain.to_str().unwrap(), b"new".to_vec()).unwrap();
        assert!(fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert!(fs::symlink_metadata(&chain)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(fs::read_to_string(&target).unwrap(), "new");
        // A dangling link: its target is created, the link stays.
        let dangling = d.join("dangling");
        symlink("made.txt", &dangling).unwrap();
        write_one(dangling.to_str().unwrap(), b"m".to_vec()).unwrap();
        assert!(fs::symlink_metadata(&dangling)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(fs::read_to_string(d.join("made.txt")).unwrap(), "m");
        // A loop is an error, not a hang.
        let (a, b) = (d.join("a"), d.join("b"));
        symlink(&b, &a).unwrap();
        symlink(&a, &b).unwrap();
        let e = write_one(a.to_str().unwrap(), b"x".to_vec()).unwrap_err();
        assert!(e.contains("too many levels of symbolic links"), "{e}");
    }

    #[test]
    fn devices_are_written_through_and_stay_devices() {
        write_one("/dev/null", b"discarded".to_vec()).unwrap();
        assert!(fs::metadata("/dev/null")
            .unwrap()
            .file_type()
            .is_char_device());
        if Path::new("/dev/full").exists() {
            let e = write_one("/dev/full", b"x".to_vec()).unwrap_err();
            assert!(e.starts_with("cannot write '/dev/full': "), "{e}");
            assert!(fs::metadata("/dev/full")
                .unwrap()
                .file_type()
                .is_char_device());
        }
    }

    #[test]
    fn fifos_are_written_through() {
        let d = scratch("fifo");
        let fifo = d.join("pipe");
        let ok = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            return; // no mkfifo on this machine
        }
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || fs::read(fifo).unwrap())
        };
        write_one(fifo.to_str().unwrap(), b"through".to_vec()).unwrap();
        assert_eq!(reader.join().unwrap(), b"through");
        assert!(fs::metadata(&fifo).unwrap().file_type().is_fifo());
    }

    #[test]
    fn all_or_nothing() {
        let d = scratch("all");
        let good = d.join("good");
        let mut o = Outputs::new();
        o.stage(good.to_str().unwrap(), b"1".to_vec()).unwrap();
        let e = o
            .stage(d.join("no/such/dir/x").to_str().unwrap(), b"2".to_vec())
            .unwrap_err();
        assert!(e.contains("no/such/dir/x"), "{e}");
        drop(o);
        assert!(!good.exists(), "nothing is written when one output fails");
        assert!(leftovers(&d).is_empty());
        // The same file twice, even through a link, is refused.
        let mut o = Outputs::new();
        o.stage(good.to_str().unwrap(), b"1".to_vec()).unwrap();
        symlink(&good, d.join("alias")).unwrap();
        let e = o
            .stage(d.join("alias").to_str().unwrap(), b"2".to_vec())
            .unwrap_err();
        assert!(e.contains("more than one output"), "{e}");
        // A directory is not an output file.
        let e = write_one(d.to_str().unwrap(), b"x".to_vec()).unwrap_err();
        assert!(e.contains("is a directory"), "{e}");
    }
}
