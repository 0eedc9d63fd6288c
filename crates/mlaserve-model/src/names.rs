//! HF weight names of DeepSeek-V2/V3 checkpoints, in one place.
//!
//! Decoder layers are numbered `0..num_hidden_layers`; MTP layer `d` lives at
//! `model.layers.{num_hidden_layers + d}` (DeepSeek-V3's layout).

pub const EMBED: &str = "model.embed_tokens.weight";
pub const FINAL_NORM: &str = "model.norm.weight";
pub const LM_HEAD: &str = "lm_head.weight";

/// `model.layers.{layer}.{suffix}`.
pub fn layer(layer: usize, suffix: &str) -> String {
    format!("model.layers.{layer}.{suffix}")
}

/// Routed expert `e`'s projection (`gate_proj`, `up_proj`, `down_proj`).
pub fn expert(layer_idx: usize, e: usize, proj: &str) -> String {
    layer(layer_idx, &format!("mlp.experts.{e}.{proj}.weight"))
}

/// The block-scale tensor that goes with an fp8 weight.
pub fn scale_of(weight: &str) -> String {
    match weight.strip_suffix(".weight") {
        Some(stem) => format!("{stem}.weight_scale_inv"),
        None => format!("{weight}_scale_inv"),
    }
}
