//! Tests of `host`: `load_tests`.

use super::tests_support::doubling_so;
use super::HostProgram;
use crate::tensor::{Data, Tensor};

/// The host kernels are never written where another user could plant a file: a
/// symbolic link at the path nnscaler-rt used to write them to
/// (`$TMPDIR/nnscaler-rt-<pid>-<hash>.so`, a plain write that followed it) is left
/// alone, its target unchanged, and the kernels load and run.
#[test]
fn host_kernels_load_without_a_file_another_user_can_plant() {
    let work = std::env::temp_dir().join(format!("nnscaler-load-test-{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();
    let so = doubling_so(&work);
    let victim = work.join("victim.txt");
    std::fs::write(&victim, b"precious").unwrap();
    let old = std::env::temp_dir().join(format!(
        "nnscaler-rt-{}-{:016x}.so",
        std::process::id(),
        crate::artifact::fnv1a64(&so)
    ));
    let _ = std::fs::remove_file(&old);
    std::os::unix::fs::symlink(&victim, &old).unwrap();
    let mut art = crate::artifact::tests_support::sample();
    art.sections.push(("host.so".into(), so));
    let prog = HostProgram::load(art);
    let planted = std::fs::read(&victim).unwrap();
    let _ = std::fs::remove_file(&old);
    let _ = std::fs::remove_dir_all(&work);
    assert_eq!(
        planted, b"precious",
        "the planted link's target was written"
    );
    let prog = prog.unwrap();
    let x = Tensor {
        shape: vec![4],
        data: Data::F32(vec![1.0, 2.0, 3.0, 4.0]),
    };
    let y = prog.run(&[x]).unwrap();
    assert_eq!(y[0].data, Data::F32(vec![2.0, 4.0, 6.0, 8.0]));
}

/// Two programs loaded at once each run their own kernels (the second one's memory
/// file used to reuse the first one's descriptor number, and the dynamic loader,
/// which knows a library by its path, handed back the first library).
#[test]
fn two_programs_loaded_at_once_keep_their_own_kernels() {
    let work = std::env::temp_dir().join(format!("nnscaler-two-{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();
    let double = doubling_so(&work);
    let triple = super::tests_support::scaling_so(&work, 3);
    let _ = std::fs::remove_dir_all(&work);
    let load = |so: Vec<u8>| {
        let mut art = crate::artifact::tests_support::sample();
        art.sections.push(("host.so".into(), so));
        HostProgram::load(art).unwrap()
    };
    let (a, b) = (load(double), load(triple));
    let x = Tensor {
        shape: vec![4],
        data: Data::F32(vec![1.0, 2.0, 3.0, 4.0]),
    };
    assert_eq!(
        a.run(std::slice::from_ref(&x)).unwrap()[0].data,
        Data::F32(vec![2.0, 4.0, 6.0, 8.0])
    );
    assert_eq!(
        b.run(&[x]).unwrap()[0].data,
        Data::F32(vec![3.0, 6.0, 9.0, 12.0])
    );
}
