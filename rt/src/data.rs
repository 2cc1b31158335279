//! A character corpus as `nnscaler data prepare-char` writes it (`train.bin`, `val.bin`:
//! little-endian `u16` ids; `meta.json`: the vocabulary), and the batches training draws
//! from it: counter-based, so the same seed and step give the same batch on any machine,
//! in any process, before or after a resume.

use crate::tensor::{Data, Tensor};
use std::path::Path;

/// A character corpus.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// Training ids.
    pub train: Vec<u16>,
    /// Validation ids.
    pub val: Vec<u16>,
    /// Vocabulary size.
    pub vocab: usize,
}

/// Which part of a dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// `train.bin`.
    Train,
    /// `val.bin`.
    Val,
}

impl Dataset {
    /// Reads `DIR/train.bin`, `DIR/val.bin` and `DIR/meta.json`.
    pub fn load(dir: &str) -> Result<Self, String> {
        let read = |f: &str| -> Result<Vec<u16>, String> {
            let p = Path::new(dir).join(f);
            let b = std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            if b.len() % 2 != 0 {
                return Err(format!("{}: odd length: not u16 ids", p.display()));
            }
            Ok(b.chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect())
        };
        let meta_path = Path::new(dir).join("meta.json");
        let meta: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(&meta_path)
                .map_err(|e| format!("{}: {e}", meta_path.display()))?,
        )
        .map_err(|e| format!("{}: {e}", meta_path.display()))?;
        let vocab = meta["vocab_size"]
            .as_u64()
            .ok_or(format!("{}: no vocab_size", meta_path.display()))? as usize;
        let (train, val) = (read("train.bin")?, read("val.bin")?);
        if let Some(bad) = train.iter().chain(&val).find(|&&x| usize::from(x) >= vocab) {
            return Err(format!(
                "{dir}: id {bad} is outside the vocabulary of {vocab}"
            ));
        }
        Ok(Dataset { train, val, vocab })
    }

    /// Refuses a corpus too short for one block of `block` (the model's context needs
    /// `block + 2` tokens); `dir` names it.
    pub fn check_block(&self, dir: &str, block: usize) -> Result<(), String> {
        for (part, ids) in [("train.bin", &self.train), ("val.bin", &self.val)] {
            if ids.len() <= block + 1 {
                return Err(format!(
                    "{dir}/{part}: {} tokens, too few for one block of {block} (the model's context needs {})",
                    ids.len(),
                    block + 2
                ));
            }
        }
        Ok(())
    }

    /// Batch `index` of `split` drawn under `seed`: `batch` blocks of `block + 1` tokens
    /// at random offsets (a counter-based draw: the same batch for the same arguments, on
    /// any machine), as inputs (the first `block`) and targets (the last `block`).
    pub fn batch(
        &self,
        split: Split,
        batch: usize,
        block: usize,
        seed: u64,
        index: u64,
    ) -> Result<(Tensor, Tensor), String> {
        let data = match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        };
        if data.len() <= block + 1 {
            return Err(format!(
                "the {split:?} data has {} tokens, too few for blocks of {block}",
                data.len()
            ));
        }
        let stream = match split {
            Split::Train => 1,
            Split::Val => 2,
        };
        let (mut x, mut y) = (
            Vec::with_capacity(batch * block),
            Vec::with_capacity(batch * block),
        );
        for b in 0..batch {
            let r = crate::rng::bits(seed, stream, index * batch as u64 + b as u64);
            let start = (r % (data.len() - block - 1) as u64) as usize;
            x.extend(data[start..start + block].iter().map(|&t| i64::from(t)));
            y.extend(
                data[start + 1..start + block + 1]
                    .iter()
                    .map(|&t| i64::from(t)),
            );
        }
        let shape = vec![batch, block];
        Ok((
            Tensor {
                shape: shape.clone(),
                data: Data::I64(x),
            },
            Tensor {
                shape,
                data: Data::I64(y),
            },
        ))
    }
}
