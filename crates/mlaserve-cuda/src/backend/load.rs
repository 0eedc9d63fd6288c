//! Loading a checkpoint onto the device ([`CudaBackend::load_tp_observed`]): this rank's
//! shards read from the memory maps layer by layer, the next layer prefetched from disk
//! (`Weights::prefetch`) while this one is uploaded through pinned staging
//! (`crate::stage::Stager`); fp8 projections and experts kept in fp8 when the fp8 kernels
//! load (`proj.rs`), the rest as the checkpoint stores it.

use std::path::Path;
use std::sync::Arc;

use mlaserve_core::Error;
use mlaserve_model::progress::LoadProgress;
use mlaserve_model::{names, Weights};

use super::weights::{Block, Embed, Loader, Mtp};
use super::{proj, CudaBackend, CudaOptions};
use crate::comm::TpInit;
use crate::error::{CudaError, Result};
use crate::gpu::Gpu;

impl CudaBackend {
    /// [`CudaBackend::load_tp`], ticking `progress`.
    pub fn load_tp_observed(
        dir: &Path,
        opts: CudaOptions,
        tp: Option<&TpInit>,
        progress: Arc<LoadProgress>,
    ) -> Result<Self> {
        let bad = |e: Error| CudaError::Shape { kernel: "load", msg: e.to_string() };
        let open_t0 = std::time::Instant::now();
        let cfg = mlaserve_model::load_config(dir).map_err(bad)?;
        let (rank, world) = tp.map_or((0, 1), |t| (t.rank, t.world));
        cfg.check_tp(world).map_err(bad)?;
        // The RoPE tables compute on the host while the weights are read.
        let rope = crate::rope::PendingRope::start(&cfg);
        let mut w = Weights::open(dir, cfg.fp8).map_err(bad)?;
        progress.set_total(w.data_bytes());
        w.set_progress(progress);
        let open_s = open_t0.elapsed().as_secs_f64();
        let gpu = Gpu::new(opts.ordinal)?;
        let (free_at_start, _) = gpu.free_memory()?;
        let comm = super::join_comm(&gpu, tp, &opts)?;
        let dq = crate::fp8_dequant::Fp8Dequant::new(&gpu)?;
        let stage = std::cell::RefCell::new(crate::stage::Stager::new(&gpu)?);
        let setup_s = open_t0.elapsed().as_secs_f64() - open_s;
        let load_t0 = std::time::Instant::now();
        let fp8 = if cfg.fp8.is_some() { proj::Fp8Kernels::new(&gpu, &opts) } else { None };
        let l = Loader {
            w: &w,
            s: &gpu.stream,
            rank,
            world,
            dq: &dq,
            fp8: fp8.is_some(),
            grouped_fp8: fp8.as_ref().is_some_and(|k| k.grouped.is_some()),
            stage: &stage,
        };
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        w.prefetch(names::EMBED);
        w.prefetch("model.layers.0.");
        let embed = Embed::load(&l, names::EMBED, v, h)?;
        let layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers;
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| {
                // The next layer is read from disk while this one is uploaded.
                if i + 1 < layers {
                    w.prefetch(&format!("model.layers.{}.", i + 1));
                }
                Block::load(&l, &cfg, i)
            })
            .collect::<Result<Vec<_>>>()?;
        w.prefetch(names::FINAL_NORM);
        w.prefetch(if cfg.tie_word_embeddings { names::EMBED } else { names::LM_HEAD });
        let final_norm = l.vec(names::FINAL_NORM, h)?;
        let head_name = if cfg.tie_word_embeddings { names::EMBED } else { names::LM_HEAD };
        let lm_head = l.lin(head_name, v, h, Some(0))?;
        let mtp =
            (0..cfg.num_nextn_predict_layers).map(|d| Mtp::load(&l, &cfg, d, head_name)).collect::<Result<Vec<_>>>()?;
        let mut st = stage.borrow_mut();
        st.finish()?;
        let (t, gb) = (load_t0.elapsed().as_secs_f64(), st.stats.bytes as f64 / 1e9);
        tracing::info!(
            "weights read and uploaded in {t:.2} s ({:.2} GB/s): {gb:.2} GB staged, host copies {:.2} s, waits for \
             the GPU {:.2} s; before them: checkpoint opened {open_s:.2} s, device set up {setup_s:.2} s",
            w.data_bytes() as f64 / 1e9 / t,
            st.stats.copy_s,
            st.stats.wait_s
        );
        drop(st);
        drop(w);
        let asm_t0 = std::time::Instant::now();
        let parts = (embed, blocks, final_norm, lm_head, mtp);
        let be = Self::assemble(cfg, gpu, parts, fp8, opts, comm, super::Early { free_at_start, rope });
        tracing::info!("backend assembled in {:.2} s", asm_t0.elapsed().as_secs_f64());
        be
    }
}
