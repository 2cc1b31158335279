//! The checks an artifact passes before anything runs it ([`Artifact::from_bytes`] calls
//! them): plans that address only inside their arenas, indices in range, one program per
//! device, a receive for every send, kernels and collectives whose operands fit.

use super::*;

impl Artifact {
    /// The plans address only inside their arenas, every index is in range, every device
    /// runs one program, and every send has its receive.
    pub(super) fn check(&self) -> Result<(), String> {
        let h = &self.header;
        let devices = self.devices();
        if h.programs.is_empty() {
            return Err("the artifact has no program".into());
        }
        // Every device of the mesh runs one program: as many devices as the programs list.
        let listed: usize = h.programs.iter().map(|p| p.devices.len()).sum();
        let mesh = h.mesh.iter().try_fold(1u64, |n, a| n.checked_mul(a.size));
        if mesh != Some(listed as u64) {
            return Err(format!(
                "the mesh {:?} has {} devices, and its programs run on {listed}",
                h.mesh.iter().map(|a| a.size).collect::<Vec<_>>(),
                mesh.map_or("more than 2^64".to_string(), |m| m.to_string())
            ));
        }
        let mut owner: Vec<Option<usize>> = vec![None; devices];
        for (pi, p) in h.programs.iter().enumerate() {
            for &d in &p.devices {
                if d >= devices || owner[d].replace(pi).is_some() {
                    return Err(format!(
                        "program '{}' names device {d}, which is not a device of the mesh or runs another program",
                        p.name
                    ));
                }
            }
            if !p.devices.windows(2).all(|w| w[0] < w[1]) {
                return Err(format!(
                    "program '{}' lists its devices out of order",
                    p.name
                ));
            }
        }
        if let Some(d) = owner.iter().position(Option::is_none) {
            return Err(format!("device {d} runs no program"));
        }
        self.check_kernels()?;
        // Whole tensors of the signature: their sizes fit a u64.
        for (what, ports) in [("argument", &h.inputs), ("result", &h.outputs)] {
            for port in ports.iter() {
                let b = Buffer {
                    shape: port.global_shape.clone(),
                    elt: port.elt,
                    offset: 0,
                };
                if b.checked_bytes().is_none() {
                    return Err(format!(
                        "{what} '{}' of shape {:?} overflows a 64-bit size",
                        port.name, port.global_shape
                    ));
                }
            }
        }
        // Every program on its own first: the checks between them index its buffers.
        for p in &h.programs {
            self.check_program(p)
                .map_err(|e| format!("program '{}': {e}", p.name))?;
        }
        let mut computed = vec![0usize; h.outputs.len()];
        for p in &h.programs {
            for b in &p.outputs {
                if let Some(c) = computed.get_mut(b.port) {
                    *c += 1;
                }
            }
        }
        self.check_messages()?;
        if let Some(k) = computed.iter().position(|&c| c != 1) {
            return Err(format!(
                "result '{}' is computed by {} programs, not one",
                h.outputs[k].name, computed[k]
            ));
        }
        Ok(())
    }

    /// Every kernel but the reducers: its header entry as its code was compiled (the
    /// code exports its index count and buffer sizes), its geometry exact; the reducers
    /// there when a collective reduces.
    fn check_kernels(&self) -> Result<(), String> {
        let h = &self.header;
        let facts = code_facts(&String::from_utf8_lossy(self.section("ptx").unwrap_or(&[])));
        let reducer = |i: usize| h.reducers.is_some_and(|r| r.sum == i || r.max == i);
        for (i, k) in h.kernels.iter().enumerate() {
            if k.block == 0 || !k.block.is_power_of_two() || k.block > 1024 {
                return Err(format!(
                    "kernel {} has blocks of {} threads (a power of two up to 1024)",
                    k.name, k.block
                ));
            }
            if reducer(i) {
                continue;
            }
            let grid = if k.team {
                k.len
            } else {
                k.len.div_ceil(u64::from(k.block))
            };
            if k.grid != grid {
                return Err(format!(
                    "kernel {}'s grid of {} blocks is not the {grid} its {} indices take",
                    k.name, k.grid, k.len
                ));
            }
            match facts.get(&k.name) {
                Some((len, sizes)) if *len == k.len && *sizes == k.sizes => {}
                Some((len, sizes)) => {
                    return Err(format!(
                        "kernel {}: the header says {} indices over buffers of {:?} bytes, its code was compiled for {len} over {sizes:?}",
                        k.name, k.len, k.sizes
                    ))
                }
                None => {
                    return Err(format!(
                        "kernel {} is not in the PTX (or says nothing of its sizes)",
                        k.name
                    ))
                }
            }
            if k.sizes.len() != k.buffers || k.outputs > k.buffers {
                return Err(format!(
                    "kernel {} takes {} buffers ({} written) and gives sizes for {}",
                    k.name,
                    k.buffers,
                    k.outputs,
                    k.sizes.len()
                ));
            }
        }
        let reduces = h
            .programs
            .iter()
            .flat_map(|p| &p.steps)
            .any(|s| matches!(s, Step::Collective { op, .. } if op.reduces()));
        match h.reducers {
            Some(r) => {
                for k in [r.sum, r.max] {
                    if h.kernels.get(k).is_none_or(|k| k.buffers != 3) {
                        return Err(format!(
                            "reducer kernel {k} does not exist or does not take 3 buffers"
                        ));
                    }
                }
            }
            None if reduces => {
                return Err("a collective reduces, and the artifact has no reducer kernels".into())
            }
            None => {}
        }
        Ok(())
    }

    /// Every send has a receive of its tag in the program it names, on a buffer like its
    /// own, and every receive a send.
    fn check_messages(&self) -> Result<(), String> {
        let h = &self.header;
        for (pi, p) in h.programs.iter().enumerate() {
            // Every send has a receive of the same tag there, on a buffer like its own.
            for (i, s) in p.steps.iter().enumerate() {
                let Step::Send { buffer, to, tag } = s else {
                    continue;
                };
                let q = h
                    .programs
                    .get(*to)
                    .filter(|q| *to != pi && q.devices.len() == p.devices.len())
                    .ok_or_else(|| {
                        format!(
                            "program '{}' step {i} sends to program {to}, which does not exist or has other devices",
                            p.name
                        )
                    })?;
                let recv = q.steps.iter().find_map(|r| match r {
                    Step::Recv {
                        buffer: rb,
                        from,
                        tag: rt,
                    } if *from == pi && rt == tag => Some(*rb),
                    _ => None,
                });
                let Some(rb) = recv else {
                    return Err(format!(
                        "program '{}' sends '{tag}' to '{}', which never receives it",
                        p.name, q.name
                    ));
                };
                let (sb, rb) = (&p.buffers[*buffer], &q.buffers[rb]);
                if sb.shape != rb.shape || sb.elt != rb.elt {
                    return Err(format!(
                        "'{tag}' is sent by '{}' as {:?} {:?} and received by '{}' as {:?} {:?}",
                        p.name, sb.elt, sb.shape, q.name, rb.elt, rb.shape
                    ));
                }
            }
        }
        // Every receive names another program of as many devices, which sends its tag.
        for (pi, p) in h.programs.iter().enumerate() {
            for (i, s) in p.steps.iter().enumerate() {
                let Step::Recv { from, tag, .. } = s else {
                    continue;
                };
                let q = h
                    .programs
                    .get(*from)
                    .filter(|q| *from != pi && q.devices.len() == p.devices.len())
                    .ok_or_else(|| {
                        format!(
                            "program '{}' step {i} receives from program {from}, which does not exist or has other devices",
                            p.name
                        )
                    })?;
                let sent = q
                    .steps
                    .iter()
                    .any(|r| matches!(r, Step::Send { to, tag: t, .. } if *to == pi && t == tag));
                if !sent {
                    return Err(format!(
                        "program '{}' receives '{tag}' from '{}', which never sends it",
                        p.name, q.name
                    ));
                }
            }
        }
        Ok(())
    }

    /// One program's plan against the header.
    fn check_program(&self, p: &Program) -> Result<(), String> {
        let h = &self.header;
        for (i, b) in p.buffers.iter().enumerate() {
            let Some(bytes) = b.checked_bytes() else {
                return Err(format!(
                    "buffer {i}'s shape {:?} overflows a 64-bit size",
                    b.shape
                ));
            };
            if b.offset % 256 != 0
                || b.offset
                    .checked_add(bytes)
                    .is_none_or(|e| e > p.arena_bytes)
            {
                return Err(format!(
                    "buffer {i} ({} bytes at {}) lies outside the {}-byte arena",
                    b.bytes(),
                    b.offset,
                    p.arena_bytes
                ));
            }
        }
        let consts = self.section("consts").map_or(0, |c| c.len() as u64);
        for c in &p.constants {
            let b = p.buffers.get(c.buffer).ok_or_else(|| {
                format!("a constant names buffer {}, which does not exist", c.buffer)
            })?;
            let per_device = c.offsets.len() == p.devices.len();
            if c.offsets.is_empty() || (c.offsets.len() > 1 && !per_device) {
                return Err(format!(
                    "constant buffer {} has {} values for {} devices",
                    c.buffer,
                    c.offsets.len(),
                    p.devices.len()
                ));
            }
            if c.offsets
                .iter()
                .any(|o| o.saturating_add(b.bytes()) > consts)
            {
                return Err(format!(
                    "constant buffer {} lies outside the consts section ({consts} bytes)",
                    c.buffer
                ));
            }
        }
        for (ports, bindings) in [(&h.inputs, &p.inputs), (&h.outputs, &p.outputs)] {
            for bd in bindings {
                let port = ports
                    .get(bd.port)
                    .ok_or_else(|| format!("binds port {}, which does not exist", bd.port))?;
                let b = p.buffers.get(bd.buffer).ok_or_else(|| {
                    format!(
                        "'{}' names buffer {}, which does not exist",
                        port.name, bd.buffer
                    )
                })?;
                let fits = b.elt == port.elt
                    && bd.shards.len() == p.devices.len()
                    && port.global_shape.len() == b.shape.len()
                    && bd.shards.iter().all(|r| {
                        r.len() == b.shape.len()
                            && r.iter()
                                .zip(&b.shape)
                                .zip(&port.global_shape)
                                .all(|((&[lo, hi], &n), &g)| hi >= lo && hi - lo == n && hi <= g)
                    });
                if !fits {
                    return Err(format!(
                        "'{}' has shards that do not fit its buffer",
                        port.name
                    ));
                }
            }
        }
        tiles_results(p, &h.outputs)?;
        let missing = |b: usize| b >= p.buffers.len();
        for (i, s) in p.steps.iter().enumerate() {
            match s {
                Step::Launch { kernel, buffers } => {
                    let k = h.kernels.get(*kernel).ok_or_else(|| {
                        format!("step {i} launches kernel {kernel}, which does not exist")
                    })?;
                    if buffers.len() != k.buffers || buffers.iter().any(|&b| missing(b)) {
                        return Err(format!(
                            "step {i} gives kernel {} the wrong buffers",
                            k.name
                        ));
                    }
                    if k.sizes.len() != k.buffers {
                        return Err(format!(
                            "step {i} launches kernel {}, which is launched over any count (a reducer)",
                            k.name
                        ));
                    }
                    for (j, (&b, &need)) in buffers.iter().zip(&k.sizes).enumerate() {
                        let have = p.buffers[b].bytes();
                        if have < need {
                            return Err(format!(
                                "step {i} gives kernel {} buffer {b} of {have} bytes as its argument {j}, which takes {need}",
                                k.name
                            ));
                        }
                    }
                    if let Some(g) = &k.gemm {
                        let bufs: Vec<&Buffer> = buffers.iter().map(|&b| &p.buffers[b]).collect();
                        gemm_fits(g, &bufs, &h.kernels)
                            .map_err(|e| format!("step {i}, kernel {}: {e}", k.name))?;
                    }
                }
                Step::Send { buffer, .. } | Step::Recv { buffer, .. } => {
                    if missing(*buffer) {
                        return Err(format!("step {i} names a missing buffer"));
                    }
                }
                Step::Collective {
                    op,
                    input,
                    output,
                    groups,
                } => {
                    if missing(*input) || missing(*output) {
                        return Err(format!("step {i}'s collective names a missing buffer"));
                    }
                    let mut members: Vec<usize> = groups.iter().flatten().copied().collect();
                    members.sort_unstable();
                    if members != p.devices || groups.iter().any(Vec::is_empty) {
                        return Err(format!(
                            "step {i}'s groups do not partition the program's devices"
                        ));
                    }
                    collective_shapes(op, &p.buffers[*input], &p.buffers[*output], groups)
                        .map_err(|e| format!("step {i}: {e}"))?;
                }
            }
        }
        Ok(())
    }
}

/// That program `p`'s pieces of each result tile the whole tensor: the distinct ones do not
/// overlap, and their volumes add up to its own (nothing of it left unwritten).
fn tiles_results(p: &Program, outputs: &[Port]) -> Result<(), String> {
    for bd in &p.outputs {
        let port = &outputs[bd.port];
        let mut boxes: Vec<&Vec<[u64; 2]>> = bd.shards.iter().collect();
        boxes.sort();
        boxes.dedup();
        let volume = |r: &[[u64; 2]]| {
            r.iter()
                .try_fold(1u64, |n, &[lo, hi]| n.checked_mul(hi - lo))
        };
        let whole = port
            .global_shape
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d));
        let covered = boxes
            .iter()
            .try_fold(0u64, |n, b| volume(b).and_then(|v| n.checked_add(v)));
        let overlap = |a: &[[u64; 2]], b: &[[u64; 2]]| {
            a.iter()
                .zip(b)
                .all(|(&[a0, a1], &[b0, b1])| a0 < b1 && b0 < a1)
        };
        let overlapping = boxes
            .iter()
            .enumerate()
            .any(|(i, a)| boxes[i + 1..].iter().any(|b| overlap(a, b)));
        if covered.is_none() || covered != whole || overlapping {
            return Err(format!(
                "result '{}''s pieces do not tile its {:?} tensor",
                port.name, port.global_shape
            ));
        }
    }
    Ok(())
}

/// Whether a matrix product's operands, as its shape says (what cuBLAS reads and writes),
/// lie inside the buffers it is given: `A` (`batch * m * k`), `B` (`k * n`, per product
/// when `b_batched`), a bias (`n`, where it has one), `C` (`batch * m * n`), each at its
/// buffer's element size, by checked arithmetic; and that the kernel adding its bias
/// (`Gemm::bias`, of `kernels`) is an element-wise kernel of three buffers whose sizes
/// `(C, bias, C)` hold.
fn gemm_fits(g: &Gemm, bufs: &[&Buffer], kernels: &[Kernel]) -> Result<(), String> {
    let want = if g.bias.is_some() { 4 } else { 3 };
    if bufs.len() != want {
        return Err(format!(
            "a matrix product with {} buffers, not {want}",
            bufs.len()
        ));
    }
    let b_count = if g.b_batched { g.batch } else { 1 };
    let mut dims = vec![[g.batch, g.m, g.k], [b_count, g.k, g.n]];
    let mut names = vec!["A", "B"];
    if g.bias.is_some() {
        if g.batch != 1 {
            return Err(format!("a bias on a batch of {} products", g.batch));
        }
        dims.push([1, 1, g.n]);
        names.push("the bias");
    }
    dims.push([g.batch, g.m, g.n]);
    names.push("C");
    for (what, (d, b)) in names.iter().zip(dims.iter().zip(bufs)) {
        let need = d.iter().try_fold(b.elt.size(), |n, &x| n.checked_mul(x));
        let have = b.bytes();
        match need {
            Some(n) if n <= have => {}
            _ => {
                return Err(format!(
                "its product {}x{}x{} (batch {}) needs more of {what} than its {have}-byte buffer",
                g.m, g.n, g.k, g.batch
            ))
            }
        }
    }
    if let Some(add) = g.bias {
        let c = bufs[3].bytes();
        let k = usize::try_from(add)
            .ok()
            .and_then(|j| kernels.get(j))
            .ok_or_else(|| format!("its bias's kernel {add} does not exist"))?;
        let sizes_hold = k.sizes.len() == 3
            && k.sizes[0] <= c
            && k.sizes[1] <= bufs[2].bytes()
            && k.sizes[2] <= c;
        if k.gemm.is_some() || k.team || k.buffers != 3 || k.outputs != 1 || !sizes_hold {
            return Err(format!(
                "its bias's kernel {} is not an element-wise kernel of (C, bias, C)",
                k.name
            ));
        }
    }
    Ok(())
}

/// Whether a collective's buffers fit it: its groups of one size, and what
/// [`Collective::check`] asks of the buffers.
fn collective_shapes(
    op: &Collective,
    i: &Buffer,
    o: &Buffer,
    groups: &[Vec<usize>],
) -> Result<(), String> {
    let n = groups.first().map_or(1, Vec::len) as u64;
    if groups.iter().any(|g| g.len() as u64 != n) {
        return Err("its groups differ in size".into());
    }
    op.check(i, o, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(n: u64, elt: Elt) -> Buffer {
        Buffer {
            shape: vec![n],
            elt,
            offset: 0,
        }
    }

    fn kernel(name: &str, buffers: usize, sizes: Vec<u64>, gemm: Option<Gemm>) -> Kernel {
        Kernel {
            name: name.into(),
            len: 6,
            grid: 1,
            block: BLOCK,
            team: false,
            buffers,
            outputs: 1,
            gemm,
            sizes,
        }
    }

    /// A product with a bias (`x W^T + b`, 2 x 3 over 4): its four buffers, the bias's
    /// `n` elements, and the kernel that adds the bias where the BLAS does not, which
    /// must be an element-wise kernel of `(C, bias, C)` whose sizes the buffers hold.
    #[test]
    fn a_biased_product_and_its_bias_kernel_fit() {
        let g = Gemm {
            batch: 1,
            m: 2,
            n: 3,
            k: 4,
            ta: false,
            tb: true,
            b_batched: false,
            bias: Some(1),
        };
        let (a, w, b, c) = (
            buf(8, Elt::F32),
            buf(12, Elt::F32),
            buf(3, Elt::F32),
            buf(6, Elt::F32),
        );
        let add = kernel("k1", 3, vec![24, 12, 24], None);
        let mut ks = vec![kernel("k0", 4, vec![32, 48, 12, 24], Some(g)), add];
        assert_eq!(gemm_fits(&g, &[&a, &w, &b, &c], &ks), Ok(()));
        // Three buffers: no room for the bias.
        let e = gemm_fits(&g, &[&a, &w, &c], &ks).unwrap_err();
        assert!(e.contains("3 buffers, not 4"), "{e}");
        // A bias of fewer than n elements.
        let short = buf(2, Elt::F32);
        let e = gemm_fits(&g, &[&a, &w, &short, &c], &ks).unwrap_err();
        assert!(e.contains("needs more of the bias"), "{e}");
        // Its bias kernel missing, a product itself, or writing past C.
        let far = Gemm { bias: Some(7), ..g };
        let e = gemm_fits(&far, &[&a, &w, &b, &c], &ks).unwrap_err();
        assert!(e.contains("its bias's kernel 7 does not exist"), "{e}");
        ks[1].gemm = Some(g);
        let e = gemm_fits(&g, &[&a, &w, &b, &c], &ks).unwrap_err();
        assert!(e.contains("not an element-wise kernel"), "{e}");
        ks[1] = kernel("k1", 3, vec![24, 12, 28], None);
        let e = gemm_fits(&g, &[&a, &w, &b, &c], &ks).unwrap_err();
        assert!(e.contains("not an element-wise kernel"), "{e}");
        // A bias on a batch of products.
        let batched = Gemm { batch: 2, ..g };
        ks[1] = kernel("k1", 3, vec![24, 12, 24], None);
        let e = gemm_fits(&batched, &[&a, &w, &b, &c], &ks).unwrap_err();
        assert!(e.contains("a bias on a batch of 2 products"), "{e}");
    }
}
