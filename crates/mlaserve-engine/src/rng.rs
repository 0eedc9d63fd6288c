//! Counter-based randomness: every random number a request uses is a pure function of
//! (request seed, position of the token it decides, purpose), so a request's output
//! does not depend on what else shares its batch, on preemption, or on k.

/// splitmix64's finaliser: a bijective 64-bit mixer with good avalanche.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// What a uniform is used for; distinct purposes get independent streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum Purpose {
    /// Sampling the target token at a position.
    Sample = 1,
}

/// A uniform in `[0, 1)` with 53 random bits for (seed, position, purpose).
#[inline]
pub fn uniform(seed: u64, position: u64, purpose: Purpose) -> f64 {
    let h = mix64(mix64(seed ^ mix64(position)) ^ (purpose as u64).wrapping_mul(0xd6e8_feb8_6659_fd93));
    (h >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniforms_look_uniform() {
        let n = 100_000u64;
        let mut bins = [0u32; 10];
        let mut sum = 0.0;
        for p in 0..n {
            let u = uniform(42, p, Purpose::Sample);
            assert!((0.0..1.0).contains(&u));
            bins[(u * 10.0) as usize] += 1;
            sum += u;
        }
        assert!((sum / n as f64 - 0.5).abs() < 0.01);
        for b in bins {
            assert!((b as f64 - 10_000.0).abs() < 500.0, "{bins:?}");
        }
        assert_ne!(uniform(1, 5, Purpose::Sample), uniform(2, 5, Purpose::Sample));
    }
}
