//! The model zoo: single-device training forwards (ending in a scalar loss) built as `dnn`
//! IR with named arguments (`nns.name`) and marked parameters (`nns.param`).
//!
//! * [`MlpConfig`]: linear + ReLU layers, cross-entropy over classes;
//! * [`GptConfig`]: nanoGPT — token + position embedding, pre-LayerNorm blocks with causal
//!   attention and GELU MLP, final norm, LM head tied to the token embedding;
//! * [`LlamaConfig`]: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention, untied LM head.
//!
//! [`preset`] names the standard sizes; [`build_module`] returns the module's MLIR text.

use nnscaler_dialects::builder::{BuildError, FuncBuilder, Val};
use nnscaler_dialects::types::Elem;

/// A multi-layer perceptron classifier.
#[derive(Clone, Debug, PartialEq)]
pub struct MlpConfig {
    /// Samples per step.
    pub batch: i64,
    /// Input features.
    pub inputs: i64,
    /// Hidden width.
    pub hidden: i64,
    /// Number of hidden layers (each linear + ReLU).
    pub layers: i64,
    /// Output classes.
    pub classes: i64,
}

/// A nanoGPT-style decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct GptConfig {
    /// Sequences per step.
    pub batch: i64,
    /// Tokens per sequence (the context length).
    pub block: i64,
    /// Vocabulary size.
    pub vocab: i64,
    /// Transformer blocks.
    pub layers: i64,
    /// Attention heads.
    pub heads: i64,
    /// Model width.
    pub width: i64,
    /// Dropout probability (0 leaves dropout out of the graph).
    pub dropout: f64,
}

/// A Llama-3-style decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Sequences per step.
    pub batch: i64,
    /// Tokens per sequence.
    pub seq: i64,
    /// Vocabulary size.
    pub vocab: i64,
    /// Transformer blocks.
    pub layers: i64,
    /// Query heads.
    pub heads: i64,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: i64,
    /// Model width.
    pub width: i64,
    /// SwiGLU hidden width.
    pub ffn: i64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub norm_eps: f64,
}

/// Any zoo model.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelConfig {
    /// See [`MlpConfig`].
    Mlp(MlpConfig),
    /// See [`GptConfig`].
    Gpt(GptConfig),
    /// See [`LlamaConfig`].
    Llama(LlamaConfig),
}

impl ModelConfig {
    /// The model family: `mlp`, `gpt` or `llama`.
    pub fn family(&self) -> &'static str {
        match self {
            ModelConfig::Mlp(_) => "mlp",
            ModelConfig::Gpt(_) => "gpt",
            ModelConfig::Llama(_) => "llama",
        }
    }

    /// Sets a size field by its flag name (`layers`, `heads`, `width`, ...).
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        let int = || -> Result<i64, String> {
            value
                .parse::<i64>()
                .ok()
                .filter(|&v| v > 0)
                .ok_or(format!("--{key} must be a positive integer, got '{value}'"))
        };
        let float = || -> Result<f64, String> {
            value
                .parse::<f64>()
                .map_err(|_| format!("--{key} must be a number, got '{value}'"))
        };
        let family = self.family();
        match (self, key) {
            (ModelConfig::Mlp(c), "batch") => c.batch = int()?,
            (ModelConfig::Mlp(c), "inputs") => c.inputs = int()?,
            (ModelConfig::Mlp(c), "hidden") => c.hidden = int()?,
            (ModelConfig::Mlp(c), "layers") => c.layers = int()?,
            (ModelConfig::Mlp(c), "classes") => c.classes = int()?,
            (ModelConfig::Gpt(c), "batch") => c.batch = int()?,
            (ModelConfig::Gpt(c), "block" | "seq") => c.block = int()?,
            (ModelConfig::Gpt(c), "vocab") => c.vocab = int()?,
            (ModelConfig::Gpt(c), "layers") => c.layers = int()?,
            (ModelConfig::Gpt(c), "heads") => c.heads = int()?,
            (ModelConfig::Gpt(c), "width") => c.width = int()?,
            (ModelConfig::Gpt(c), "dropout") => c.dropout = float()?,
            (ModelConfig::Llama(c), "batch") => c.batch = int()?,
            (ModelConfig::Llama(c), "seq" | "block") => c.seq = int()?,
            (ModelConfig::Llama(c), "vocab") => c.vocab = int()?,
            (ModelConfig::Llama(c), "layers") => c.layers = int()?,
            (ModelConfig::Llama(c), "heads") => c.heads = int()?,
            (ModelConfig::Llama(c), "kv-heads") => c.kv_heads = int()?,
            (ModelConfig::Llama(c), "width") => c.width = int()?,
            (ModelConfig::Llama(c), "ffn") => c.ffn = int()?,
            (ModelConfig::Llama(c), "rope-theta") => c.rope_theta = float()?,
            _ => return Err(format!("--{key} does not apply to {family} models")),
        }
        Ok(())
    }

    /// Checks that the sizes fit together (heads divide the width, ...).
    pub fn validate(&self) -> Result<(), String> {
        match self {
            ModelConfig::Mlp(_) => Ok(()),
            ModelConfig::Gpt(c) => {
                if c.width % c.heads != 0 {
                    return Err(format!(
                        "--heads {} does not divide --width {}",
                        c.heads, c.width
                    ));
                }
                if !(0.0..1.0).contains(&c.dropout) {
                    return Err(format!("--dropout {} must be in [0, 1)", c.dropout));
                }
                Ok(())
            }
            ModelConfig::Llama(c) => {
                if c.width % c.heads != 0 {
                    return Err(format!(
                        "--heads {} does not divide --width {}",
                        c.heads, c.width
                    ));
                }
                if c.heads % c.kv_heads != 0 {
                    return Err(format!(
                        "--kv-heads {} does not divide --heads {}",
                        c.kv_heads, c.heads
                    ));
                }
                if !(c.rope_theta.is_finite() && c.rope_theta > 0.0) {
                    return Err(format!(
                        "--rope-theta {} must be a positive number",
                        c.rope_theta
                    ));
                }
                if (c.width / c.heads) % 2 != 0 {
                    return Err(format!(
                        "head dim {} must be even for rotary embeddings",
                        c.width / c.heads
                    ));
                }
                Ok(())
            }
        }
    }
}

/// The default config of a family (used with size flags when no preset is given).
pub fn family_default(family: &str) -> Option<ModelConfig> {
    match family {
        "mlp" => preset("mlp-tiny"),
        "gpt" => preset("nanogpt-cpu"),
        "llama" => preset("llama-tiny"),
        _ => None,
    }
}

/// Every preset name with a one-line description.
pub const PRESETS: &[(&str, &str)] = &[
    ("mlp-tiny", "MLP 16 -> 32 x 2 -> 10, batch 8"),
    (
        "gpt-tiny",
        "GPT 2 layers, 2 heads, width 16, block 8, vocab 11, batch 2",
    ),
    (
        "nanogpt-cpu",
        "nanoGPT CPU config: 4 layers, 4 heads, width 128, block 64, vocab 65, batch 12",
    ),
    (
        "gpt2-124m",
        "GPT-2 small: 12 layers, 12 heads, width 768, block 1024, vocab 50257, batch 12",
    ),
    (
        "gpt3-175b",
        "GPT-3: 96 layers, 96 heads, width 12288, block 2048, vocab 50257, batch 8",
    ),
    (
        "llama-tiny",
        "Llama 2 layers, 4 heads / 2 kv, width 16, ffn 32, seq 8, vocab 11, batch 2",
    ),
    (
        "llama3-8b",
        "Llama 3 8B: 32 layers, 32 heads / 8 kv, width 4096, ffn 14336, seq 8192, vocab 128256, batch 8",
    ),
    (
        "llama3-70b",
        "Llama 3 70B: 80 layers, 64 heads / 8 kv, width 8192, ffn 28672, seq 8192, vocab 128256, batch 8",
    ),
];

/// A named preset.
pub fn preset(name: &str) -> Option<ModelConfig> {
    let gpt = |batch, block, vocab, layers, heads, width| {
        ModelConfig::Gpt(GptConfig {
            batch,
            block,
            vocab,
            layers,
            heads,
            width,
            dropout: 0.0,
        })
    };
    let llama = |batch, seq, vocab, layers, heads, kv_heads, width, ffn| {
        ModelConfig::Llama(LlamaConfig {
            batch,
            seq,
            vocab,
            layers,
            heads,
            kv_heads,
            width,
            ffn,
            rope_theta: 500000.0,
            norm_eps: 1e-5,
        })
    };
    Some(match name {
        "mlp-tiny" => ModelConfig::Mlp(MlpConfig {
            batch: 8,
            inputs: 16,
            hidden: 32,
            layers: 2,
            classes: 10,
        }),
        "gpt-tiny" => gpt(2, 8, 11, 2, 2, 16),
        "nanogpt-cpu" => gpt(12, 64, 65, 4, 4, 128),
        "gpt2-124m" => gpt(12, 1024, 50257, 12, 12, 768),
        // The large presets take 8 sequences, so that the usual meshes (dp = 2, 4, 8) divide
        // the batch; they are for planning, not for the CPU runtime.
        "gpt3-175b" => gpt(8, 2048, 50257, 96, 96, 12288),
        "llama-tiny" => llama(2, 8, 11, 2, 4, 2, 16, 32),
        "llama3-8b" => llama(8, 8192, 128256, 32, 32, 8, 4096, 14336),
        "llama3-70b" => llama(8, 8192, 128256, 80, 64, 8, 8192, 28672),
        _ => return None,
    })
}

/// Builds the model's training forward as a module (MLIR text), function `@train`.
pub fn build_module(config: &ModelConfig) -> Result<String, BuildError> {
    config.validate().map_err(|message| BuildError {
        op: config.family().into(),
        message,
    })?;
    let func = match config {
        ModelConfig::Mlp(c) => build_mlp(c)?,
        ModelConfig::Gpt(c) => build_gpt(c)?,
        ModelConfig::Llama(c) => build_llama(c)?,
    };
    Ok(format!("module {{\n{func}}}\n"))
}

fn build_mlp(c: &MlpConfig) -> Result<String, BuildError> {
    let mut b = FuncBuilder::new("train");
    let x = b.input("x", &[c.batch, c.inputs], Elem::F32);
    let y = b.input("labels", &[c.batch], Elem::I64);
    let mut h = x;
    let mut width = c.inputs;
    for i in 0..c.layers {
        let w = b.param(&format!("layers.{i}.weight"), &[c.hidden, width]);
        let bias = b.param(&format!("layers.{i}.bias"), &[c.hidden]);
        h = b.linear(&h, &w, Some(&bias))?;
        h = b.unary("relu", &h)?;
        width = c.hidden;
    }
    let w = b.param("head.weight", &[c.classes, width]);
    let bias = b.param("head.bias", &[c.classes]);
    let logits = b.linear(&h, &w, Some(&bias))?;
    let loss = b.cross_entropy(&logits, &y)?;
    Ok(b.finish(&[(&loss, "loss")]))
}

/// `[b, t, h*d] -> [b, h, t, d]`.
fn split_heads(b: &mut FuncBuilder, x: &Val, heads: i64, dim: i64) -> Result<Val, BuildError> {
    let s = x.shape().to_vec();
    let x = b.reshape(x, &[s[0], s[1], heads, dim])?;
    b.transpose(&x, &[0, 2, 1, 3])
}

/// `[b, h, t, d] -> [b, t, h*d]`.
fn merge_heads(b: &mut FuncBuilder, x: &Val) -> Result<Val, BuildError> {
    let s = x.shape().to_vec();
    let x = b.transpose(x, &[0, 2, 1, 3])?;
    b.reshape(&x, &[s[0], s[2], s[1] * s[3]])
}

fn build_gpt(c: &GptConfig) -> Result<String, BuildError> {
    let (bs, t, w, v) = (c.batch, c.block, c.width, c.vocab);
    let hd = w / c.heads;
    let mut b = FuncBuilder::new("train");
    let tokens = b.input("tokens", &[bs, t], Elem::I64);
    let targets = b.input("targets", &[bs, t], Elem::I64);
    let wte = b.param("wte", &[v, w]);
    let wpe = b.param("wpe", &[t, w]);
    let mut seed = 0;
    let mut dropout = |b: &mut FuncBuilder, x: Val| -> Result<Val, BuildError> {
        if c.dropout == 0.0 {
            return Ok(x);
        }
        seed += 1;
        b.dropout(&x, c.dropout, seed)
    };
    let tok = b.embedding(&tokens, &wte)?;
    let x = b.binary("add", &tok, &wpe)?;
    let mut x = dropout(&mut b, x)?;
    for i in 0..c.layers {
        let p = |n: &str| format!("h.{i}.{n}");
        let ln1_w = b.param(&p("ln_1.weight"), &[w]);
        let ln1_b = b.param(&p("ln_1.bias"), &[w]);
        let h = b.layer_norm(&x, &ln1_w, &ln1_b, 1e-5)?;
        let mut qkv = Vec::new();
        for n in ["q", "k", "v"] {
            let wt = b.param(&p(&format!("attn.{n}.weight")), &[w, w]);
            let bi = b.param(&p(&format!("attn.{n}.bias")), &[w]);
            let y = b.linear(&h, &wt, Some(&bi))?;
            qkv.push(split_heads(&mut b, &y, c.heads, hd)?);
        }
        let a = b.attention(&qkv[0], &qkv[1], &qkv[2], true)?;
        let a = merge_heads(&mut b, &a)?;
        let pw = b.param(&p("attn.proj.weight"), &[w, w]);
        let pb = b.param(&p("attn.proj.bias"), &[w]);
        let a = b.linear(&a, &pw, Some(&pb))?;
        let a = dropout(&mut b, a)?;
        x = b.binary("add", &x, &a)?;
        let ln2_w = b.param(&p("ln_2.weight"), &[w]);
        let ln2_b = b.param(&p("ln_2.bias"), &[w]);
        let h = b.layer_norm(&x, &ln2_w, &ln2_b, 1e-5)?;
        let fw = b.param(&p("mlp.fc.weight"), &[4 * w, w]);
        let fb = b.param(&p("mlp.fc.bias"), &[4 * w]);
        let h = b.linear(&h, &fw, Some(&fb))?;
        let h = b.gelu(&h, false)?;
        let pw = b.param(&p("mlp.proj.weight"), &[w, 4 * w]);
        let pb = b.param(&p("mlp.proj.bias"), &[w]);
        let h = b.linear(&h, &pw, Some(&pb))?;
        let h = dropout(&mut b, h)?;
        x = b.binary("add", &x, &h)?;
    }
    let lnf_w = b.param("ln_f.weight", &[w]);
    let lnf_b = b.param("ln_f.bias", &[w]);
    let x = b.layer_norm(&x, &lnf_w, &lnf_b, 1e-5)?;
    // The LM head shares the token embedding's weight, as in nanoGPT.
    // Cross-entropy over [batch, positions, vocab] directly: a split of the positions
    // (context parallelism) reaches the loss without a gather.
    let logits = b.linear(&x, &wte, None)?;
    let loss = b.cross_entropy(&logits, &targets)?;
    Ok(b.finish(&[(&loss, "loss")]))
}

fn build_llama(c: &LlamaConfig) -> Result<String, BuildError> {
    let (bs, t, w, v) = (c.batch, c.seq, c.width, c.vocab);
    let hd = w / c.heads;
    let mut b = FuncBuilder::new("train");
    let tokens = b.input("tokens", &[bs, t], Elem::I64);
    let targets = b.input("targets", &[bs, t], Elem::I64);
    let emb = b.param("embed_tokens.weight", &[v, w]);
    let mut x = b.embedding(&tokens, &emb)?;
    for i in 0..c.layers {
        let p = |n: &str| format!("layers.{i}.{n}");
        let n1 = b.param(&p("input_layernorm.weight"), &[w]);
        let h = b.rms_norm(&x, &n1, c.norm_eps)?;
        let wq = b.param(&p("self_attn.q_proj.weight"), &[c.heads * hd, w]);
        let wk = b.param(&p("self_attn.k_proj.weight"), &[c.kv_heads * hd, w]);
        let wv = b.param(&p("self_attn.v_proj.weight"), &[c.kv_heads * hd, w]);
        let q = b.linear(&h, &wq, None)?;
        let k = b.linear(&h, &wk, None)?;
        let vv = b.linear(&h, &wv, None)?;
        let q = split_heads(&mut b, &q, c.heads, hd)?;
        let k = split_heads(&mut b, &k, c.kv_heads, hd)?;
        let vv = split_heads(&mut b, &vv, c.kv_heads, hd)?;
        let q = b.rotary(&q, c.rope_theta)?;
        let k = b.rotary(&k, c.rope_theta)?;
        let a = b.attention(&q, &k, &vv, true)?;
        let a = merge_heads(&mut b, &a)?;
        let wo = b.param(&p("self_attn.o_proj.weight"), &[w, c.heads * hd]);
        let a = b.linear(&a, &wo, None)?;
        x = b.binary("add", &x, &a)?;
        let n2 = b.param(&p("post_attention_layernorm.weight"), &[w]);
        let h = b.rms_norm(&x, &n2, c.norm_eps)?;
        let wg = b.param(&p("mlp.gate_proj.weight"), &[c.ffn, w]);
        let wu = b.param(&p("mlp.up_proj.weight"), &[c.ffn, w]);
        let wd = b.param(&p("mlp.down_proj.weight"), &[w, c.ffn]);
        let g = b.linear(&h, &wg, None)?;
        let g = b.unary("silu", &g)?;
        let u = b.linear(&h, &wu, None)?;
        let h = b.binary("mul", &g, &u)?;
        let h = b.linear(&h, &wd, None)?;
        x = b.binary("add", &x, &h)?;
    }
    let nf = b.param("norm.weight", &[w]);
    let x = b.rms_norm(&x, &nf, c.norm_eps)?;
    let head = b.param("lm_head.weight", &[v, w]);
    let logits = b.linear(&x, &head, None)?;
    let loss = b.cross_entropy(&logits, &targets)?;
    Ok(b.finish(&[(&loss, "loss")]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use nnscaler_dialects::context::IrContext;
    use nnscaler_dialects::verify::verify_module;

    fn verified(name: &str) -> String {
        let text = build_module(&preset(name).unwrap()).unwrap();
        let ctx = IrContext::new();
        let m = ctx.parse(&text, name).unwrap_or_else(|d| panic!("{d}"));
        let d = verify_module(&m);
        assert!(d.is_empty(), "{d}");
        m.as_operation().to_string()
    }

    #[test]
    fn small_presets_verify_and_match_snapshots() {
        for name in ["mlp-tiny", "gpt-tiny", "llama-tiny"] {
            insta::assert_snapshot!(name, verified(name));
        }
    }

    #[test]
    fn nanogpt_cpu_verifies() {
        verified("nanogpt-cpu");
    }

    #[test]
    fn bad_sizes_are_named() {
        let mut c = preset("nanogpt-cpu").unwrap();
        c.set("heads", "3").unwrap();
        assert_eq!(
            build_module(&c).unwrap_err().message,
            "--heads 3 does not divide --width 128"
        );
        let mut c = preset("llama-tiny").unwrap();
        c.set("kv-heads", "3").unwrap();
        assert!(build_module(&c)
            .unwrap_err()
            .message
            .contains("--kv-heads 3"));
        assert!(c.set("ffn", "x").unwrap_err().contains("positive integer"));
        assert!(preset("mlp-tiny")
            .unwrap()
            .set("heads", "2")
            .unwrap_err()
            .contains("does not apply"));
    }
}
