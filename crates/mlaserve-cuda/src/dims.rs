//! The shapes of the attention calls, shared by the kernels' wrappers, their planning
//! and the references that check them. A leaf: plain data, no CUDA.

/// Shape of one decode attention call (docs/cuda.md, "MLA decode").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeDims {
    pub batch: usize,
    /// Local (per-rank) query heads.
    pub heads: usize,
    /// Uniform query length s = 1 + k drafts.
    pub q_len: usize,
    /// Latent width `kv_lora_rank` (also the value width).
    pub dlat: usize,
    /// Rotary width `qk_rope_head_dim`.
    pub drope: usize,
    /// Block-table entries per request (row stride of the block table).
    pub bt_stride: usize,
}

impl DecodeDims {
    pub fn rows(&self) -> usize {
        self.heads * self.q_len
    }
    pub fn dqk(&self) -> usize {
        self.dlat + self.drope
    }
}

/// Head dimensions of an expanded-form call (this rank's heads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillDims {
    pub heads: usize,
    /// `qk_nope_head_dim`.
    pub nope: usize,
    /// `qk_rope_head_dim` (the shared `k_pe` width).
    pub rope: usize,
    /// `v_head_dim`.
    pub vdim: usize,
}

impl PrefillDims {
    pub fn qk(&self) -> usize {
        self.nope + self.rope
    }

    /// The kernel instance's padded head widths `(qk, v)` for these dims, `None` when no
    /// instance takes them (the absorbed form then serves every row). Each width must be a
    /// multiple of 8 (16-byte rows of bf16).
    pub fn instance(&self) -> Option<(usize, usize)> {
        let aligned = [self.nope, self.rope, self.vdim].iter().all(|d| d.is_multiple_of(8));
        if !aligned || self.heads == 0 || self.nope == 0 || self.vdim == 0 {
            return None;
        }
        [(64, 64), (192, 128)].into_iter().find(|&(qk, v)| self.qk() <= qk && self.vdim <= v)
    }
}

/// One sequence's part of an expanded-form call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillSeq {
    /// Row of its first new token in the query and output buffers (`[rows][heads][..]`);
    /// its new tokens are the rows `q_row0..q_row0 + q_len`.
    pub q_row0: usize,
    /// New tokens (query rows); query `i` sits at position `k_len − q_len + i` and sees
    /// keys `0..=` that position.
    pub q_len: usize,
    /// Keys: positions `0..k_len`, the cached prefix and the new tokens.
    pub k_len: usize,
    /// Its row in the block table.
    pub table_row: usize,
}
