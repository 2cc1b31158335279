//! Every PTX module through ptxas, and the attention kernels' registers and local memory.

use super::*;

/// `ptxas`: `NNSCALER_PTXAS`, else on `PATH`, else where `scripts/setup` puts it.
pub(super) fn ptxas() -> PathBuf {
    if let Some(p) = std::env::var_os("NNSCALER_PTXAS") {
        return p.into();
    }
    if Command::new("ptxas")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return "ptxas".into();
    }
    let home = std::env::var_os("HOME").unwrap_or_default();
    let cached = PathBuf::from(home).join(".cache/nnscaler/bin/ptxas");
    assert!(
        cached.exists(),
        "ptxas not found (NNSCALER_PTXAS, PATH, {}): run scripts/setup, which installs it from the nvidia-cuda-nvcc-cu12 wheel",
        cached.display()
    );
    cached
}

#[test]
pub(super) fn every_ptx_module_passes_ptxas() {
    let mut kernels: Vec<Kernel> = lower_cases(&op_cases())
        .into_iter()
        .flat_map(|(l, _)| l.kernels)
        .chain(nnscaler_codegen::artifact::reducers())
        .collect();
    // The attention row kernels (only rows too wide for a shared tile take them).
    {
        use nnscaler_codegen::kernel::{lower_attention, AttnForm};
        let (q, kv) = (ty(&[1, 2, 5, 8]), ty(&[1, 1, 7, 8]));
        let causal = attrs(&[("causal", AttrValue::Bool(true))]);
        for (op, tys, outs) in [
            ("dnn.attention", vec![&q, &kv, &kv], vec![&q]),
            (
                "dnn.attention_grad",
                vec![&q, &q, &kv, &kv],
                vec![&q, &kv, &kv],
            ),
        ] {
            let ins: Vec<Buf> = tys.into_iter().map(Buf::of).collect();
            let outs: Vec<Buf> = outs.into_iter().map(Buf::of).collect();
            let name = format!("rows_{}", op.trim_start_matches("dnn."));
            let l = lower_attention(&name, op, &causal, &ins, &outs, Some(AttnForm::Rows));
            let l = l.unwrap();
            assert!(l
                .kernels
                .iter()
                .any(|k| matches!(k.body, Body::Attention(_) | Body::AttnDkDv(_))));
            kernels.extend(l.kernels);
        }
    }
    for (name, bf16) in [
        ("nanogpt-cpu", false),
        ("llama-tiny", false),
        ("nanogpt-cpu", true),
    ] {
        let g = training_step_in(name, bf16);
        let tag = if bf16 { "_bf16" } else { "" };
        for mut gr in fuse(&g).unwrap() {
            gr.kernel.name = format!("{}{tag}_{}", name.replace('-', "_"), gr.kernel.name);
            kernels.push(gr.kernel);
        }
    }
    // The bf16 step's program: kernels on 2-byte bf16 buffers (program::store_bf16).
    let p = nnscaler_codegen::compile(&training_step_in("nanogpt-cpu", true), None).unwrap();
    for mut k in p.kernels {
        if k.inputs
            .iter()
            .chain(&k.outputs)
            .any(|b| b.elt == Elt::Bf16)
        {
            k.name = format!("stored_bf16_{}", k.name);
            kernels.push(k);
        }
    }
    let text = ptx(&kernels, Gpu::default()).unwrap();
    assert!(
        text.contains("ld.global.u16") && text.contains("st.global.u16"),
        "2-byte bf16 buffers are read and written as 16-bit words"
    );
    if let Some(p) = std::env::var_os("NNSCALER_DUMP_PTX") {
        std::fs::write(p, &text).unwrap();
    }
    assert!(text.contains(".target sm_90") && text.contains(".version 8.0"));
    assert_eq!(text.matches(".visible .entry").count(), kernels.len());
    assert!(text.contains("ld.global.f32") && text.contains("st.global.f32"));
    assert!(
        text.contains("bar.sync") && text.contains("ld.shared.f64"),
        "team kernels meet at barriers and combine in shared memory"
    );
    assert!(
        text.contains("ld.global.u64"),
        "i64 ids are read from global memory"
    );
    assert!(
        !text.contains(".extern"),
        "a kernel calls an external function"
    );
    let dir = std::env::temp_dir().join(format!("nnscaler-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("kernels.ptx");
    std::fs::write(&file, &text).unwrap();
    let out = Command::new(ptxas())
        .args(["--gpu-name", "sm_90", "-o"])
        .arg(dir.join("kernels.cubin"))
        .arg(&file)
        .output()
        .expect("ptxas runs");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "ptxas rejected the PTX: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "codegen: {} kernels (every op case, the collectives' reducers, the fused kernels of nanogpt-cpu (f32 and bf16) and llama-tiny steps, the bf16 step's kernels on 2-byte buffers): {} lines of PTX, accepted by ptxas for sm_90",
        kernels.len(),
        text.lines().count()
    );
}

/// The tiled attention kernels at the nanoGPT GPU config's and GPT-2's shapes (rows of 64,
/// causal, f32 and 2-byte bf16 buffers) keep their rows in registers: `ptxas -v` reports
/// no stack frame and no spills for any of them. (`NNSCALER_PTXAS_LOG=FILE` keeps its
/// report, `NNSCALER_DUMP_ATTN_PTX=FILE` the PTX.)
#[test]
pub(super) fn attention_kernels_use_no_local_memory() {
    use nnscaler_codegen::kernel::lower_attention;
    let causal = attrs(&[("causal", AttrValue::Bool(true))]);
    let mut kernels = Vec::new();
    for (tag, b, h, s) in [("nanogpt", 64, 6, 256), ("gpt2", 8, 12, 1024)] {
        for elt in [Elt::F32, Elt::Bf16] {
            let q = Buf {
                shape: vec![b, h, s, 64],
                elt,
            };
            let name = format!("{tag}_{}", if elt == Elt::F32 { "f32" } else { "bf16" });
            let bufs = |n: usize| vec![q.clone(); n];
            let fwd = lower_attention(
                &format!("{name}_fwd"),
                "dnn.attention",
                &causal,
                &bufs(3),
                &bufs(1),
                None,
            )
            .unwrap();
            let bwd = lower_attention(
                &format!("{name}_bwd"),
                "dnn.attention_grad",
                &causal,
                &bufs(4),
                &bufs(3),
                None,
            )
            .unwrap();
            // The forms keeping the forward's statistics for the backward.
            let stats = Buf {
                shape: vec![b * h * s, 2],
                elt: Elt::F32,
            };
            let kept_fwd = nnscaler_codegen::kernel::lower_attention_kept(
                &format!("{name}_kfwd"),
                "dnn.attention",
                &causal,
                &bufs(3),
                &bufs(1),
                None,
                true,
            )
            .unwrap();
            let mut kept_ins = bufs(5);
            kept_ins.push(stats);
            let kept_bwd = nnscaler_codegen::kernel::lower_attention_kept(
                &format!("{name}_kbwd"),
                "dnn.attention_grad",
                &causal,
                &kept_ins,
                &bufs(3),
                None,
                true,
            )
            .unwrap();
            let kept: Vec<Kernel> = kept_fwd
                .kernels
                .into_iter()
                .chain(kept_bwd.kernels)
                .filter(|k| !matches!(k.body, Body::AttnTilesKv(_)))
                .collect();
            for k in fwd.kernels.into_iter().chain(bwd.kernels).chain(kept) {
                assert!(
                    matches!(
                        k.body,
                        Body::AttnTiles(_)
                            | Body::AttnTilesBack(_)
                            | Body::AttnTilesKv(_)
                            | Body::AttnMma(_)
                            | Body::AttnMmaBack(_)
                            | Body::AttnMmaKv(_)
                    ),
                    "{}: not a tiled attention kernel",
                    k.name
                );
                // bf16 attention takes the tensor cores (the backward's first kernel
                // where it reads the kept statistics), f32 the register tiles.
                let cores = matches!(
                    k.body,
                    Body::AttnMma(_) | Body::AttnMmaBack(_) | Body::AttnMmaKv(_)
                );
                let plain_back = k.name.ends_with("_bwd_back");
                assert_eq!(
                    cores,
                    elt == Elt::Bf16 && !plain_back,
                    "{}: {:?}",
                    k.name,
                    k.body
                );
                kernels.push(k);
            }
        }
    }
    kernels.extend(tf32x3_attention_kernels(&causal));
    let text = ptx(&kernels, Gpu::default()).unwrap();
    for k in &kernels {
        check_attention_entry(&text, k);
    }
    if let Some(p) = std::env::var_os("NNSCALER_DUMP_ATTN_PTX") {
        std::fs::write(p, &text).unwrap();
    }
    let dir = std::env::temp_dir().join(format!("nnscaler-attn-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("attention.ptx");
    std::fs::write(&file, &text).unwrap();
    let out = Command::new(ptxas())
        .args(["-v", "--gpu-name", "sm_90", "-o"])
        .arg(dir.join("attention.cubin"))
        .arg(&file)
        .output()
        .expect("ptxas runs");
    let _ = std::fs::remove_dir_all(&dir);
    let log = String::from_utf8_lossy(&out.stderr).to_string();
    if let Some(p) = std::env::var_os("NNSCALER_PTXAS_LOG") {
        std::fs::write(p, &log).unwrap();
    }
    assert!(out.status.success(), "ptxas rejected the PTX: {log}");
    // Per function: "Compiling entry function 'NAME'", then "N bytes stack frame, N bytes
    // spill stores, N bytes spill loads" and "Used N registers".
    let mut seen = 0;
    let mut current = String::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            current = rest.split('\'').next().unwrap_or("").to_string();
        }
        if line.contains("bytes stack frame") {
            seen += 1;
            assert!(
                line.contains(" 0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"),
                "{current} uses local memory: {line}"
            );
        }
        if line.contains("Used ") && line.contains("registers") {
            println!("codegen: {current}: {}", line.trim());
        }
    }
    assert_eq!(seen, kernels.len(), "a report per kernel: {log}");
    println!(
        "codegen: {} attention kernels (nanoGPT and GPT-2 shapes, f32 and bf16): no local memory",
        kernels.len()
    );
}

/// The f32 attention kernels on tensor cores as three TF32 products (asked for; not the
/// default) at the nanoGPT and GPT-2 shapes: the forward, plain and keeping its
/// statistics, and the backward reading them (its `dq` and `dk`/`dv` kernels).
fn tf32x3_attention_kernels(causal: &Attrs) -> Vec<Kernel> {
    let mut kernels = Vec::new();
    for (tag, b, h, s) in [("nanogpt", 64, 6, 256), ("gpt2", 8, 12, 1024)] {
        let q = Buf {
            shape: vec![b, h, s, 64],
            elt: Elt::F32,
        };
        for kept in [false, true] {
            let name = format!("{tag}_tf32x3_{}", if kept { "kfwd" } else { "fwd" });
            let l = nnscaler_codegen::kernel::lower_attention_kept(
                &name,
                "dnn.attention",
                causal,
                &vec![q.clone(); 3],
                std::slice::from_ref(&q),
                Some(nnscaler_codegen::kernel::AttnForm::Mma),
                kept,
            )
            .unwrap();
            assert!(
                matches!(l.kernels[0].body, Body::AttnMma(a) if a.tf32x3),
                "{name}: {:?}",
                l.kernels[0].body
            );
            kernels.extend(l.kernels);
        }
        // The backward reading the kept statistics: dq and dk/dv on tensor cores too.
        let stats = Buf {
            shape: vec![b * h * s, 2],
            elt: Elt::F32,
        };
        let mut ins = vec![q.clone(); 5];
        ins.push(stats);
        let l = nnscaler_codegen::kernel::lower_attention_kept(
            &format!("{tag}_tf32x3_kbwd"),
            "dnn.attention_grad",
            causal,
            &ins,
            &vec![q.clone(); 3],
            Some(nnscaler_codegen::kernel::AttnForm::Mma),
            true,
        )
        .unwrap();
        let tc = l
            .kernels
            .iter()
            .filter(|k| matches!(k.body, Body::AttnMmaBack(a) | Body::AttnMmaKv(a) if a.tf32x3))
            .count();
        assert_eq!(tc, 2, "{tag}: the f32 backward's two tensor-core kernels");
        kernels.extend(l.kernels);
    }
    kernels
}

/// One attention kernel's PTX entry: a tensor-core kernel issues its products as
/// `mma.sync` (bf16, or TF32, in; f32 sums), loads their fragments by `ldmatrix`, stages
/// its tiles 16 bytes a lane and keeps `P` in registers; no other kernel issues one.
fn check_attention_entry(text: &str, k: &Kernel) {
    let body = text
        .split(".entry ")
        .find(|e| e.starts_with(&format!("{}(", k.name)))
        .unwrap_or_else(|| panic!("no entry {}", k.name));
    let tf32 = matches!(
        k.body,
        Body::AttnMma(a) | Body::AttnMmaBack(a) | Body::AttnMmaKv(a) if a.tf32x3
    );
    let mmas = body
        .matches(if tf32 {
            "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"
        } else {
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
        })
        .count();
    assert_eq!(
        mmas > 0,
        matches!(
            k.body,
            Body::AttnMma(_) | Body::AttnMmaBack(_) | Body::AttnMmaKv(_)
        ),
        "{}: {mmas} mma.sync",
        k.name
    );
    if mmas > 0 {
        // Their fragments come from ldmatrix (plain for A and the B tiles stored
        // [n][k], .trans for those stored [k][n]: values, keys in dq += dS K, queries
        // and dO in dk/dv), their tiles are staged 16 bytes a lane, and no operand is
        // read from shared memory two bytes at a time.
        let count = |s: &str| body.matches(s).count();
        let (a, b, bt) = (
            count("ldmatrix.sync.aligned.m8n8.x4.shared.b16"),
            count("ldmatrix.sync.aligned.m8n8.x2.shared.b16"),
            count("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16"),
        );
        // TF32's value rows are read 32 bits at a time (`.trans` moves 16-bit halves).
        assert!(
            a > 0 && b > 0 && (bt > 0) != tf32,
            "{}: ldmatrix {a} {b} {bt}",
            k.name
        );
        if tf32 {
            assert!(count("cvt.rna.tf32.f32") > 0, "{}: no TF32 split", k.name);
        }
        assert!(count("ld.global.v4") > 0, "{}: no 16-byte staging", k.name);
        // The forward's key tiles in two buffers where they fit: each tile's copy is
        // asynchronous (issued a tile ahead), and waited for before the barrier.
        let double =
            matches!(k.body, Body::AttnMma(a) if a.mma_keys().is_some_and(|t| t.buffers == 2));
        let (copies, waits) = (
            count("cp.async.cg.shared.global"),
            count("cp.async.wait_all"),
        );
        assert_eq!(
            (copies > 0, waits > 0),
            (double, double),
            "{}: {copies} cp.async, {waits} waits",
            k.name
        );
        assert_eq!(count("ld.shared.u16"), 0, "{}: 2-byte shared loads", k.name);
        // P (dS, P^T, dS^T) goes from one product to the next in registers, not as
        // bf16 pairs through shared memory, and that product's phase waits for its
        // warp only.
        let pairs = count("st.shared.u32") + count("st.shared.b32");
        assert_eq!(pairs, 0, "{}: bf16 pairs stored to shared memory", k.name);
        assert!(count("bar.warp.sync") > 0, "{}: no warp-only phase", k.name);
        println!(
            "codegen: {}: {mmas} mma.sync, ldmatrix x4 {a}, x2 {b}, x2.trans {bt}, cp.async {copies} in its PTX",
            k.name
        );
    }
}
