//! Tests of `host`: `tests`.

use super::{cut, place, place_checked};

#[test]
fn blocks_cut_and_place_back() {
    // A 3 x 4 tensor of u32 indices; the block rows 1..3, columns 1..3.
    let shape = [3u64, 4];
    let whole: Vec<u8> = (0u32..12).flat_map(|v| v.to_le_bytes()).collect();
    let ranges = [[1, 3], [1, 3]];
    let piece = cut(&whole, &shape, &ranges, 4);
    let vals: Vec<u32> = piece
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(vals, vec![5, 6, 9, 10]);
    let mut back = vec![0u8; whole.len()];
    place(&mut back, &shape, &ranges, &piece, 4);
    assert_eq!(&back[20..28], &whole[20..28]);
    // Replicas must agree bit for bit.
    let mut owner = vec![u32::MAX; 12];
    let mut out = vec![0u8; whole.len()];
    assert_eq!(
        place_checked(&mut out, &shape, &ranges, &piece, 4, &mut owner, 0),
        None
    );
    let mut other = piece.clone();
    other[0] ^= 1;
    assert_eq!(
        place_checked(&mut out, &shape, &ranges, &other, 4, &mut owner, 1),
        Some((5, 0))
    );
}
