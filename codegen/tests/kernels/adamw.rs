//! The multi-tensor AdamW launch against the one-tensor kernel.

use super::*;

/// The multi-tensor AdamW (`Body::AdamWMulti`: tensors end to end, a binary search for
/// each element's tensor, each tensor's weight decay) gives every element the bits the
/// one-tensor kernel gives it, with and without clipping's scale, over tensors of 1 to
/// 1000 elements; and a training step's updates become one launch per 48 parameters.
#[test]
pub(super) fn multi_tensor_adamw_gives_the_one_tensor_bits() {
    let lens = [5usize, 1, 1000, 3, 64, 7, 2];
    let wds = [0.1, 0.0, 0.1, 0.01, 0.0, 0.1, 0.5];
    let mut kernels = Vec::new();
    for scaled in [false, true] {
        let mut ins = Vec::new();
        let mut outs = Vec::new();
        for (j, &n) in lens.iter().enumerate() {
            let t = Buf::f32(&[n]);
            let a = attrs(&[
                ("beta1", AttrValue::Float(0.9)),
                ("beta2", AttrValue::Float(0.95)),
                ("eps", AttrValue::Float(1e-8)),
                ("weight_decay", AttrValue::Float(wds[j])),
            ]);
            let mut one_in = vec![t.clone(); 4];
            one_in.extend([Buf::f32(&[]), Buf::f32(&[])]);
            if scaled {
                one_in.push(Buf::f32(&[]));
            }
            let l = lower(
                &format!("one{j}_{scaled}"),
                "dnn.adamw",
                &a,
                &one_in,
                &[t.clone(), t.clone(), t.clone()],
            )
            .unwrap();
            kernels.extend(l.kernels);
            ins.extend(vec![t.clone(); 4]);
            outs.extend(vec![t.clone(); 3]);
        }
        ins.extend([Buf::f32(&[]), Buf::f32(&[])]);
        if scaled {
            ins.push(Buf::f32(&[]));
        }
        kernels.push(Kernel {
            name: format!("multi_{scaled}"),
            body: Body::AdamWMulti {
                b1: 0.9,
                b2: 0.95,
                eps: 1e-8,
                wds: wds.to_vec(),
                lens: lens.to_vec(),
            },
            inputs: ins,
            outputs: outs,
            len: lens.iter().sum(),
        });
    }
    let host = HostKernels::new(&kernels).unwrap();
    for scaled in [false, true] {
        let tensors: Vec<Vec<Data>> = lens
            .iter()
            .enumerate()
            .map(|(j, &n)| {
                (0..4)
                    .map(|k| {
                        let (lo, hi) = if k == 3 { (0.0, 2.0) } else { (-2.0, 2.0) };
                        Data::F32(values(n, (j * 4 + k) as u64, lo, hi))
                    })
                    .collect()
            })
            .collect();
        let mut scalars = vec![Data::F32(vec![3e-3]), Data::F32(vec![7.0])];
        if scaled {
            scalars.push(Data::F32(vec![0.25]));
        }
        let mut all: Vec<&Data> = tensors.iter().flatten().collect();
        all.extend(scalars.iter());
        let multi = host.run(&format!("multi_{scaled}"), &all).unwrap();
        for (j, t) in tensors.iter().enumerate() {
            let mut one: Vec<&Data> = t.iter().collect();
            one.extend(scalars.iter());
            let want = host.run(&format!("one{j}_{scaled}"), &one).unwrap();
            for (k, w) in want.iter().enumerate() {
                assert_eq!(
                    &multi[3 * j + k],
                    w,
                    "tensor {j} result {k} (scale {scaled})"
                );
            }
        }
    }
    // A training step: its updates in launches of at most 48 parameters.
    let g = training_step_in("nanogpt-cpu", false);
    let params = g.nodes.iter().filter(|n| n.op == "dnn.adamw").count();
    let p = nnscaler_codegen::compile(&g, None).unwrap();
    let launches = p
        .launches
        .iter()
        .filter(|l| match l.work {
            nnscaler_codegen::Work::Kernel(k) => {
                matches!(
                    p.kernels[k].body,
                    Body::AdamW { .. } | Body::AdamWMulti { .. }
                )
            }
            _ => false,
        })
        .count();
    assert_eq!(launches, params.div_ceil(48), "{params} parameters");
    // ptxas takes the widest (7 x 48 pointers, within a kernel's 4 KiB of parameters).
    let multi: Vec<Kernel> = p
        .kernels
        .iter()
        .filter(|k| matches!(k.body, Body::AdamWMulti { .. }))
        .cloned()
        .collect();
    let text = ptx(&multi, Gpu::default()).unwrap();
    let dir = std::env::temp_dir().join(format!("nnscaler-adamw-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("adamw.ptx"), &text).unwrap();
    let out = Command::new(ptxas())
        .args(["--gpu-name", "sm_90", "-o"])
        .arg(dir.join("adamw.cubin"))
        .arg(dir.join("adamw.ptx"))
        .output()
        .expect("ptxas runs");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "ptxas: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("codegen: multi-tensor AdamW: the one-tensor bits on {} tensors; nanogpt-cpu's {params} updates in {launches} launches", lens.len());
}
