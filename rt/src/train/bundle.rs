//! A training bundle on disk: the manifest (`bundle.json`), the files it lists with their
//! sizes and checksums, written whole and checked before a run reads any of them.

use super::*;

/// A file of a bundle, with its size and checksum.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSum {
    /// The path inside the bundle.
    pub path: String,
    /// Bytes.
    pub bytes: u64,
    /// FNV-1a, 64 bits, as 16 hex digits.
    pub fnv1a64: String,
}

/// A bundle's `bundle.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// The format version ([`VERSION`]).
    pub version: u32,
    /// What it was built from (the config).
    pub source: String,
    /// The loop's settings.
    #[serde(rename = "loop")]
    pub run: Loop,
    /// The step the initial state is at (a bundle made from a checkpoint: its step).
    #[serde(default)]
    pub start: u64,
    /// The training state, in the step's argument order.
    pub state: Vec<StateSpec>,
    /// The training step's artifact.
    pub step: String,
    /// The evaluation forward's artifact (one device, no dropout).
    pub eval: String,
    /// The corpus's directory (as `nnscaler data prepare-char` writes it).
    pub data: String,
    /// The vocabulary size.
    pub vocab: u64,
    /// The devices of the step's mesh (1: one device).
    pub devices: u64,
    /// Every file with its size and checksum.
    pub files: Vec<FileSum>,
}

/// A bundle opened for a run: its directory and its checked manifest.
#[derive(Debug)]
pub struct Bundle {
    /// The directory.
    pub dir: PathBuf,
    /// The manifest.
    pub manifest: Manifest,
}

/// The files of a bundle in memory, to be written.
#[derive(Debug)]
pub struct BundleFiles {
    /// The manifest (its `files` filled in by [`BundleFiles::finish`]).
    pub manifest: Manifest,
    /// Path inside the bundle, bytes.
    pub files: Vec<(String, Vec<u8>)>,
}

impl BundleFiles {
    /// The manifest's bytes (with every file's size and checksum), and every file: what
    /// goes into the directory, `bundle.json` last.
    pub fn finish(mut self) -> Result<Vec<(String, Vec<u8>)>, String> {
        self.manifest.files = self
            .files
            .iter()
            .map(|(p, b)| FileSum {
                path: p.clone(),
                bytes: b.len() as u64,
                fnv1a64: format!("{:016x}", crate::artifact::fnv1a64(b)),
            })
            .collect();
        let json = serde_json::to_vec_pretty(&self.manifest).map_err(|e| e.to_string())?;
        self.files.push((MANIFEST.into(), json));
        Ok(self.files)
    }
}

impl Bundle {
    /// Opens bundle `dir`: its manifest (format and version), and every file it lists
    /// present with its size and checksum.
    pub fn open(dir: &str) -> Result<Bundle, String> {
        let path = Path::new(dir).join(MANIFEST);
        let text = std::fs::read(&path).map_err(|e| {
            format!(
                "{}: {e} (a bundle is a directory made by 'nnscaler train --bundle')",
                path.display()
            )
        })?;
        let head: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| format!("{}: not JSON ({e})", path.display()))?;
        if head["format"] != FORMAT {
            return Err(format!("{}: not an nnscaler bundle", path.display()));
        }
        if head["version"] != VERSION {
            return Err(format!(
                "{}: bundle format version {}; this nnscaler-rt reads version {VERSION} (rebuild the bundle with the nnscaler that matches it)",
                path.display(),
                head["version"]
            ));
        }
        let manifest: Manifest =
            serde_json::from_value(head).map_err(|e| format!("{}: {e}", path.display()))?;
        for f in &manifest.files {
            let p = Path::new(dir).join(&f.path);
            if f.path.split('/').any(|c| c == ".." || c.is_empty()) || f.path.starts_with('/') {
                return Err(format!(
                    "{}: file path '{}' leaves the bundle",
                    path.display(),
                    f.path
                ));
            }
            let bytes = std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            if bytes.len() as u64 != f.bytes {
                return Err(format!(
                    "{}: {} bytes, the manifest says {} (a truncated copy?)",
                    p.display(),
                    bytes.len(),
                    f.bytes
                ));
            }
            let sum = format!("{:016x}", crate::artifact::fnv1a64(&bytes));
            if sum != f.fnv1a64 {
                return Err(format!(
                    "{}: checksum {sum}, the manifest says {} (the file changed or is corrupt)",
                    p.display(),
                    f.fnv1a64
                ));
            }
        }
        for needed in [&manifest.step, &manifest.eval] {
            if !manifest.files.iter().any(|f| &f.path == needed) {
                return Err(format!(
                    "{}: '{needed}' is not among its files",
                    path.display()
                ));
            }
        }
        Ok(Bundle {
            dir: PathBuf::from(dir),
            manifest,
        })
    }

    /// A file of the bundle.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// An artifact of the bundle.
    pub fn artifact(&self, name: &str) -> Result<crate::Artifact, String> {
        let p = self.path(name);
        let bytes = std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        crate::Artifact::from_bytes(&bytes, &p.display().to_string())
    }

    /// The corpus.
    pub fn dataset(&self) -> Result<Dataset, String> {
        let d = Dataset::load(&self.path(&self.manifest.data).display().to_string())?;
        if d.vocab as u64 != self.manifest.vocab {
            return Err(format!(
                "{}: vocabulary {}, the bundle's model embeds {}",
                self.manifest.data, d.vocab, self.manifest.vocab
            ));
        }
        Ok(d)
    }

    /// That the manifest's state is the step's: every state tensor an argument of the
    /// step with its shape, and every argument of the step data, the step number, the
    /// learning rate or state (the manifest holds the checksums, so it is checked against
    /// the artifact, whose header is checksummed and checked on reading).
    pub fn check_state(&self, step: &crate::Artifact) -> Result<(), String> {
        let at = self.path(MANIFEST).display().to_string();
        let ports = &step.header.inputs;
        for s in &self.manifest.state {
            match ports.iter().find(|p| p.name == s.name) {
                Some(p) if p.global_shape == s.shape && p.elt == crate::artifact::Elt::F32 => {}
                Some(p) => {
                    return Err(format!(
                        "{at}: state '{}' is {:?}, but the step's argument is {:?} {:?}",
                        s.name, s.shape, p.elt, p.global_shape
                    ))
                }
                None => {
                    return Err(format!(
                        "{at}: state '{}' is no argument of the step",
                        s.name
                    ))
                }
            }
        }
        for p in ports {
            let known = matches!(p.name.as_str(), "tokens" | "targets" | "step" | "lr")
                || self.manifest.state.iter().any(|s| s.name == p.name);
            if !known {
                return Err(format!(
                    "{at}: the step's argument '{}' is neither data, the step, the learning rate nor state",
                    p.name
                ));
            }
        }
        Ok(())
    }

    /// The stored initial state (`init.safetensors`), if any of it is stored.
    pub fn stored(&self) -> Result<Option<BTreeMap<String, Tensor>>, String> {
        if !self.manifest.state.iter().any(|s| s.init == Init::Stored) {
            return Ok(None);
        }
        let p = self.path("init.safetensors");
        crate::tensor::read(&p.display().to_string()).map(Some)
    }
}
