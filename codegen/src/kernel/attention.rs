//! Attention's kernels: the shapes ([`Attn`]), the forms they take (row kernels, the
//! f32 register tiles, the bf16 tensor-core tiles: [`AttnForm`]) and their tiles' sizes,
//! and the lowering of `dnn.attention` and `dnn.attention_grad` to launches.

use super::*;

/// The shape of an attention: `q [b, h, s, d]`, `k [b, g, t, d]`, `v [b, g, t, e]`, query
/// head `hi` reading key/value head `hi / (h / g)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Attn {
    /// Batch.
    pub b: usize,
    /// Query heads.
    pub h: usize,
    /// Key/value heads.
    pub g: usize,
    /// Query positions.
    pub s: usize,
    /// Key positions.
    pub t: usize,
    /// Query/key width.
    pub d: usize,
    /// Value width.
    pub e: usize,
    /// The scores' factor.
    pub scale: f32,
    /// Query `i` sees keys `j <= i` only.
    pub causal: bool,
    /// The queries are a shard of the positions (context parallelism): the kernel takes
    /// one more input, last, the i64 global position of its first query.
    pub q_offset: bool,
    /// The forward's row statistics are kept for the backward (tiled kernels): the
    /// forward ([`Body::AttnTiles`]) writes `[max, 1/sum]` per query row as a second
    /// output, and the backward's statistics-and-`dq` kernel ([`Body::AttnTilesBack`])
    /// takes the forward's output and those statistics (two more inputs after `v`) instead
    /// of running the forward's pass again.
    pub saved: bool,
    /// `q`, `k` and `v` are 2-byte bf16 buffers: the forward may run on tensor cores
    /// ([`Attn::mma_keys`]).
    pub bf16: bool,
    /// `q`, `k` and `v` are f32 and the tensor-core kernels take them, each product as
    /// three TF32 products (`a_hi b_hi + a_hi b_lo + a_lo b_hi`, the split that keeps
    /// f32's accuracy to about 2^-21): asked for by [`AttnForm::Mma`] on f32 operands, or
    /// by default where [`attn_f32_tensor_cores`] says so.
    pub tf32x3: bool,
    /// The tensor-core forward stages its key tiles in two buffers where both fit
    /// ([`Attn::mma_keys`]): the next tile's copy (`cp.async`) runs during this tile's
    /// products, one block barrier a tile. By default where [`attn_key_buffers`] says 2.
    pub double: bool,
}

/// Whether f32 attention takes the tensor cores as three TF32 products ([`Attn::tf32x3`])
/// by default: `NNSCALER_ATTN_F32=tf32x3`, a knob for benchmarks (the
/// next GPU run compares it with the register tiles, the default, before it becomes
/// one; `bench/gpu/prepare.sh` compiles the nanoGPT step both ways).
pub fn attn_f32_tensor_cores() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| match std::env::var("NNSCALER_ATTN_F32") {
        Ok(v) if v.trim() == "tf32x3" => true,
        Ok(v) if v.trim() == "tiles" || v.trim().is_empty() => false,
        Ok(v) => {
            eprintln!("nnscaler: NNSCALER_ATTN_F32={v:?} ignored: tf32x3 or tiles");
            false
        }
        Err(_) => false,
    })
}

/// The key tiles' buffers of the tensor-core forward: `NNSCALER_ATTN_BUFFERS=1|2` at
/// compile time, 2 (double-buffered, [`Attn::double`]) by default; a knob for benchmarks
/// (`bench/gpu/prepare.sh` compiles the bf16 attention cases both ways).
pub fn attn_key_buffers() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| match std::env::var("NNSCALER_ATTN_BUFFERS") {
        Ok(v) if v.trim() == "1" => 1,
        Ok(v) if v.trim() == "2" || v.trim().is_empty() => 2,
        Ok(v) => {
            eprintln!("nnscaler: NNSCALER_ATTN_BUFFERS={v:?} ignored: 1 or 2");
            2
        }
        Err(_) => 2,
    })
}

/// Rows per tile of a tiled attention at most, and the lanes of its teams.
pub const ATTN_TILE: usize = 64;
/// The f32 words of a tiled attention's shared array at most (48 KiB, the static shared
/// memory a block may have).
pub const ATTN_TILE_WORDS: usize = 12288;
/// Lanes (key rows) of a `dk`/`dv` block.
pub const ATTN_KV_LANES: usize = 32;
/// Words after each lane's own value row in the `dk`/`dv` kernel's shared array: lanes
/// reading their own rows (16 bytes at a time, 8 lanes a wavefront) hit distinct banks.
pub const ATTN_PAD: usize = 4;
/// The widest query/key and value rows that take the tiled kernels. A lane keeps its
/// query and its running output (the forward), or its key and both gradients (`dk`/`dv`),
/// in registers: rows of 64 fit the GPU's 255 a thread; rows of 128 spill some to local
/// memory (still far faster than the row kernels, which wider rows take).
pub const ATTN_TILE_WIDTH: usize = 128;

/// Keys a lane scores together in the forward's (and the backward statistics') inner step:
/// as many independent dot products in flight, one rescaling of the running sums a step.
/// Measured on an H200 (2026-12-04, `bench/gpu/runs/2026-12-04/sweep-3.log`): 8 keys (175
/// registers a lane) beat 16 (223) and 32 (245) by 7-12% on attention alone.
pub const FWD_STEP: usize = 8;
/// Keys per inner step of the backward's `dq` pass (fewer: its lanes hold their query and
/// `dO` rows).
pub const BACK_STEP: usize = 8;
/// Queries per inner step of the `dk`/`dv` kernel (its lanes hold their key and value
/// rows, and each query's statistics take registers too).
pub const KV_STEP: usize = 4;

/// Query rows per block of the tensor-core forward ([`Body::AttnMma`]): four warps of
/// the 16 rows an m16n8k16 product covers.
pub const MMA_ROWS: usize = 64;
/// Lanes of a tensor-core forward block (four warps).
pub const MMA_LANES: usize = 128;
/// Halves (16 bytes) of padding after every row of the tensor-core kernels' shared tiles:
/// a row pitch of `width + 8` halves (bf16; `2 width + 8` for f32) puts the eight rows an
/// `ldmatrix` reads in distinct banks.
pub const MMA_PAD: usize = 8;
/// The largest static shared array a block may have, in bytes.
pub const SHARED_BYTES: usize = 48 * 1024;

/// The inner steps of the tiled attention kernels: [`FWD_STEP`], [`BACK_STEP`],
/// [`KV_STEP`], or `NNSCALER_ATTN_STEPS=F,B,K` (powers of two up to 32; a tuning knob
/// for benchmarks: compile artifacts with several and time them) when set and valid.
pub fn attn_steps() -> (usize, usize, usize) {
    static STEPS: std::sync::OnceLock<(usize, usize, usize)> = std::sync::OnceLock::new();
    *STEPS.get_or_init(|| {
        let default = (FWD_STEP, BACK_STEP, KV_STEP);
        let Ok(v) = std::env::var("NNSCALER_ATTN_STEPS") else {
            return default;
        };
        let n: Vec<usize> = v.split(',').filter_map(|x| x.trim().parse().ok()).collect();
        match n[..] {
            [f, b, k] if [f, b, k].iter().all(|x| x.is_power_of_two() && *x <= 32) => (f, b, k),
            _ => {
                eprintln!(
                    "nnscaler: NNSCALER_ATTN_STEPS={v:?} ignored: three powers of two up to 32, as F,B,K"
                );
                default
            }
        }
    })
}

/// How a tiled attention's work is cut ([`Attn::tiles`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiles {
    /// Lanes (query rows) per block of the forward and of the backward's `dq` kernel.
    pub q_lanes: usize,
    /// Key rows per shared tile of the forward (keys and values).
    pub fwd_rows: usize,
    /// Key rows per shared tile of the backward's `dq` kernel (keys and values).
    pub back_rows: usize,
    /// Lanes (key rows) per block of the `dk`/`dv` kernel.
    pub k_lanes: usize,
    /// Query rows per shared tile of the `dk`/`dv` kernel (`q`, `dO`, statistics).
    pub kv_rows: usize,
    /// The kernels' inner steps ([`attn_steps`]): keys of the forward, keys of the `dq`
    /// pass, queries of the `dk`/`dv` kernel.
    pub steps: (usize, usize, usize),
}

impl Tiles {
    /// Query tiles of a head.
    pub fn q_tiles(&self, a: &Attn) -> usize {
        a.s.div_ceil(self.q_lanes)
    }
    /// Key tiles of a key/value head.
    pub fn k_tiles(&self, a: &Attn) -> usize {
        a.t.div_ceil(self.k_lanes)
    }
}

/// A team for `n` rows: a power of two, 32 (a warp) to [`ATTN_TILE`].
pub(super) fn tile_lanes(n: usize) -> usize {
    n.next_power_of_two().clamp(32, ATTN_TILE)
}

/// Rows of `width` words per shared tile: up to `lanes`, halved until the tile fits
/// `words`.
pub(super) fn tile_rows(lanes: usize, width: usize, words: usize) -> Option<usize> {
    let mut r = lanes;
    while r > 0 && r * width > words {
        r /= 2;
    }
    (r > 0).then_some(r)
}

/// Which kernels an attention gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnForm {
    /// One thread per query (or key) row ([`Body::Attention`], [`Body::AttnStats`], ...).
    Rows,
    /// Team kernels over tiles ([`Body::AttnTiles`], ...).
    Tiles,
    /// The forward on tensor cores ([`Body::AttnMma`]), the backward as [`AttnForm::Tiles`].
    Mma,
}

/// The tensor-core forward's shared array ([`Body::AttnMma`]), in 2-byte halves from its
/// start (a bf16 element, or half an f32; each region 16-byte aligned, every row too):
/// the query tile [`MMA_ROWS`] x `qp`; `buffers` times the key tile `keys x qp` and the
/// value tile `keys x ep` (rows as stored: the bf16 `P V` product reads them with
/// `ldmatrix.trans`, the f32 one 32 bits at a time), buffer `b`'s `kv * b` halves after
/// the first's; then `xch`: [`MMA_ROWS`] x 4 f32 words through which a row's four lanes
/// exchange their partial maxima and sums. (`P` stays in the lanes' registers.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmaTiles {
    /// Keys per tile (64, else 32, else 16: the first that fits).
    pub keys: usize,
    /// Row pitch (halves) of the query and key tiles: `d + MMA_PAD` (bf16), `2 d +
    /// MMA_PAD` (f32).
    pub qp: usize,
    /// Row pitch (halves) of the value tile: `e + MMA_PAD` (bf16), `2 e + MMA_PAD` (f32).
    pub ep: usize,
    /// The first buffer's key and value tiles.
    pub k_at: usize,
    pub v_at: usize,
    /// Key tile buffers: 2 where [`Attn::double`] and both fit, else 1.
    pub buffers: usize,
    /// Halves from one buffer's tiles to the next's: `keys (qp + ep)`.
    pub kv: usize,
    pub x_at: usize,
    /// f32 words of the whole array.
    pub words: usize,
}

/// The tensor-core backward's shared arrays ([`Body::AttnMmaBack`], [`Body::AttnMmaKv`]),
/// in 2-byte halves from the start (a bf16 element, or half an f32), each region 16-byte
/// aligned; `x_at` starts the f32 words (per row: `[m, 1/l, D]` and a spare).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmaBack {
    /// Keys per tile (`dq`) or queries per tile (`dk`/`dv`).
    pub tile: usize,
    /// Pitch (halves) of rows of `d` (queries, keys) and of `e` (`dO`, values).
    pub qp: usize,
    pub ep: usize,
    /// Region starts: see [`Attn::mma_dq`] and [`Attn::mma_kv`].
    pub at: [usize; 4],
    pub x_at: usize,
    pub words: usize,
}

impl MmaBack {
    /// Regions of `rows x pitch` halves in order, then `f32s` f32 words: the starts and
    /// the f32 words of the whole, or none past [`SHARED_BYTES`].
    fn lay(
        tile: usize,
        (qp, ep): (usize, usize),
        regions: &[(usize, usize)],
        f32s: usize,
    ) -> Option<Self> {
        let mut at = [0; 4];
        let mut end = 0;
        for (k, &(rows, pitch)) in regions.iter().enumerate() {
            at[k] = end;
            end += (rows * pitch).next_multiple_of(8);
        }
        let words = end / 2 + f32s;
        (words * 4 <= SHARED_BYTES).then_some(MmaBack {
            tile,
            qp,
            ep,
            at,
            x_at: end,
            words,
        })
    }
}

impl Attn {
    /// Widths the tensor-core backward takes: both a multiple of 16 for bf16 operands, of
    /// 8 for f32 ones ([`Attn::tf32x3`]) (each is some product's k), up to
    /// [`ATTN_TILE_WIDTH`].
    fn mma_back_widths(&self) -> bool {
        let k = if self.bf16 { 16 } else { 8 };
        (self.bf16 || self.tf32x3)
            && self.d > 0
            && self.e > 0
            && self.d.is_multiple_of(k)
            && self.e.is_multiple_of(k)
            && self.d <= ATTN_TILE_WIDTH
            && self.e <= ATTN_TILE_WIDTH
    }

    /// The `dq` kernel's tiles ([`Body::AttnMmaBack`]): key tiles of 64, 32 or 16 keys,
    /// the first that fits; regions `q [64, qp]`, `dO [64, ep]`, `k [keys, qp]`, `v [keys,
    /// ep]`, then `[m, 1/l, D, -]` f32 per query row. (`dq += dS K` reads the key rows as
    /// they are, with `ldmatrix.trans`; `dS` stays in the lanes' registers.)
    pub fn mma_dq(&self) -> Option<MmaBack> {
        if !self.mma_back_widths() || !self.saved {
            return None;
        }
        let (d, e, es) = (self.d, self.e, self.mma_halves());
        [64, 32, 16].into_iter().find_map(|tile| {
            let (qp, ep) = (es * d + MMA_PAD, es * e + MMA_PAD);
            MmaBack::lay(
                tile,
                (qp, ep),
                &[(MMA_ROWS, qp), (MMA_ROWS, ep), (tile, qp), (tile, ep)],
                MMA_ROWS * 4,
            )
        })
    }

    /// The `dk`/`dv` kernel's tiles ([`Body::AttnMmaKv`]): query tiles of 32 or 16, the
    /// first that fits; regions `k [64, qp]`, `v [64, ep]`, `q [queries, qp]`, `dO
    /// [queries, ep]`, then `[m, 1/l, D, -]` f32 per query. (`dV += P^T dO` and `dK +=
    /// dS^T Q` read the query and `dO` rows as they are, with `ldmatrix.trans`; `P^T` and
    /// `dS^T` stay in the lanes' registers.)
    pub fn mma_kv(&self) -> Option<MmaBack> {
        if !self.mma_back_widths() {
            return None;
        }
        let (d, e, es) = (self.d, self.e, self.mma_halves());
        [32, 16].into_iter().find_map(|tile| {
            let (qp, ep) = (es * d + MMA_PAD, es * e + MMA_PAD);
            MmaBack::lay(
                tile,
                (qp, ep),
                &[(MMA_ROWS, qp), (MMA_ROWS, ep), (tile, qp), (tile, ep)],
                tile * 4,
            )
        })
    }

    /// The tiling of this attention, or `None` where it takes the row kernels: rows
    /// wider than [`ATTN_TILE_WIDTH`].
    pub fn tiles(&self) -> Option<Tiles> {
        if self.d > ATTN_TILE_WIDTH || self.e > ATTN_TILE_WIDTH {
            return None;
        }
        // The backward's lanes keep their gradient accumulators in shared rows of their
        // own; the dk/dv kernel's two, so a warp of them leaves room for a tile of queries.
        let (q_lanes, k_lanes) = (tile_lanes(self.s), ATTN_KV_LANES);
        let (d, e) = (self.d, self.e);
        let back_own = q_lanes * (d + ATTN_PAD);
        let kv_own = k_lanes * (d + e + 2 * ATTN_PAD) + 3;
        Some(Tiles {
            q_lanes,
            fwd_rows: tile_rows(q_lanes, d + e, ATTN_TILE_WORDS)?,
            back_rows: tile_rows(q_lanes, d + e, ATTN_TILE_WORDS.checked_sub(back_own)?)?,
            k_lanes,
            kv_rows: tile_rows(ATTN_TILE, d + e + 3, ATTN_TILE_WORDS.checked_sub(kv_own)?)?,
            steps: attn_steps(),
        })
    }

    /// The tiled kernels read rows of shared memory 16 bytes at a time: widths that are
    /// multiples of 4 (every row of their shared tiles then starts 16-byte aligned).
    pub fn vector_rows(&self) -> bool {
        self.d.is_multiple_of(4) && self.e.is_multiple_of(4)
    }

    /// 2-byte halves per element of the tensor-core tiles: 1 for bf16, 2 for f32
    /// ([`Attn::tf32x3`]).
    pub fn mma_halves(&self) -> usize {
        if self.bf16 {
            1
        } else {
            2
        }
    }

    /// The tensor-core forward's tiles, where it takes this attention: bf16 operands with
    /// query/key widths a multiple of 16 (the products' k), or f32 ones
    /// ([`Attn::tf32x3`]) with widths a multiple of 8 (k of a TF32 product), value widths
    /// of 8 (their n), up to [`ATTN_TILE_WIDTH`], and tiles that fit [`SHARED_BYTES`]. The
    /// regions' starts and pitches count 2-byte halves.
    pub fn mma_keys(&self) -> Option<MmaTiles> {
        let (d, e) = (self.d, self.e);
        let k_step = if self.bf16 { 16 } else { 8 };
        if !(self.bf16 || self.tf32x3)
            || d == 0
            || e == 0
            || !d.is_multiple_of(k_step)
            || !e.is_multiple_of(8)
            || d > ATTN_TILE_WIDTH
            || e > ATTN_TILE_WIDTH
        {
            return None;
        }
        let es = self.mma_halves();
        let most = if self.double { 2 } else { 1 };
        // The most keys a tile that fit, two buffers before one at each (16-key tiles only
        // for f32's wider rows: bf16 fits 32 up to the widest).
        let mut tiles = [64, 32, 16]
            .into_iter()
            .flat_map(|keys| (1..=most).rev().map(move |buffers| (keys, buffers)));
        tiles.find_map(|(keys, buffers)| {
            let (qp, ep) = (es * d + MMA_PAD, es * e + MMA_PAD);
            let k_at = MMA_ROWS * qp;
            let v_at = k_at + keys * qp;
            let kv = keys * (qp + ep);
            let x_at = k_at + buffers * kv;
            let words = x_at / 2 + MMA_ROWS * 4;
            (words * 4 <= SHARED_BYTES).then_some(MmaTiles {
                keys,
                qp,
                ep,
                k_at,
                v_at,
                buffers,
                kv,
                x_at,
                words,
            })
        })
    }

    /// The kernels chosen for this shape: the tensor-core forward where
    /// [`Attn::mma_keys`] has tiles, else tiles where [`Attn::tiles`] has them.
    pub fn form(&self) -> AttnForm {
        match self.tiles() {
            Some(_) if self.mma_keys().is_some() => AttnForm::Mma,
            Some(_) => AttnForm::Tiles,
            None => AttnForm::Rows,
        }
    }

    fn of(attrs: &Attrs, q: &Buf, k: &Buf, v: &Buf) -> Result<Self, String> {
        for (b, what) in [(q, "query"), (k, "key"), (v, "value")] {
            if b.shape.len() != 4 {
                return Err(format!("attention's {what} must be [b, heads, seq, width]"));
            }
        }
        let d = q.shape[3];
        Ok(Attn {
            b: q.shape[0],
            h: q.shape[1],
            g: k.shape[1],
            s: q.shape[2],
            t: k.shape[2],
            d,
            e: v.shape[3],
            scale: float(attrs, "scale", 1.0 / (d as f64).sqrt()) as f32,
            causal: flag(attrs, "causal"),
            q_offset: attrs.contains_key("seq_axes"),
            saved: false,
            bf16: [q, k, v].iter().all(|b| b.elt == Elt::Bf16),
            tf32x3: [q, k, v].iter().all(|b| b.elt == Elt::F32) && attn_f32_tensor_cores(),
            double: attn_key_buffers() == 2,
        })
    }
}

/// The backward's statistics-and-`dq` kernel: on tensor cores where `mma` and its shape
/// takes them ([`Attn::mma_dq`]), else the register tiles.
pub fn back_body(a: &Attn, mma: bool) -> Body {
    if mma && a.mma_dq().is_some() {
        Body::AttnMmaBack(*a)
    } else {
        Body::AttnTilesBack(*a)
    }
}

/// [`back_body`]'s blocks.
pub fn back_len(a: &Attn, mma: bool, t: &Tiles) -> usize {
    match back_body(a, mma) {
        Body::AttnMmaBack(_) => a.b * a.h * a.s.div_ceil(MMA_ROWS),
        _ => a.b * a.h * t.q_tiles(a),
    }
}

/// The backward's `dk`/`dv` kernel: on tensor cores where `mma` and its shape takes them
/// ([`Attn::mma_kv`]), else the register tiles.
pub fn kv_body(a: &Attn, mma: bool) -> Body {
    if mma && a.mma_kv().is_some() {
        Body::AttnMmaKv(*a)
    } else {
        Body::AttnTilesKv(*a)
    }
}

/// [`kv_body`]'s blocks.
pub fn kv_len(a: &Attn, mma: bool, t: &Tiles) -> usize {
    match kv_body(a, mma) {
        Body::AttnMmaKv(_) => a.b * a.g * a.t.div_ceil(MMA_ROWS),
        _ => a.b * a.g * t.k_tiles(a),
    }
}

/// An attention's kernels (`dnn.attention`, `dnn.attention_grad`) in `form`, or the one
/// its shape gets ([`Attn::form`]) where `form` is `None`. Both compute the reference's
/// attention within rounding (the tiles' online softmax sums in another order); the row
/// form stays for rows wider than [`ATTN_TILE_WIDTH`] (and is tested against the tiles).
pub fn lower_attention(
    name: &str,
    op: &str,
    attrs: &Attrs,
    ins: &[Buf],
    outs: &[Buf],
    form: Option<AttnForm>,
) -> Result<Lowered, String> {
    lower_attention_kept(name, op, attrs, ins, outs, form, false)
}

/// Whether an attention of these operands (`q, k, v`) takes the tiled kernels, which can
/// keep the forward's statistics for the backward ([`lower_attention_kept`]).
pub fn attention_tiles(attrs: &Attrs, q: &Buf, k: &Buf, v: &Buf) -> bool {
    Attn::of(attrs, q, k, v).is_ok_and(|a| a.form() != AttnForm::Rows)
}

/// [`lower_attention`]; with `kept` (tiled kernels only), the forward also writes its
/// row statistics to a temporary (its `Slot::Temp(0)`, `[rows, 2]`), and the backward
/// takes two more operands after `v`: the forward's output and those statistics
/// ([`Attn::saved`]): the program pairs a forward with its backward.
pub fn lower_attention_kept(
    name: &str,
    op: &str,
    attrs: &Attrs,
    ins: &[Buf],
    outs: &[Buf],
    form: Option<AttnForm>,
    kept: bool,
) -> Result<Lowered, String> {
    let grad = match op {
        "dnn.attention" => false,
        "dnn.attention_grad" => true,
        _ => return Err(format!("'{op}' is not an attention")),
    };
    let (need, results) = if grad { (4, 3) } else { (3, 1) };
    if ins.len() < need || outs.len() < results {
        return Err(format!(
            "'{op}' needs {need} operands and {results} results"
        ));
    }
    let qi = usize::from(grad);
    let mut a = Attn::of(attrs, &ins[qi], &ins[qi + 1], &ins[qi + 2])?;
    let form = form.unwrap_or_else(|| a.form());
    // The tensor cores asked for on f32 operands: three TF32 products each.
    if form == AttnForm::Mma && !a.bf16 {
        a.tf32x3 = [qi, qi + 1, qi + 2].iter().all(|&i| ins[i].elt == Elt::F32);
    }
    if kept {
        if form == AttnForm::Rows {
            return Err(format!("'{op}': only the tiled kernels keep statistics"));
        }
        if grad && ins.len() != need + 2 {
            return Err(format!(
                "'{op}' keeping statistics takes the forward's output and statistics after v"
            ));
        }
        a.saved = true;
    }
    // The op's own operands (the kept backward's two more come after them).
    let (ins, kept_ins) = ins.split_at(need);
    let tiles = match form {
        AttnForm::Tiles | AttnForm::Mma => Some(
            a.tiles()
                .ok_or_else(|| format!("'{op}': this shape has no tiled kernels"))?,
        ),
        AttnForm::Rows => None,
    };
    if form == AttnForm::Mma && a.mma_keys().is_none() {
        return Err(format!(
            "'{op}': tensor cores take bf16 (f32) operands with widths a multiple of 16 (8) for the query/key and 8 for the value, up to {ATTN_TILE_WIDTH}, and tiles that fit {SHARED_BYTES} bytes of shared memory"
        ));
    }
    // On a shard of the positions, each kernel's last input is its offset.
    let offset = query_offset(attrs, &a)?;
    let mut consts = Vec::new();
    let mut extra = Vec::new();
    let mut extra_slots = Vec::new();
    if let Some((off, axes)) = offset {
        extra.push(off.clone());
        extra_slots.push(Slot::Const(0));
        consts.push((off, axes));
    }
    let op_slots: Vec<Slot> = (0..ins.len()).map(Slot::In).collect();
    let rows = a.b * a.h * a.s;
    if !grad {
        let (body, len) = match tiles {
            Some(_) if form == AttnForm::Mma => {
                (Body::AttnMma(a), a.b * a.h * a.s.div_ceil(MMA_ROWS))
            }
            Some(t) => (Body::AttnTiles(a), a.b * a.h * t.q_tiles(&a)),
            None => (Body::Attention(a), rows),
        };
        let kept_stats = Buf::f32(&[rows, 2]);
        let (outputs, temps, out_slots) = if a.saved {
            (
                vec![outs[0].clone(), kept_stats.clone()],
                vec![kept_stats],
                vec![Slot::Out(0), Slot::Temp(0)],
            )
        } else {
            (outs.to_vec(), Vec::new(), vec![Slot::Out(0)])
        };
        return Ok(Lowered {
            kernels: vec![Kernel {
                name: name.to_string(),
                body,
                inputs: [ins, &extra[..]].concat(),
                outputs,
                len,
            }],
            temps,
            consts,
            launches: vec![(
                0,
                [&op_slots[..], &extra_slots[..], &out_slots[..]].concat(),
            )],
        });
    }
    // dout, q, k, v -> dq, dk, dv: row statistics (a temporary) and dq by query row, then
    // dk, dv by key row (no two threads add into one element).
    let stats = Buf::f32(&[rows, 3]);
    let plain = [ins, &extra[..]].concat();
    let with_stats = [ins, &[stats.clone()][..], &extra[..]].concat();
    let plain_slots = [&op_slots[..], &extra_slots[..]].concat();
    let stats_slots = [&op_slots[..], &[Slot::Temp(0)][..], &extra_slots[..]].concat();
    // The kept backward's first kernel also reads the forward's output and statistics.
    let kept_slots: Vec<Slot> = (need..need + kept_ins.len()).map(Slot::In).collect();
    let back_in = [ins, kept_ins, &extra[..]].concat();
    let back_slots = [&op_slots[..], &kept_slots[..], &extra_slots[..]].concat();
    let kernel = |suffix: &str, body: Body, inputs: &[Buf], outputs: Vec<Buf>, len: usize| Kernel {
        name: format!("{name}_{suffix}"),
        body,
        inputs: inputs.to_vec(),
        outputs,
        len,
    };
    let (dq, dk, dv) = (outs[0].clone(), outs[1].clone(), outs[2].clone());
    let kv_rows = a.b * a.g * a.t;
    let (kernels, launches) = match tiles {
        Some(t) => (
            vec![
                kernel(
                    "back",
                    back_body(&a, form == AttnForm::Mma),
                    &back_in,
                    vec![stats.clone(), dq],
                    back_len(&a, form == AttnForm::Mma, &t),
                ),
                kernel(
                    "dkdv",
                    kv_body(&a, form == AttnForm::Mma),
                    &with_stats,
                    vec![dk, dv],
                    kv_len(&a, form == AttnForm::Mma, &t),
                ),
            ],
            vec![
                (
                    0,
                    [&back_slots[..], &[Slot::Temp(0), Slot::Out(0)]].concat(),
                ),
                (
                    1,
                    [&stats_slots[..], &[Slot::Out(1), Slot::Out(2)]].concat(),
                ),
            ],
        ),
        None => (
            vec![
                kernel(
                    "stats",
                    Body::AttnStats(a),
                    &plain,
                    vec![stats.clone()],
                    rows,
                ),
                kernel("dq", Body::AttnDq(a), &with_stats, vec![dq], rows),
                kernel(
                    "dkdv",
                    Body::AttnDkDv(a),
                    &with_stats,
                    vec![dk, dv],
                    kv_rows,
                ),
            ],
            vec![
                (0, [&plain_slots[..], &[Slot::Temp(0)]].concat()),
                (1, [&stats_slots[..], &[Slot::Out(0)]].concat()),
                (
                    2,
                    [&stats_slots[..], &[Slot::Out(1), Slot::Out(2)]].concat(),
                ),
            ],
        ),
    };
    Ok(Lowered {
        kernels,
        temps: vec![stats],
        consts,
        launches,
    })
}

/// On a shard of the positions (`seq_axes`): the i64 offset input of an attention's
/// kernels (the global position of its first query) and its per-device values.
pub(super) fn query_offset(attrs: &Attrs, a: &Attn) -> Result<Option<(Buf, ConstValues)>, String> {
    let axes = match attrs.get("seq_axes") {
        None => return Ok(None),
        Some(AttrValue::Strs(v)) => v.clone(),
        Some(_) => return Err("'seq_axes' must list mesh axes".into()),
    };
    let off = Buf {
        shape: Vec::new(),
        elt: Elt::I64,
    };
    Ok(Some((off, ConstValues::Offset { axes, len: a.s })))
}
