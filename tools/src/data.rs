//! `nnscaler data`: training data. `prepare-char` encodes a text as characters the way
//! nanoGPT's `shakespeare_char/prepare.py` does (the sorted distinct characters are the
//! vocabulary; the first 90% is `train.bin`, the rest `val.bin`, little-endian `u16`; the
//! vocabulary in `meta.json`); [`Dataset`] samples random blocks of it into batches; and
//! `random` writes a random batch for a model's data arguments.

use crate::output::Outputs;
use crate::read_input;
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::domain::Domain;
use nnscaler_dialects::types::Elem;
use nnscaler_runtime::tensor::{dims, Tensor};
use nnscaler_runtime::{io, rng};
use std::path::Path;

/// `nnscaler data`'s command line.
#[derive(clap::Args, Debug)]
#[command(about = "Prepare training data: a character-level corpus, or a random batch")]
pub struct DataArgs {
    #[command(subcommand)]
    cmd: DataCmd,
}

#[derive(clap::Subcommand, Debug)]
enum DataCmd {
    /// Encode a text by characters (nanoGPT's shakespeare_char): DIR/train.bin (first
    /// 90%), DIR/val.bin (the rest), little-endian u16 ids, and DIR/meta.json with the
    /// vocabulary (the sorted distinct characters).
    PrepareChar {
        /// The text (UTF-8), e.g. ../shared/data/tinyshakespeare/input.txt.
        text: String,
        /// The directory to write (made if missing; files are written only on success).
        #[arg(short = 'o', long = "output", value_name = "DIR")]
        output: String,
        /// Refuse a corpus whose train or val part is too short for one block of this many
        /// positions (the model's context).
        #[arg(long, value_name = "N")]
        block: Option<usize>,
    },
    /// A random batch for the arguments `nnscaler run MODEL` binds from --inputs (every
    /// argument but parameters and optimizer state), whole tensors: for a partitioned
    /// program (localized or pipelined) the one-device shapes, which `run` cuts for the
    /// devices. Integer ids are drawn below the vocabulary (the embedding table's rows, the
    /// logits' classes), floats from normal(0, 1); an optimizer step's `step` is --step
    /// and its `lr` --lr. Safetensors for `nnscaler run --inputs` and `nnscaler-rt run
    /// --inputs`.
    Random {
        /// The model (.mlir).
        model: String,
        /// Where to write the batch.
        #[arg(short = 'o', long = "output", value_name = "FILE")]
        output: String,
        /// The random seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// The function (as `nnscaler run --func`; default: the only one, or @train).
        #[arg(long, value_name = "NAME")]
        func: Option<String>,
        /// An optimizer step's step number (AdamW's bias correction; counts from 1).
        #[arg(long, value_name = "N", default_value_t = 1,
              value_parser = clap::value_parser!(u32).range(1..))]
        step: u32,
        /// An optimizer step's learning rate.
        #[arg(long, value_name = "LR", default_value_t = 1e-3)]
        lr: f32,
    },
}

/// Runs the command; returns what to print.
pub fn main(a: &DataArgs) -> Result<String, String> {
    match &a.cmd {
        DataCmd::PrepareChar {
            text,
            output,
            block,
        } => prepare_char(text, output, *block),
        DataCmd::Random {
            model,
            output,
            seed,
            func,
            step,
            lr,
        } => {
            if !lr.is_finite() {
                return Err(format!("--lr {lr}: the learning rate must be finite"));
            }
            let o = RandomOpts {
                func: func.as_deref(),
                step: *step as f32,
                lr: *lr,
            };
            random(model, output, *seed, &o)
        }
    }
}

/// Calls `f` on every character of the UTF-8 text at `path`, read a buffer at a time
/// (never the whole file); `-` is standard input, read once. Invalid UTF-8, a NUL byte
/// (binary data, never in a text corpus) or a character cut off at the end is an error
/// naming its byte offset. Returns the bytes read.
fn for_each_char(path: &str, mut f: impl FnMut(char) -> Result<(), String>) -> Result<u64, String> {
    use std::io::BufRead;
    let reader: Box<dyn std::io::Read> = if path == "-" {
        Box::new(std::io::stdin())
    } else {
        Box::new(std::fs::File::open(path).map_err(|e| format!("cannot read '{path}': {e}"))?)
    };
    let mut r = std::io::BufReader::with_capacity(1 << 20, reader);
    // Bytes of a character split across two reads, carried to the next.
    let mut pending: Vec<u8> = Vec::new();
    let mut offset = 0u64;
    let mut each = |text: &str, at: u64| -> Result<(), String> {
        for (i, c) in text.char_indices() {
            if c == '\0' {
                return Err(format!(
                    "{path}: a NUL byte at offset {}: binary data, not a text corpus",
                    at + i as u64
                ));
            }
            f(c)?;
        }
        Ok(())
    };
    loop {
        let buf = r
            .fill_buf()
            .map_err(|e| format!("cannot read '{path}': {e}"))?;
        if buf.is_empty() {
            break;
        }
        let n = buf.len();
        pending.extend_from_slice(buf);
        r.consume(n);
        let good = match std::str::from_utf8(&pending) {
            Ok(text) => {
                each(text, offset)?;
                pending.len()
            }
            Err(e) => {
                let good = e.valid_up_to();
                let text = std::str::from_utf8(&pending[..good]).map_err(|e| e.to_string())?;
                each(text, offset)?;
                if e.error_len().is_some() {
                    return Err(format!(
                        "{path}: not UTF-8 text: an invalid byte at offset {} (binary data?)",
                        offset + good as u64
                    ));
                }
                good
            }
        };
        offset += good as u64;
        pending.drain(..good);
    }
    if !pending.is_empty() {
        return Err(format!(
            "{path}: not UTF-8 text: a character cut off at the end (offset {offset})"
        ));
    }
    Ok(offset)
}

/// `nnscaler data prepare-char TEXT -o DIR`: DIR/train.bin and val.bin (u16 ids, the first
/// 90% and the last 10%) and meta.json (the vocabulary), written atomically; the summary.
/// The text is read twice, a buffer at a time (the vocabulary, then the ids, written as
/// they are made): memory stays flat whatever its size (standard input is read whole
/// once: it cannot be read twice). With `block`, a corpus whose train or val part is too
/// short for one block of `block + 1` tokens is refused.
pub fn prepare_char(text_path: &str, dir: &str, block: Option<usize>) -> Result<String, String> {
    // Standard input cannot be read twice: kept as it came.
    let stdin_text = if text_path == "-" {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut b)
            .map_err(|e| format!("cannot read stdin: {e}"))?;
        Some(b)
    } else {
        None
    };
    let pass = |f: &mut dyn FnMut(char) -> Result<(), String>| match &stdin_text {
        Some(b) => {
            let tmp = std::str::from_utf8(b).map_err(|e| {
                format!(
                    "-: not UTF-8 text: an invalid byte at offset {}",
                    e.valid_up_to()
                )
            })?;
            for (i, c) in tmp.char_indices() {
                if c == '\0' {
                    return Err(format!(
                        "-: a NUL byte at offset {i}: binary data, not a text corpus"
                    ));
                }
                f(c)?;
            }
            Ok(b.len() as u64)
        }
        None => for_each_char(text_path, f),
    };
    // Pass 1: the vocabulary and the length.
    let mut set = std::collections::BTreeSet::new();
    let mut count = 0u64;
    pass(&mut |c| {
        count += 1;
        if set.insert(c) && set.len() > usize::from(u16::MAX) {
            return Err(format!(
                "{text_path}: more than {} distinct characters do not fit u16 ids",
                u16::MAX
            ));
        }
        Ok(())
    })?;
    if count == 0 {
        return Err(format!("{text_path}: the text is empty"));
    }
    let chars: Vec<char> = set.into_iter().collect();
    let n = count * 9 / 10;
    if let Some(b) = block {
        let need = b as u64 + 2;
        if n < need || count - n < need {
            return Err(format!(
                "{text_path}: {count} characters make {n} train and {} val tokens, too few for one block of {b} (each part needs {need})",
                count - n
            ));
        }
    }
    let ids: std::collections::HashMap<char, u16> = chars
        .iter()
        .enumerate()
        .map(|(i, &c)| (c, i as u16))
        .collect();
    std::fs::create_dir_all(dir).map_err(|e| format!("{dir}: cannot make the directory: {e}"))?;
    let path = |f: &str| Path::new(dir).join(f).display().to_string();
    // Pass 2: the ids, streamed into the two files (the text must not change between the
    // passes: a different length or character is an error).
    let mut val: Vec<u8> = Vec::new();
    let mut out = Outputs::new();
    {
        use std::io::Write;
        let mut seen = 0u64;
        let mut changed = None;
        let mut encode = |w_train: &mut dyn Write, w_val: &mut dyn Write| -> std::io::Result<()> {
            let r = pass(&mut |c| {
                let Some(&id) = ids.get(&c) else {
                    changed.get_or_insert(format!("{text_path}: changed while it was read"));
                    return Ok(());
                };
                let w: &mut dyn Write = if seen < n { &mut *w_train } else { &mut *w_val };
                seen += 1;
                w.write_all(&id.to_le_bytes()).map_err(|e| e.to_string())
            });
            r.map_err(std::io::Error::other)?;
            Ok(())
        };
        // Both files are written in one pass: val's bytes wait in memory (10% of the ids).
        out.stage_with(&path("train.bin"), |w| encode(w, &mut val))
            .map_err(|e| e.to_string())?;
        if let Some(e) = changed {
            return Err(e);
        }
        if seen != count {
            return Err(format!("{text_path}: changed while it was read"));
        }
    }
    out.stage(&path("val.bin"), val)?;
    let meta = serde_json::json!({
        "vocab_size": chars.len(),
        "chars": chars.iter().collect::<String>(),
        "source": text_path,
    });
    out.stage(&path("meta.json"), format!("{meta:#}\n").into_bytes())?;
    out.commit()?;
    Ok(format!(
        "{text_path}: {count} characters, vocabulary {}; {dir}/train.bin {n} tokens, {dir}/val.bin {} tokens\n",
        chars.len(),
        count - n
    ))
}

pub use nnscaler_rt::data::{Dataset, Split};

/// What `data random` draws besides the seed: the function, and an optimizer step's
/// scalars.
struct RandomOpts<'a> {
    func: Option<&'a str>,
    step: f32,
    lr: f32,
}

fn random(model: &str, output: &str, seed: u64, o: &RandomOpts<'_>) -> Result<String, String> {
    let text = read_input(model)?;
    let ir = IrContext::new();
    crate::parse_guard::check_parses(&text, model)
        .map_err(|d| d.in_file(model).render_limited(Some(&text), 20))?;
    let m = ir
        .parse(&text, model)
        .map_err(|d| d.in_file(model).render_limited(Some(&text), 20))?;
    let d = nnscaler_dialects::verify::verify_module(&m);
    if d.has_errors() {
        return Err(d.in_file(model).render_limited(Some(&text), 20));
    }
    let (func, args) = crate::run::step_args(&m, model, o.func)?;
    let mut tensors: Vec<(String, Elem, Tensor)> = Vec::new();
    let mut drawn = Vec::new();
    for a in args.iter().filter(|a| !a.state) {
        let shape = dims(&a.ty);
        let n: usize = shape.iter().product();
        let stream = rng::name_stream(&a.name);
        let t = match (a.domain, a.ty.elem.is_float()) {
            (Some(Domain::AtLeast(_)), true) => {
                drawn.push(format!("{} = {}", a.name, o.step));
                Tensor::f32(&shape, vec![o.step; n])
            }
            // The learning rate: a scalar named `lr` (what --optimizer makes).
            (None, true) if a.name == "lr" && n == 1 => {
                drawn.push(format!("{} = {}", a.name, o.lr));
                Tensor::f32(&shape, vec![o.lr; n])
            }
            (_, true) => Tensor::f32(
                &shape,
                (0..n as u64)
                    .map(|k| rng::normal(seed, stream, k) as f32)
                    .collect(),
            ),
            (Some(Domain::Below(hi)), false) if hi > 0 => Tensor::i64(
                &shape,
                (0..n as u64)
                    .map(|k| (rng::bits(seed, stream, k) % hi as u64) as i64)
                    .collect(),
            ),
            (_, false) => {
                return Err(format!(
                    "{model}: @{func}: argument '{}' holds integers, but no embedding or loss says below what",
                    a.name
                ))
            }
        };
        tensors.push((a.name.clone(), a.ty.elem, t));
    }
    let refs: Vec<(String, Elem, &Tensor)> =
        tensors.iter().map(|(n, e, t)| (n.clone(), *e, t)).collect();
    crate::write_one(output, io::to_bytes(&refs)?)?;
    let names: Vec<String> = tensors
        .iter()
        .map(|(n, _, t)| format!("{n} {:?}", t.shape))
        .collect();
    let mut said = format!(
        "wrote {output}: {} tensor(s) for @{func}: {}",
        tensors.len(),
        names.join(", ")
    );
    if !drawn.is_empty() {
        said.push_str(&format!(" ({})", drawn.join(", ")));
    }
    if args.iter().any(|a| a.state) {
        said.push_str("; parameters and optimizer state come from --params or --init-seed");
    }
    said.push('\n');
    Ok(said)
}
