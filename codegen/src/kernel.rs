//! What a generated kernel computes, independent of LLVM, and how ops become kernels.
//!
//! A [`Kernel`] is a body over an index space (`len` indices, one GPU thread each, or one
//! host loop iteration each) reading its input buffers and writing its output buffers.
//! [`lower`] turns one `dnn` op into kernels, temporaries and launches ([`Lowered`]): most
//! ops are one launch; the norm gradients are three (row statistics, then the input
//! gradient by row and the weight gradients by column, so no two threads add into one
//! element); cross-entropy is two (per-row losses, then their mean in row order, as the
//! reference sums). [`fuse`] groups a function's elementwise ops into single kernels.
//!
//! Every kernel reproduces the CPU runtime's reference arithmetic: the same formulas, the
//! same accumulation type (f64 where the reference uses it) and order, so results agree
//! to rounding.

use nnscaler_dialects::dnn;
use nnscaler_dialects::graph::{Graph, ValueId};
use nnscaler_dialects::scalar::{Expr, Un};
use nnscaler_dialects::types::{flag, AttrValue, Attrs, Elem, TensorType};
use std::collections::HashMap;

mod attention;
mod fuse;
mod lower;
pub use attention::*;
pub use fuse::{fuse, Group};
pub(crate) use lower::classes;
use lower::float;
pub use lower::{covered, lower};

/// A buffer's element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elt {
    /// f32.
    F32,
    /// i64 (token ids, targets).
    I64,
    /// bfloat16 values stored in 2 bytes, the high half of an f32's bits (see
    /// `program::store_bf16`): kernels widen them to f32 on load (exactly) and round to
    /// nearest even on store.
    Bf16,
}

impl Elt {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Elt::F32 => 4,
            Elt::I64 => 8,
            Elt::Bf16 => 2,
        }
    }
    /// Whether it holds floats (f32 or bf16; kernels compute on both as f32).
    pub fn is_float(self) -> bool {
        self != Elt::I64
    }
}

/// A buffer: a row-major tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Buf {
    /// Dimension lengths.
    pub shape: Vec<usize>,
    /// Element type.
    pub elt: Elt,
}

impl Buf {
    /// Bytes.
    pub fn bytes(&self) -> usize {
        self.len() * self.elt.size()
    }
    /// An f32 buffer.
    pub fn f32(shape: &[usize]) -> Self {
        Buf {
            shape: shape.to_vec(),
            elt: Elt::F32,
        }
    }
    /// Elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The buffer of a tensor type.
    pub fn of(t: &TensorType) -> Self {
        Buf {
            shape: t.shape.iter().map(|&d| d as usize).collect(),
            elt: if t.elem.is_float() {
                Elt::F32
            } else {
                Elt::I64
            },
        }
    }
}

/// Reductions over dims (`dnn.sum`, `dnn.mean`, `dnn.max`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Reduce {
    /// Sum, accumulated in f64.
    Sum,
    /// Sum in f64 divided by this count.
    Mean(usize),
    /// Maximum (NaN ignored, as `f32::max`).
    Max,
}

/// Functions of whole lines along one dim (the softmax family).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Line {
    /// `softmax(x)`.
    Softmax,
    /// `log_softmax(x)`.
    LogSoftmax,
    /// `y (dy - sum(dy y))` from `dy, y`.
    SoftmaxGrad,
    /// `dy - exp(y) sum(dy)` from `dy, y`.
    LogSoftmaxGrad,
}

/// What a kernel computes for its index `i`.
#[derive(Clone, Debug, PartialEq)]
pub enum Body {
    /// Element `i` of every output: `exprs[k]` over the inputs broadcast (numpy) to
    /// output 0's shape (all outputs have it).
    Map(Vec<Expr>),
    /// Output element `i`: the reduction of the input over `dims` (row-major order).
    Reduce {
        /// Which reduction.
        op: Reduce,
        /// The reduced dims of the input.
        dims: Vec<usize>,
    },
    /// Element `(o, p)` of `[outputs, parts]` partial results: output `o`'s reduction
    /// (sum or max) over its `p`-th run of `ceil(count / parts)` elements (row-major over
    /// `dims`); [`Body::Reduce`] over the parts finishes it. A team kernel always: one
    /// block per part, so a reduction of a few outputs over millions of elements (a
    /// gradient's squared norm) runs on many blocks.
    ReducePart {
        /// [`Reduce::Sum`] or [`Reduce::Max`].
        op: Reduce,
        /// The reduced dims of the input.
        dims: Vec<usize>,
        /// Parts per output.
        parts: usize,
    },
    /// Team `i` of a reduction over leading dims, the input viewed as `[rows, cols]`
    /// (rows: the reduced leading dims, cols: the kept trailing ones, contiguous): team
    /// `i` is part `i / tiles` of the rows and tile `i % tiles` of [`COL_TILE`] columns.
    /// Lane `l` owns column `l % COL_TILE` of the tile and rows `l / COL_TILE, + COL_GROUPS,
    /// ...` of the part, so a warp reads consecutive columns of one row (coalesced, where a
    /// team per column reads one word per row `cols` apart); the groups' f64 partials are
    /// added in group order. With one part it writes the result; with more, each part's
    /// f64 sum (or max) as an f32 pair `[parts, 2, cols]` (the rounded value, then what
    /// rounding left: about 48 bits), which a `ColReduce` with `pairs` adds up.
    ColReduce {
        /// The reduction (a mean divides by its count at the end).
        op: Reduce,
        /// Rows reduced.
        rows: usize,
        /// Columns kept.
        cols: usize,
        /// Parts the rows are cut into (1: the whole reduction here).
        parts: usize,
        /// The input is pairs `[rows, 2, cols]` (the parts of another `ColReduce`).
        pairs: bool,
    },
    /// A norm's weight gradients by column tiles, as [`Body::ColReduce`] maps lanes:
    /// `dy, x, stats -> dw [, db]` (one part) or their parts' sums as pairs
    /// `[parts, 2, h]`.
    NormGradColTiles {
        /// RMS norm (no bias gradient).
        rms: bool,
        /// Parts the rows are cut into.
        parts: usize,
    },
    /// Input element `i` of `max`'s gradient: `dy, x -> dx`, `dy` of its group (the
    /// elements reduced together over `dims`) split evenly among the group's maxima.
    MaxGrad {
        /// The reduced dims of `x`.
        dims: Vec<usize>,
    },
    /// Line `i` of the input(s) along `dim`.
    Lines {
        /// Which function.
        op: Line,
        /// The dim.
        dim: usize,
    },
    /// Output element `i`: the input element at the permuted index (`perm[d]` is the
    /// input dim of output dim `d`).
    Transpose(Vec<usize>),
    /// Row `i` of layer norm (`x, w, b`) or RMS norm (`x, w`) over the last dim.
    Norm {
        /// RMS norm.
        rms: bool,
        /// Epsilon.
        eps: f64,
    },
    /// Row `i` of a norm's backward: `dy, x, w -> dx, stats` (`stats[i] = [mean, rstd]`,
    /// mean 0 for RMS norm).
    NormGradRows {
        /// RMS norm.
        rms: bool,
        /// Epsilon.
        eps: f64,
    },
    /// Column `i` of a norm's weight gradients: `dy, x, stats -> dw [, db]`, rows in order.
    NormGradCols {
        /// RMS norm (no bias gradient).
        rms: bool,
    },
    /// Output element `i` of an embedding lookup: `ids, table [, offset] -> out`; on a
    /// shard of the table's rows, `offset` (an i64 scalar) is its first row and ids outside
    /// it give 0.
    Embedding {
        /// The table is a row shard (a third input).
        sharded: bool,
    },
    /// Row `i`'s target logit: `logits [rows, v], targets [, offset] -> out [rows]`; on a
    /// class shard, targets outside it give 0.
    Pick {
        /// The logits are a class shard (a third input).
        sharded: bool,
    },
    /// Output element `i` of `pick`'s gradient: `dy [rows], targets -> out [rows, v]`,
    /// `dy[r]` where the column is row `r`'s target, else 0.
    PickGrad,
    /// Row `i` of cross-entropy's gradient from a known log-sum-exp:
    /// `dloss, logits, targets, lse [, offset] -> dlogits` (`dnn.softmax_xent_grad`).
    XentGradLse {
        /// Rows the loss averages over.
        count: usize,
        /// The logits are a class shard (a fifth input).
        sharded: bool,
    },
    /// Token `i`'s link in the list of tokens with its id (an embedding gradient of a
    /// table above [`EMBED_ROWS_MAX`]): `ids -> links` (i64, one per token): the next
    /// token with the same id (`tokens` if none), plus `tokens + 1` where an earlier token
    /// has the id too (then `i` does not head its list); -1 for an id outside the table's
    /// `rows`. Each thread scans every id once.
    EmbeddingLinks {
        /// The table's rows.
        rows: usize,
    },
    /// Element `i` of `[tokens, columns]` (token `t`, column `c`) of an embedding's
    /// gradient of a large table: where `t` heads its id's list ([`Body::EmbeddingLinks`]),
    /// column `c` of `dy` summed over the list in token order (from 0, as the reference
    /// sums, so the same bits) into the id's row of the table; other threads store
    /// nothing: `dy, ids, links -> table`, the table zeroed before (rows no token names).
    EmbeddingGradLists,
    /// Team `i` of an embedding's gradient by rows: row `i % rows` of the table over part
    /// `i / rows` of the tokens (`dy, ids -> out`), a team kernel: each lane owns columns
    /// `lane, lane + t, ...` and sums, for each, the `dy` of the part's tokens whose id is
    /// the row, in token order. One part: the table (the reference's order, so the same
    /// bits); more: each part's f64 sums as f32 pairs `[parts, 2, rows x columns]`, added
    /// up by a [`Body::ColReduce`], so the scan of the ids is spread over `rows x parts`
    /// teams.
    /// For tables of up to [`EMBED_ROWS_MAX`] elements, where reading the ids per row
    /// costs less than the column kernel's one dependent read-modify-write per token.
    EmbeddingGradRows {
        /// Parts the tokens are cut into.
        parts: usize,
    },
    /// Row `i`'s cross-entropy `lse - logit[target]` (f64 sums): `logits, targets -> loss`.
    XentRows,
    /// The mean of the row losses (`count` rows), one thread: `loss -> mean`.
    MeanOf {
        /// The divisor.
        count: usize,
    },
    /// Row `i` of cross-entropy's gradient: `dloss, logits, targets -> dlogits`.
    XentGrad {
        /// Rows the loss averages over.
        count: usize,
    },
    /// Element `i` of one AdamW step: `p, g, m, v, lr, step [, scale] -> p', m', v'`.
    AdamW {
        /// beta1.
        b1: f64,
        /// beta2.
        b2: f64,
        /// eps.
        eps: f64,
        /// Weight decay.
        wd: f64,
    },
    /// One AdamW step over several tensors in one launch (as PyTorch's multi-tensor
    /// AdamW): element `i` of the tensors laid end to end (tensor `j` has `lens[j]`
    /// elements and weight decay `wds[j]`), each updated as [`Body::AdamW`] updates it.
    /// Inputs `p, g, m, v` of each tensor in turn, then `lr, step [, scale]`; outputs
    /// `p', m', v'` of each in turn.
    AdamWMulti {
        b1: f64,
        b2: f64,
        eps: f64,
        /// Each tensor's weight decay.
        wds: Vec<f64>,
        /// Each tensor's elements.
        lens: Vec<usize>,
    },
    /// Clipping's factor `min(1, max_norm / (sqrt(s) + 1e-6))`, one thread.
    ClipScale {
        /// max_norm.
        max_norm: f64,
    },
    /// Element `i` copied (a reshape: same elements, new shape; f32 or i64).
    Copy,
    /// Output element `i` of the inputs placed back to back along `dim` (f32 or i64):
    /// input `k` covers output coordinates `starts[k]..starts[k] + its length`; elsewhere
    /// 0 (`concat` with its inputs' offsets, `pad` with one input at `before`).
    Place {
        /// The dim.
        dim: usize,
        /// Where each input starts along it.
        starts: Vec<usize>,
    },
    /// Output element `i` read at coordinate `c + start` along `dim` of the input (`slice`,
    /// each result of `split`; f32 or i64).
    Window {
        /// The dim.
        dim: usize,
        /// The first coordinate read.
        start: usize,
    },
    /// Element `i` of dropout: `x [, step] [, offsets] -> out`, the mask the runtime's
    /// counter-based RNG draws for (seed, the element's index in the whole tensor) (seed
    /// mixed with the step when given). On a shard, `offsets` (i64, one per dim) place it
    /// in the whole tensor of shape `global`.
    Dropout {
        /// Drop probability.
        p: f64,
        /// The mask's seed.
        seed: u64,
        /// The whole tensor's shape, on a shard.
        global: Option<Vec<usize>>,
        /// A step operand is given.
        step: bool,
    },
    /// Element `i` of a rotary position embedding of `x [b, h, s, d]` (rotate-half form):
    /// `x, cos, sin -> out`, the tables `[s, d / 2]` (sin signed: the gradient rotates back).
    Rotary {
        /// Positions.
        s: usize,
        /// Width (even).
        d: usize,
    },
    /// Output element `i` of a matrix product (on a GPU, a cuBLAS call replaces it).
    Gemm(Gemm),
    /// Query row `i` of scaled dot-product attention: `q, k, v -> out`.
    Attention(Attn),
    /// Query row `i` of attention's backward statistics: `dout, q, k, v -> stats`
    /// (`[max, 1/sum, rowsum(dP * P)]` per row).
    AttnStats(Attn),
    /// Query row `i` of `dq`: `dout, q, k, v, stats -> dq`.
    AttnDq(Attn),
    /// Key row `i` of `dk` and `dv` (every query head of its group, rows in order):
    /// `dout, q, k, v, stats -> dk, dv`.
    AttnDkDv(Attn),
    /// Attention by tiles (FlashAttention-2, `llvm/tiles.rs`), a team kernel: block `r`
    /// is query tile `r % q_tiles` of head `r / q_tiles` ([`Tiles`]), a lane per query
    /// row; keys and values are staged a tile at a time in shared memory and folded into
    /// the lane's online softmax (running maximum, sum and weighted sum in registers), each
    /// key scored once. `q, k, v -> out`.
    AttnTiles(Attn),
    /// Attention's backward statistics and `dq` by query tiles (as [`Body::AttnTiles`]):
    /// the forward's pass for the row's maximum, `1/sum` and `D = dO . out` (=
    /// `rowsum(dP * P)`), stored as the statistics, then `dq` from a second pass over the
    /// key tiles, recomputing `P` from them. `dout, q, k, v -> stats, dq`: what
    /// [`Body::AttnStats`] and [`Body::AttnDq`] compute, within rounding.
    AttnTilesBack(Attn),
    /// `dk, dv` by key tiles: block `r` is key tile `r % k_tiles` of key/value head
    /// `r / k_tiles`, a lane per key row, the queries (their `q`, `dO` and statistics)
    /// staged a tile at a time in shared memory, heads of the group then positions in
    /// order, as [`Body::AttnDkDv`]; `P` recomputed from the statistics. `dout, q, k, v,
    /// stats -> dk, dv`.
    AttnTilesKv(Attn),
    /// The forward on tensor cores (`llvm/mma/`), 2-byte bf16 operands: block `r` is
    /// query tile `r % q_tiles` ([`MMA_ROWS`] rows) of head `r / q_tiles`, four warps of
    /// 16 rows each; `S = Q K^T` and `O += P V` as warp-wide `mma.sync` products
    /// (m16n8k16, bf16 in, f32 sums) of tiles staged in shared memory, the online
    /// softmax on the products' f32 fragments, `P` rounded to bf16 for its product. `q,
    /// k, v -> out` (and the statistics where [`Attn::saved`]), as [`Body::AttnTiles`]
    /// within bf16 rounding.
    AttnMma(Attn),
    /// The backward's statistics and `dq` on tensor cores ([`Attn::saved`] only: the
    /// forward's output and statistics are inputs): blocks as [`Body::AttnMma`]; per key
    /// tile `S = Q K^T` and `dP = dO V^T` as products, `dS = P (dP - D)` rounded to bf16,
    /// `dq += dS K`. `dout, q, k, v, out, stats (, offset) -> stats3, dq`, as
    /// [`Body::AttnTilesBack`] within bf16 rounding.
    AttnMmaBack(Attn),
    /// `dk`, `dv` on tensor cores: block `r` is key tile `r % k_tiles` ([`MMA_ROWS`] keys,
    /// four warps of 16) of key/value head `r / k_tiles`; per query tile (every query head
    /// of the group) `S^T = K Q^T`, `dP^T = V dO^T`, `dV += P^T dO`, `dK += dS^T Q`.
    /// `dout, q, k, v, stats3 (, offset) -> dk, dv`, as [`Body::AttnTilesKv`] within bf16
    /// rounding.
    AttnMmaKv(Attn),
}

/// A (batched) matrix product `out[b] = A[b] B[b]`, row-major operands; `A` is
/// `[m, k]` or, transposed, `[k, m]`; `B` is `[k, n]` or, transposed, `[n, k]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemm {
    /// Independent products.
    pub batch: usize,
    /// Rows of the result.
    pub m: usize,
    /// Columns of the result.
    pub n: usize,
    /// The summed dimension.
    pub k: usize,
    /// `A` is stored transposed.
    pub ta: bool,
    /// `B` is stored transposed.
    pub tb: bool,
    /// Every product has its own `B` (else one `B` for all).
    pub b_batched: bool,
    /// A bias of `n` elements (the third input) is added to every row of the result
    /// after the sum (`dnn.linear`): the sum is rounded to f32, then the bias added, so
    /// the bits are those of the product stored and the bias added after it.
    pub bias: bool,
}

/// Elements of its line a lane of a row team (norms, softmax, cross-entropy, reductions
/// along a line) aims for: 1 (a lane per element, up to [`TEAM_MAX`] lanes: a row of 384
/// takes 256 lanes) or `NNSCALER_ROW_ELEMS=E` (a power of two up to 32: `ceil(line / E)`
/// lanes rounded up to a power of two, at least a warp), a tuning knob that
/// `bench/gpu/prepare.sh` sweeps for the next GPU run to choose the default from.
pub const ROW_ELEMS: usize = 1;

/// [`ROW_ELEMS`], or `NNSCALER_ROW_ELEMS` when set and valid.
pub fn row_elems() -> usize {
    static ELEMS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ELEMS.get_or_init(|| {
        let Ok(v) = std::env::var("NNSCALER_ROW_ELEMS") else {
            return ROW_ELEMS;
        };
        match v.trim().parse::<usize>() {
            Ok(e) if e.is_power_of_two() && e <= 32 => e,
            _ => {
                eprintln!("nnscaler: NNSCALER_ROW_ELEMS={v:?} ignored: a power of two up to 32");
                ROW_ELEMS
            }
        }
    })
}

/// The lanes of a row team for a line of `line` elements, each lane aiming for `elems`
/// of them (`line` at least [`TEAM_MIN`]).
pub fn row_lanes(line: usize, elems: usize) -> usize {
    line.div_ceil(elems.max(1))
        .next_power_of_two()
        .clamp(32, TEAM_MAX)
}

/// A kernel: its symbol, body, buffers and index count.
#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    /// The symbol (a valid PTX and C identifier).
    pub name: String,
    /// What index `i` computes.
    pub body: Body,
    /// Buffers read.
    pub inputs: Vec<Buf>,
    /// Buffers written.
    pub outputs: Vec<Buf>,
    /// Indices a launch covers.
    pub len: usize,
}

/// A reduction to fewer outputs than this over [`SPLIT_FROM`] elements or more each is
/// two kernels ([`Body::ReducePart`], then the parts' reduction).
pub const SPLIT_BELOW: usize = 64;
/// See [`SPLIT_BELOW`].
pub const SPLIT_FROM: usize = 1 << 16;
/// Elements per part of a split reduction, at least (16 per thread of a team of 256).
pub const SPLIT_PART: usize = 4096;
/// Parts per output of a split reduction, at most.
pub const SPLIT_PARTS: usize = 1024;

/// Tensors one multi-tensor AdamW launch updates at most ([`Body::AdamWMulti`]): 7
/// buffers each, whose pointers must fit a kernel's 4 KiB of parameters (PTX before 8.1).
pub const ADAMW_TENSORS: usize = 48;

/// The largest embedding table whose gradient is computed by rows
/// ([`Body::EmbeddingGradRows`]): each row scans every token id, `rows x columns x tokens`
/// steps in all. Larger tables are zeroed, then each token id's list of tokens is summed
/// per column by the thread of its first token ([`Body::EmbeddingLinks`],
/// [`Body::EmbeddingGradLists`]): `tokens^2` steps to link the lists and `tokens x
/// columns` threads, of which the lists' heads each add their list's `dy`s.
pub const EMBED_ROWS_MAX: usize = 1 << 21;

/// Columns of a column reduction's tile ([`Body::ColReduce`]): a warp's width.
pub const COL_TILE: usize = 32;
/// Row groups of a column reduction's team: `COL_TILE x COL_GROUPS` lanes.
pub const COL_GROUPS: usize = 8;
/// Teams a column reduction aims for, at least (enough blocks for every SM of a large GPU
/// several times over), cutting its rows into parts of at least [`COL_PART_ROWS`].
pub const COL_TEAMS: usize = 1024;
/// The fewest rows of a part of a column reduction.
pub const COL_PART_ROWS: usize = 64;

/// How many parts a column reduction of `rows x cols` cuts its rows into.
pub fn col_parts(rows: usize, cols: usize) -> usize {
    let tiles = cols.div_ceil(COL_TILE).max(1);
    COL_TEAMS
        .div_ceil(tiles)
        .min(rows / COL_PART_ROWS)
        .clamp(1, SPLIT_PARTS)
}

/// The shortest line a team of threads computes (shorter ones: one thread each).
pub const TEAM_MIN: usize = 64;
/// The largest team (threads of one GPU block).
pub const TEAM_MAX: usize = 256;

/// The names of the kernels launched over any count (the collectives' reducers,
/// `artifact::reducers`) start with this; every other kernel runs at most its `len`.
pub const ANY_LEN_PREFIX: &str = "nns_reduce_";

impl Kernel {
    /// Launched over any count (a collective's reducer), not its `len`.
    pub fn any_len(&self) -> bool {
        self.name.starts_with(ANY_LEN_PREFIX)
    }

    /// Threads that compute one index together: 1 (one thread per index), or, for a
    /// reduction along a line of at least [`TEAM_MIN`] elements (the row of a softmax, a
    /// norm, a cross-entropy, a sum), a power of two up to [`TEAM_MAX`]: one GPU block
    /// per index, its threads striding along the line and combining their partial
    /// results through shared memory, phase by phase with a barrier between phases.
    /// Consecutive threads read consecutive elements of a contiguous row (coalesced),
    /// where one thread per row reads rows a row apart.
    pub fn team(&self) -> usize {
        let first = |b: &[Buf]| b.first().map_or(0, Buf::len);
        let line = match &self.body {
            Body::Reduce { dims, .. } => dims
                .iter()
                .map(|&d| self.inputs[0].shape.get(d).copied().unwrap_or(1))
                .product(),
            Body::Lines { dim, .. } => self.inputs[0].shape.get(*dim).copied().unwrap_or(1),
            Body::Norm { .. } => self.inputs.get(1).map_or(0, Buf::len),
            Body::NormGradRows { .. } => self.inputs.get(2).map_or(0, Buf::len),
            Body::NormGradCols { .. } => self.inputs.get(2).map_or(0, |s| s.shape[0]),
            Body::XentRows => self.inputs.first().map_or(0, classes),
            Body::XentGrad { .. } | Body::XentGradLse { .. } => {
                self.inputs.get(1).map_or(0, classes)
            }
            Body::MeanOf { .. } => first(&self.inputs),
            Body::ReducePart { .. } => return TEAM_MAX,
            Body::ColReduce { .. } | Body::NormGradColTiles { .. } => return COL_TILE * COL_GROUPS,
            Body::EmbeddingGradRows { .. } => {
                // dy [tokens, w], ids [tokens]: the table's width.
                let tokens = self.inputs.get(1).map_or(1, Buf::len).max(1);
                let w = first(&self.inputs) / tokens;
                return w.next_power_of_two().clamp(32, TEAM_MAX);
            }
            Body::AttnTiles(a) | Body::AttnTilesBack(a) => return tile_lanes(a.s),
            Body::AttnTilesKv(_) => return ATTN_KV_LANES,
            Body::AttnMma(_) | Body::AttnMmaBack(_) | Body::AttnMmaKv(_) => return MMA_LANES,
            _ => return 1,
        };
        if line < TEAM_MIN {
            1
        } else {
            row_lanes(line, row_elems())
        }
    }
}

/// A launch's buffer: an op operand, result, a temporary or a constant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// Operand `k` of the op.
    In(usize),
    /// Result `k` of the op.
    Out(usize),
    /// Temporary `k`.
    Temp(usize),
    /// Constant `k` (values fixed at compile time, e.g. rotary's tables).
    Const(usize),
}

/// A constant's values.
#[derive(Clone, Debug, PartialEq)]
pub enum ConstValues {
    /// The same f32 values on every device.
    F32(Vec<f32>),
    /// An i64 scalar, per device: its block index along mesh axes `axes` (outer first)
    /// times `len`, the offset of its shard in the whole dim (0 without a mesh).
    Offset {
        /// The mesh axes splitting the dim.
        axes: Vec<String>,
        /// The shard's length.
        len: usize,
    },
    /// An i64 per dim, per device: each dim's [`ConstValues::Offset`].
    Offsets(Vec<(Vec<String>, usize)>),
    /// Per device, a rotary table `[s, d / 2]` of the positions of its block along mesh
    /// axes `axes` (a shard of `s` positions): [`rotary_table`] from the block's start.
    Rotary {
        /// The mesh axes splitting the positions.
        axes: Vec<String>,
        /// Positions in a shard.
        s: usize,
        /// The rotated width.
        d: usize,
        /// The base.
        theta: f64,
        /// `1` (forward) or `-1` (the gradient's inverse rotation), on the sines.
        sign: f32,
        /// The sine table (else the cosine one).
        sin: bool,
    },
}

/// The reference's rotary tables for positions `p0 .. p0 + s` (the CPU runtime's own
/// function, so the constants are its tables exactly).
pub use nnscaler_runtime::kernels::rotary_table;

/// One op as kernels: launched in order, each on its slots (inputs then outputs).
#[derive(Clone, Debug, PartialEq)]
pub struct Lowered {
    /// The kernels.
    pub kernels: Vec<Kernel>,
    /// Temporaries (live during the op only).
    pub temps: Vec<Buf>,
    /// Constants: buffers and their values (computed here as the reference computes
    /// them, or per device).
    pub consts: Vec<(Buf, ConstValues)>,
    /// `(kernel, slots)` in launch order.
    pub launches: Vec<(usize, Vec<Slot>)>,
}

impl Lowered {
    fn one(k: Kernel) -> Self {
        let slots = (0..k.inputs.len())
            .map(Slot::In)
            .chain((0..k.outputs.len()).map(Slot::Out))
            .collect();
        Lowered {
            kernels: vec![k],
            temps: Vec::new(),
            consts: Vec::new(),
            launches: vec![(0, slots)],
        }
    }
}

/// The fewest tokens of a part of an embedding's gradient by rows.
pub const EMBED_PART_TOKENS: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_teams_by_elements_per_lane() {
        // One element a lane: as many lanes as the line, up to a block of 256.
        for (line, lanes) in [(64, 64), (65, 128), (300, 256), (384, 256), (50257, 256)] {
            assert_eq!(row_lanes(line, 1), lanes, "line {line}");
        }
        // More a lane: fewer lanes, never below a warp.
        assert_eq!(row_lanes(384, 4), 128);
        assert_eq!(row_lanes(384, 8), 64);
        assert_eq!(row_lanes(384, 32), 32);
        assert_eq!(row_lanes(64, 32), 32);
    }

    #[test]
    fn column_parts_aim_for_many_blocks() {
        // nanoGPT's bias gradients: 16384 rows; 384 columns are 12 tiles.
        assert_eq!(col_parts(16384, 384), 86);
        assert_eq!(col_parts(16384, 1536), 22);
        // Few rows: one part (at least 64 rows a part).
        assert_eq!(col_parts(100, 40), 1);
        assert_eq!(col_parts(300, 40), 4);
        // Wide: enough tiles alone.
        assert_eq!(col_parts(16384, 50257), 1);
    }
}
