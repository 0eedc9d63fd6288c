//! How a GPU's memory is split when a worker starts: what the model's weights take, what
//! the largest step's activations and the decode graphs need, and how many KV blocks the
//! rest holds under `--gpu-memory-utilization` (vLLM's meaning: the fraction of the
//! device's memory this process may fill). [`plan_kv`] is the arithmetic; the CUDA backend
//! measures its inputs and the worker reports the result (log, `GetInfo`).

/// The split (bytes unless named otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct MemoryPlan {
    /// The device's memory.
    pub total_bytes: u64,
    /// The fraction of it this process may fill.
    pub utilization: f64,
    /// In use before the model was loaded (the CUDA context, other processes).
    pub other_bytes: u64,
    /// The weights (and the kernel images).
    pub weights_bytes: u64,
    /// The largest step's activations, measured by a profiling forward.
    pub activation_bytes: u64,
    /// Kept aside for the decode CUDA graphs' buffers.
    pub graph_bytes: u64,
    /// The KV cache: `kv_blocks` blocks of `kv_block_bytes`, `kv_tokens` tokens.
    pub kv_bytes: u64,
    pub kv_blocks: u64,
    pub kv_block_bytes: u64,
    pub kv_tokens: u64,
}

const GIB: f64 = (1u64 << 30) as f64;

impl std::fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = |b: u64| b as f64 / GIB;
        write!(
            f,
            "{:.1} GiB of {:.1} GiB ({:.2}): other {:.2} GiB, weights {:.2} GiB, activations {:.2} GiB, \
             graphs {:.2} GiB, KV cache {:.2} GiB = {} blocks = {} tokens",
            self.utilization * g(self.total_bytes),
            g(self.total_bytes),
            self.utilization,
            g(self.other_bytes),
            g(self.weights_bytes),
            g(self.activation_bytes),
            g(self.graph_bytes),
            g(self.kv_bytes),
            self.kv_blocks,
            self.kv_tokens
        )
    }
}

/// What was measured, for [`plan_kv`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Measured {
    pub total_bytes: u64,
    pub other_bytes: u64,
    pub weights_bytes: u64,
    pub activation_bytes: u64,
    pub graph_bytes: u64,
}

/// The KV blocks that fit `utilization × total` after everything measured, at
/// `block_bytes` a block (all layers) and `block_tokens` tokens a block. Fewer than
/// `min_blocks` (one request of the longest length the server must take) is an error
/// that names what is short and by how much.
pub fn plan_kv(
    m: Measured,
    utilization: f64,
    block_bytes: u64,
    block_tokens: u64,
    min_blocks: u64,
) -> Result<MemoryPlan, String> {
    if !(utilization > 0.0 && utilization <= 1.0) {
        return Err(format!("--gpu-memory-utilization must be in (0, 1], got {utilization}"));
    }
    let g = |b: u64| b as f64 / GIB;
    let allowed = (utilization * m.total_bytes as f64) as u64;
    let fixed = m.other_bytes + m.weights_bytes + m.activation_bytes + m.graph_bytes;
    let need = fixed + min_blocks * block_bytes;
    if need > allowed {
        let what = if m.other_bytes + m.weights_bytes > allowed { "the weights" } else { "the KV cache" };
        return Err(format!(
            "the model does not fit: {what} would exceed --gpu-memory-utilization {utilization} of {:.1} GiB \
             ({:.2} GiB allowed; other {:.2} GiB, weights {:.2} GiB, activations {:.2} GiB, graphs {:.2} GiB, \
             and {min_blocks} KV blocks of {:.1} MiB for one request of the longest length: {:.2} GiB short)",
            g(m.total_bytes),
            g(allowed),
            g(m.other_bytes),
            g(m.weights_bytes),
            g(m.activation_bytes),
            g(m.graph_bytes),
            block_bytes as f64 / (1u64 << 20) as f64,
            g(need - allowed)
        ));
    }
    let kv_blocks = (allowed - fixed) / block_bytes.max(1);
    Ok(MemoryPlan {
        total_bytes: m.total_bytes,
        utilization,
        other_bytes: m.other_bytes,
        weights_bytes: m.weights_bytes,
        activation_bytes: m.activation_bytes,
        graph_bytes: m.graph_bytes,
        kv_bytes: kv_blocks * block_bytes,
        kv_blocks,
        kv_block_bytes: block_bytes,
        kv_tokens: kv_blocks * block_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1 << 30;

    fn m() -> Measured {
        Measured {
            total_bytes: 80 * GB,
            other_bytes: GB / 2,
            weights_bytes: 40 * GB,
            activation_bytes: 2 * GB,
            graph_bytes: GB,
        }
    }

    #[test]
    fn the_cache_takes_what_is_left_under_the_fraction() {
        let p = plan_kv(m(), 0.9, 64 << 20, 64, 10).unwrap();
        // 72 GiB allowed - 43.5 GiB fixed = 28.5 GiB = 456 blocks of 64 MiB.
        assert_eq!(p.kv_blocks, 456);
        assert_eq!(p.kv_tokens, 456 * 64);
        assert_eq!(p.kv_bytes, 456 * (64 << 20));
        let used = p.other_bytes + p.weights_bytes + p.activation_bytes + p.graph_bytes + p.kv_bytes;
        assert!(used as f64 <= 0.9 * p.total_bytes as f64);
        assert!(p.to_string().contains("456 blocks = 29184 tokens"), "{p}");
        // A lower fraction leaves fewer blocks.
        assert!(plan_kv(m(), 0.7, 64 << 20, 64, 10).unwrap().kv_blocks < p.kv_blocks);
    }

    #[test]
    fn what_does_not_fit_is_named() {
        let e = plan_kv(Measured { weights_bytes: 75 * GB, ..m() }, 0.9, 64 << 20, 64, 10).unwrap_err();
        assert!(e.contains("the weights would exceed --gpu-memory-utilization 0.9"), "{e}");
        let e = plan_kv(m(), 0.9, 64 << 20, 64, 1000).unwrap_err();
        assert!(e.contains("the KV cache would exceed") && e.contains("1000 KV blocks"), "{e}");
        assert!(e.contains("GiB short"), "{e}");
        for bad in [0.0, 1.5, f64::NAN] {
            assert!(plan_kv(m(), bad, 1, 1, 1).unwrap_err().contains("must be in (0, 1]"));
        }
    }
}
