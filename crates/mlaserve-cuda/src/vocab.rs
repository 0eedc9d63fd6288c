//! The vocabulary-parallel head's choice across ranks, on the host: each rank sends the
//! best (value, id) of its slice of the vocabulary (`argmax_pair_f32`), and the group's
//! id is the best of those in rank order. The device kernel `argmax_pairs_best`
//! (`kernels/argmax.cu`) applies the same rule; this is its reference and the path of
//! calls that bring their ids to the host.

/// The ids of `rows` rows from every rank's (value, id) pairs, rank-major (`pairs[(rank ·
/// rows + r) · 2]` the value, `+ 1` the id as f32): a later rank wins only with a
/// strictly larger value, NaN never wins, a row of NaN gives 0 — over the ranks' slices in
/// vocabulary order, the first index of the largest value, as `mlaserve_core::argmax`.
pub fn best_of_ranks(pairs: &[f32], rows: usize, world: usize) -> Vec<u32> {
    (0..rows)
        .map(|r| {
            let mut best: Option<(f32, u32)> = None;
            for rk in 0..world {
                let (v, i) = (pairs[(rk * rows + r) * 2], pairs[(rk * rows + r) * 2 + 1] as u32);
                if !v.is_nan() && best.is_none_or(|(bv, _)| v > bv) {
                    best = Some((v, i));
                }
            }
            best.map_or(0, |b| b.1)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank's pair over its slice, as `argmax_pair_f32` makes it.
    fn pair(slice: &[f32], offset: usize) -> [f32; 2] {
        let mut best: Option<(f32, usize)> = None;
        for (i, &v) in slice.iter().enumerate() {
            if !v.is_nan() && best.is_none_or(|(bv, _)| v > bv) {
                best = Some((v, i));
            }
        }
        match best {
            Some((v, i)) => [v, (i + offset) as f32],
            None => [f32::NAN, offset as f32],
        }
    }

    #[test]
    fn the_best_of_the_ranks_is_the_argmax_of_the_whole_row() {
        let (vocab, rows) = (48usize, 64usize);
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for world in [1, 2, 4, 8] {
            let part = vocab / world;
            // Rows with ties across and within slices, NaN here and there, all-NaN rows.
            let logits: Vec<Vec<f32>> = (0..rows)
                .map(|r| {
                    (0..vocab)
                        .map(|_| match (r % 8, next() % 10) {
                            (7, _) => f32::NAN,
                            (_, 0) => f32::NAN,
                            _ => (next() % 5) as f32,
                        })
                        .collect()
                })
                .collect();
            let mut pairs = vec![0f32; world * rows * 2];
            for rk in 0..world {
                for (r, row) in logits.iter().enumerate() {
                    let p = pair(&row[rk * part..(rk + 1) * part], rk * part);
                    pairs[(rk * rows + r) * 2..][..2].copy_from_slice(&p);
                }
            }
            let got = best_of_ranks(&pairs, rows, world);
            for (r, row) in logits.iter().enumerate() {
                let want = if row.iter().all(|v| v.is_nan()) { 0 } else { mlaserve_core::argmax(row) };
                assert_eq!(got[r], want, "world {world}, row {r}: {row:?}");
            }
        }
    }
}
