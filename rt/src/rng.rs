//! Seeded, counter-based random numbers: the same (seed, stream, index) always gives the same
//! value, on every machine and in any execution order. Dropout masks and parameter
//! initialization are functions of their seed and the element's global index, so a tensor
//! split across devices draws exactly the numbers the single-device program draws.

/// SplitMix64's finalizer: a bijective 64-bit mix with good avalanche.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The 64 random bits for element `index` of stream `stream` under `seed`.
pub fn bits(seed: u64, stream: u64, index: u64) -> u64 {
    mix64(mix64(seed ^ mix64(stream)) ^ index)
}

/// A uniform f64 in [0, 1) with 53 random bits.
pub fn uniform(seed: u64, stream: u64, index: u64) -> f64 {
    (bits(seed, stream, index) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A standard normal sample (Box–Muller on two uniforms of the element's own counter).
pub fn normal(seed: u64, stream: u64, index: u64) -> f64 {
    let u1 = uniform(seed, stream, 2 * index);
    let u2 = uniform(seed, stream, 2 * index + 1);
    let r = (-2.0 * (1.0 - u1).ln()).sqrt();
    r * (std::f64::consts::TAU * u2).cos()
}

/// A stable 64-bit hash of a name (FNV-1a), used to give each parameter its own stream.
pub fn name_stream(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Whether dropout with probability `p` keeps element `index` under `seed`.
pub fn dropout_keep(seed: u64, index: u64, p: f64) -> bool {
    uniform(seed, 0x64_726f_706f_7574, index) >= p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_well_spread() {
        assert_eq!(bits(1, 2, 3), bits(1, 2, 3));
        assert_ne!(bits(1, 2, 3), bits(1, 2, 4));
        assert_ne!(bits(1, 2, 3), bits(2, 2, 3));
        let n = 200_000;
        let (mut s, mut s2) = (0.0, 0.0);
        for i in 0..n {
            let x = normal(7, 0, i);
            s += x;
            s2 += x * x;
        }
        let mean = s / n as f64;
        let var = s2 / n as f64 - mean * mean;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.01, "var {var}");
        let kept = (0..n).filter(|&i| dropout_keep(3, i, 0.25)).count() as f64 / n as f64;
        assert!((kept - 0.75).abs() < 0.005, "kept {kept}");
    }
}
