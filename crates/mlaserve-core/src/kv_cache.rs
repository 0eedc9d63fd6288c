//! The latent cache's storage format (`--kv-cache-dtype`, vLLM's flag of that name).

/// How a backend stores the latent cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    /// The backend's own precision: f32 on the CPU reference, bf16 on the GPU.
    #[default]
    Auto,
    /// DeepSeek's fp8 layout (FlashMLA's): per token and layer, the `kv_lora_rank` latent
    /// channels as e4m3 codes with one f32 scale per [`KV_FP8_GROUP`] channels
    /// (`amax / 448`, as the activation quantisation of fp8 checkpoints), and the RoPE
    /// channels in bf16. 656 bytes at V3's 512 + 64 channels, 0.57× the bf16 entry.
    Fp8,
}

/// Latent channels per f32 scale in [`KvCacheDtype::Fp8`].
pub const KV_FP8_GROUP: usize = 128;

impl KvCacheDtype {
    /// Bytes of one token's entry in one layer's cache, for `lora` latent and `rope`
    /// RoPE channels, where `auto_bytes` is the backend's own bytes per channel.
    pub fn entry_bytes(self, lora: usize, rope: usize, auto_bytes: usize) -> usize {
        match self {
            KvCacheDtype::Auto => (lora + rope) * auto_bytes,
            KvCacheDtype::Fp8 => lora + 4 * lora.div_ceil(KV_FP8_GROUP) + 2 * rope,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v3_entry_sizes() {
        assert_eq!(KvCacheDtype::Fp8.entry_bytes(512, 64, 2), 656);
        assert_eq!(KvCacheDtype::Auto.entry_bytes(512, 64, 2), 1152);
        assert_eq!(KvCacheDtype::Auto.entry_bytes(512, 64, 4), 2304);
        // A partial last group still has its own scale.
        assert_eq!(KvCacheDtype::Fp8.entry_bytes(200, 32, 2), 200 + 8 + 64);
    }
}
