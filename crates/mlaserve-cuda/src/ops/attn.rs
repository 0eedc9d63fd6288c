//! The absorbed-MLA pieces of the forward pass: RoPE + the paged latent write, query
//! absorption (`W_UK`), the varlen absorbed attention, and `W_UV`; the two head-wise
//! products run on tensor cores (`heads_tc`) where the widths allow.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use super::Ops;
use crate::error::{CudaError, Result};
use crate::launch::{head_cfg, i32_of, need, opt_ptr_mut, rows_cfg};
use crate::layout::{kv_entry_elems, AttnMeta};
use crate::rope::RopeTables;

/// One `heads_tc` call: `m` rows of `heads` heads, `k` inputs and `n` outputs per head,
/// row strides (elements) of x and y, and W's layout per head: `[k][n]` (W_UK) when
/// `w_kn`, else `[n][k]` (W_UV).
struct HeadsTc {
    m: usize,
    heads: usize,
    k: usize,
    n: usize,
    x_stride: usize,
    y_stride: usize,
    w_kn: bool,
}

/// Where `heads_tc` puts its result.
enum HeadsOut<'a> {
    /// f32 rows (when given) and bf16 rows of `y_stride` elements.
    Rows { y: Option<&'a mut CudaSlice<f32>>, yb: &'a mut CudaSlice<bf16> },
    /// Quantised for an fp8 GEMM that reads them (`heads_tc_reduce_quant`): codes
    /// `[m][heads · 128]` and scales `[m][heads]`; needs N = y_stride = 128 and split K.
    Fp8 { q: &'a mut CudaSlice<u8>, scale: &'a mut CudaSlice<f32> },
}

/// Bytes of split-K partials one `heads_tc` launch may write; more rows run in slabs.
const HEADS_PARTIAL_BYTES: usize = 32 << 20;

/// Dynamic shared memory a kernel takes without raising its attribute.
pub(crate) const DEFAULT_SMEM: usize = 48 * 1024;

/// Dynamic shared memory of `mla_attn_varlen` for entries of `dqk` channels and
/// positions up to `max_pos`: the query and every position's score, f32.
pub(crate) fn varlen_smem(dqk: usize, max_pos: usize) -> usize {
    (dqk + max_pos + 1) * 4
}

/// `heads_tc`'s split of K, from K alone (so a row's sums never depend on the batch):
/// (ranges, width). Long sums (W_UV's K = 512) run as 128-wide ranges, four times the
/// blocks of one pass over K: a decode call has a single 64-row tile per head, and
/// the time of one block reading all of K bounds it. The absorbed query (rope) runs
/// whole.
fn heads_tc_split(k: usize, rope: usize) -> (usize, usize) {
    const KCHUNK: usize = 128;
    if rope == 0 && k >= 2 * KCHUNK && k.is_multiple_of(KCHUNK) {
        (k / KCHUNK, KCHUNK)
    } else {
        (1, k)
    }
}

/// Whether `heads_tc` (kernels/heads_tc.cu) takes these widths: 16-byte rows of x and W,
/// pairs of outputs.
fn heads_tc_takes(k: usize, n: usize, x_stride: usize, y_stride: usize) -> bool {
    k.is_multiple_of(8) && n.is_multiple_of(8) && x_stride.is_multiple_of(4) && y_stride.is_multiple_of(2)
}

impl Ops {
    /// Writes the latent of `n` rows of `kv` (`[n][lora + rope]` f32) into `cache` at
    /// `slot[r]`: `[RMSNorm(c_kv) * norm_w, RoPE(k_pe, pos[r])]` as bf16. A row whose slot
    /// is negative (a CUDA-graph bucket's padding) or past the cache writes nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write(
        &self,
        s: &Arc<CudaStream>,
        cache: &mut CudaSlice<bf16>,
        kv: &CudaSlice<f32>,
        norm_w: &CudaSlice<f32>,
        rope: &RopeTables,
        pos: &CudaSlice<i32>,
        slot: &CudaSlice<i64>,
        n: usize,
        eps: f32,
    ) -> Result<()> {
        const K: &str = "kv_cache_write";
        let (lora, r) = (norm_w.len(), rope.dim);
        let lat = lora + r;
        need(K, "kv", kv.len(), n * lat)?;
        need(K, "pos", pos.len(), n)?;
        need(K, "slot", slot.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let (li, ri) = (i32_of(K, lora)?, i32_of(K, r)?);
        let entry = kv_entry_elems(self.kv_fp8, lora, r).map_err(|e| CudaError::shape(K, e))?;
        if self.kv_fp8 && lora > 1024 {
            return Err(CudaError::shape(K, format!("kv_lora_rank {lora} > 1024")));
        }
        let slots = (cache.len() / entry) as i64;
        // SAFETY: block r reads kv[r*lat..][..lat], norm_w[..lora], pos[r], slot[r] and the
        // rope tables at pos[r] (positions < the tables' length, validated by the caller
        // through Batch::validate; a padding row's positions are 0..4), and writes the
        // entry cache[slot[r]*entry..][..entry] (bf16 elements; the fp8 kernel the same
        // bytes, lora <= 1024 for its shared buffer) only for 0 <= slot[r] < slots = whole
        // entries in the cache (the kernel skips the others).
        unsafe {
            s.launch_builder(if self.kv_fp8 { &self.kv_write_fp8 } else { &self.kv_write })
                .arg(cache)
                .arg(kv)
                .arg(norm_w)
                .arg(&rope.cos)
                .arg(&rope.sin)
                .arg(pos)
                .arg(slot)
                .arg(&slots)
                .arg(&li)
                .arg(&ri)
                .arg(&eps)
                .launch(rows_cfg(n, 128, 0))
        }?;
        Ok(())
    }

    /// Fills an fp8 cache (`cache.len()` bf16 elements' worth of whole entries) with
    /// random entries of values in about [-1, 1) from `seed` (benchmarks: a context
    /// without a prefill).
    pub fn fill_kv_fp8(
        &self,
        s: &Arc<CudaStream>,
        cache: &mut CudaSlice<bf16>,
        lora: usize,
        rope: usize,
        seed: u32,
    ) -> Result<()> {
        const K: &str = "kv_fill_fp8";
        let entry = kv_entry_elems(true, lora, rope).map_err(|e| CudaError::shape(K, e))?;
        let entries = (cache.len() / entry) as i64;
        let (li, ri) = (i32_of(K, lora)?, i32_of(K, rope)?);
        // SAFETY: thread i < entries writes entry i's bytes, [i*entry*2, (i+1)*entry*2),
        // inside the cache's cache.len()*2 bytes.
        unsafe {
            s.launch_builder(&self.kv_fill_fp8)
                .arg(cache)
                .arg(&entries)
                .arg(&li)
                .arg(&ri)
                .arg(&seed)
                .launch(self.grid_stride())
        }?;
        Ok(())
    }

    /// Absorbed queries: `qa[r][h] = [W_UK[h]^T q_nope, RoPE(q_pe, pos[r])]`, in f32 and bf16,
    /// on tensor cores (`heads_tc`, q_nope as bf16 hi + lo) when the widths allow, else one
    /// CUDA-core block per row and head. Either way a row's result ignores the other rows.
    #[allow(clippy::too_many_arguments)]
    pub fn q_absorb(
        &self,
        s: &Arc<CudaStream>,
        qa: &mut CudaSlice<f32>,
        qa_bf16: &mut CudaSlice<bf16>,
        q: &CudaSlice<f32>,
        wuk: &CudaSlice<bf16>,
        rope: &RopeTables,
        pos: &CudaSlice<i32>,
        n: usize,
        heads: usize,
        nope: usize,
        lora: usize,
    ) -> Result<()> {
        const K: &str = "q_absorb_f32";
        let r = rope.dim;
        need(K, "q", q.len(), n * heads * (nope + r))?;
        need(K, "wuk", wuk.len(), heads * nope * lora)?;
        need(K, "qa", qa.len(), n * heads * (lora + r))?;
        need(K, "qa_bf16", qa_bf16.len(), n * heads * (lora + r))?;
        need(K, "pos", pos.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        if heads_tc_takes(nope, lora, nope + r, lora + r) {
            let t = HeadsTc { m: n, heads, k: nope, n: lora, x_stride: nope + r, y_stride: lora + r, w_kn: true };
            return self.heads_tc(s, HeadsOut::Rows { y: Some(qa), yb: qa_bf16 }, q, wuk, &t, Some((rope, pos)));
        }
        let (hi, ni, ri, li) = (i32_of(K, heads)?, i32_of(K, nope)?, i32_of(K, r)?, i32_of(K, lora)?);
        // SAFETY: block (h, r) reads q[(r*heads+h)*(nope+rope)..][..nope+rope],
        // wuk[h*nope*lora..][..nope*lora] and the rope tables at pos[r] (validated by the
        // caller), writes qa/qa_bf16[(r*heads+h)*(lora+rope)..][..lora+rope]; lengths
        // checked above; shared memory holds nope floats.
        unsafe {
            s.launch_builder(&self.q_absorb)
                .arg(qa)
                .arg(qa_bf16)
                .arg(q)
                .arg(wuk)
                .arg(&rope.cos)
                .arg(&rope.sin)
                .arg(pos)
                .arg(&hi)
                .arg(&ni)
                .arg(&ri)
                .arg(&li)
                .launch(head_cfg(heads, n, 128, nope * 4))
        }?;
        Ok(())
    }

    /// Varlen causal absorbed attention: row r (sequence `row_seq[r]`, position `pos[r]`)
    /// attends to its sequence's cache positions `0..=pos[r]` through `tables`
    /// (`[seqs][bt_stride]`). `max_pos` bounds every `pos[r]` (the caller's host copy);
    /// `max_block` bounds every table entry.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_varlen(
        &self,
        s: &Arc<CudaStream>,
        o_lat: &mut CudaSlice<f32>,
        qa: &CudaSlice<f32>,
        cache: &CudaSlice<bf16>,
        tables: &CudaSlice<i32>,
        row_seq: &CudaSlice<i32>,
        pos: &CudaSlice<i32>,
        meta: &AttnMeta,
        heads: usize,
        lora: usize,
        rope: usize,
        scale: f32,
    ) -> Result<()> {
        const K: &str = "mla_attn_varlen";
        let (n, dqk) = (meta.n, lora + rope);
        let entry = kv_entry_elems(self.kv_fp8, lora, rope).map_err(|e| CudaError::shape(K, e))?;
        need(K, "qa", qa.len(), n * heads * dqk)?;
        need(K, "o_lat", o_lat.len(), n * heads * lora)?;
        need(K, "row_seq", row_seq.len(), n)?;
        need(K, "pos", pos.len(), n)?;
        need(K, "tables", tables.len(), meta.seqs * meta.bt_stride)?;
        need(K, "cache", cache.len(), (meta.max_block + 1) * 64 * entry)?;
        if meta.max_pos >= meta.bt_stride * 64 {
            return Err(CudaError::shape(K, "a position lies past its block table"));
        }
        if n == 0 {
            return Ok(());
        }
        let smem = varlen_smem(dqk, meta.max_pos);
        if smem > self.max_smem {
            return Err(CudaError::shape(
                K,
                format!("context of {} tokens needs {smem} B of shared memory", meta.max_pos),
            ));
        }
        let f = if self.kv_fp8 { &self.attn_fp8 } else { &self.attn };
        if smem > DEFAULT_SMEM {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        let (bt, hi, li, ri) = (i32_of(K, meta.bt_stride)?, i32_of(K, heads)?, i32_of(K, lora)?, i32_of(K, rope)?);
        // SAFETY: block (h, r) reads qa[(r*heads+h)*dqk..][..dqk], tables[row_seq[r]*bt..][..]
        // for pages j/64 with j <= pos[r] <= max_pos < bt*64, cache entries of those pages
        // (every table entry <= max_block, checked against the cache length), and writes
        // o_lat[(r*heads+h)*lora..][..lora]; shared memory holds dqk + max_pos + 1 floats.
        // (Entries of `entry` bf16 elements, or as many bytes' worth of fp8 entries.)
        unsafe {
            s.launch_builder(f)
                .arg(o_lat)
                .arg(qa)
                .arg(cache)
                .arg(tables)
                .arg(row_seq)
                .arg(pos)
                .arg(&bt)
                .arg(&hi)
                .arg(&li)
                .arg(&ri)
                .arg(&scale)
                .launch(head_cfg(heads, n, 128, smem))
        }?;
        Ok(())
    }

    /// `heads_tc`: per head h, `y[r][h][..n] = x[r][h][..k] · W_h` (see [`HeadsTc`]), f32
    /// into `y` when given and bf16 into `yb`; with `rope`, also the rotated q_pe (x's
    /// elements k..k + rope.dim of each row, at `pos[r]`) into columns n.. of y and yb.
    #[allow(clippy::too_many_arguments)]
    fn heads_tc(
        &self,
        s: &Arc<CudaStream>,
        out: HeadsOut,
        x: &CudaSlice<f32>,
        w: &CudaSlice<bf16>,
        t: &HeadsTc,
        rope: Option<(&RopeTables, &CudaSlice<i32>)>,
    ) -> Result<()> {
        const K: &str = "heads_tc";
        let rd = rope.map_or(0, |r| r.0.dim);
        need(K, "x", x.len(), t.m * t.heads * t.x_stride)?;
        need(K, "w", w.len(), t.heads * t.k * t.n)?;
        if t.x_stride < t.k + rd || t.y_stride < t.n + rd {
            return Err(CudaError::shape(K, "strides narrower than the row"));
        }
        let (ksplit, kchunk) = heads_tc_split(t.k, rd);
        // The outputs: y and yb, or the quantised codes and scales (q, sc: null otherwise).
        let (y, yb, quant) = match out {
            HeadsOut::Rows { y, yb } => (y, Some(yb), None),
            HeadsOut::Fp8 { q, scale } => {
                if ksplit == 1 || t.n != 128 || t.y_stride != 128 || rd != 0 {
                    return Err(CudaError::shape(K, "quantised output needs N = 128 and split K"));
                }
                need(K, "q", q.len(), t.m * t.heads * t.n)?;
                need(K, "scale", scale.len(), t.m * t.heads)?;
                (None, None, Some((q, scale)))
            }
        };
        let (yp, _gy) = opt_ptr_mut(K, "y", s, y, t.m * t.heads * t.y_stride)?;
        let (ybp, _gyb) = opt_ptr_mut(K, "yb", s, yb, t.m * t.heads * t.y_stride)?;
        let (qp, sp_q, _gq) = match quant {
            Some((q, sc)) => {
                let (a, g1) = q.device_ptr_mut(s);
                let (b, g2) = sc.device_ptr_mut(s);
                (a, b, Some((g1, g2)))
            }
            None => (0, 0, None),
        };
        let (cp, sp, pp, _gr) = match rope {
            Some((tab, pos)) => {
                need(K, "pos", pos.len(), t.m)?;
                let (c, g1) = tab.cos.device_ptr(s);
                let (sn, g2) = tab.sin.device_ptr(s);
                let (p, g3) = pos.device_ptr(s);
                (c, sn, p, Some((g1, g2, g3)))
            }
            None => (0, 0, 0, None),
        };
        let nblocks = t.n.div_ceil(64);
        if t.m.div_ceil(64) > u32::MAX as usize || nblocks * ksplit > 65_535 || t.heads > 65_535 {
            return Err(CudaError::shape(K, "grid too large"));
        }
        let mut args = [0i32; 7];
        for (a, v) in args.iter_mut().zip([t.heads, t.k, t.n, t.x_stride, t.y_stride, t.w_kn as usize, rd]) {
            *a = i32_of(K, v)?;
        }
        let (kci, ksi) = (i32_of(K, kchunk)?, i32_of(K, ksplit)?);
        i32_of(K, t.m)?;
        // Split K: rows in slabs whose partials fit HEADS_PARTIAL_BYTES (rows are
        // independent, so slabs change no result; rope, which reads pos from row 0, only
        // runs unsplit, in one slab).
        let slab =
            if ksplit == 1 { t.m } else { (HEADS_PARTIAL_BYTES / (ksplit * t.heads * t.n * 4)).max(64) / 64 * 64 }
                .min(t.m);
        let mut part = if ksplit > 1 {
            // SAFETY: every partial a slab's reduce reads (ksplit × rows × heads × n) is
            // written by that slab's heads_tc launch first, earlier on this stream.
            Some(unsafe { s.alloc::<f32>(ksplit * slab * t.heads * t.n) }?)
        } else {
            None
        };
        let plen = part.as_ref().map_or(0, |p| p.len());
        let (partp, _gp) = opt_ptr_mut(K, "part", s, part.as_mut(), plen)?;
        let (xp, _gx) = x.device_ptr(s);
        let mut r0 = 0;
        while r0 < t.m {
            let rows = slab.min(t.m - r0);
            let (row_x, row_y) = ((r0 * t.heads * t.x_stride) as u64, (r0 * t.heads * t.y_stride) as u64);
            let xr = xp + row_x * 4;
            let ybr = if ybp == 0 { 0 } else { ybp + row_y * 2 };
            let yr = if yp == 0 { 0 } else { yp + row_y * 4 };
            let ri = rows as i32; // <= m, checked above
            let cfg = LaunchConfig {
                grid_dim: (rows.div_ceil(64) as u32, (nblocks * ksplit) as u32, t.heads as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: heads_tc(y, yb, x, w, m, heads, K, N, x_stride, y_stride, wt, cos, sin,
            // pos, rope, part, kchunk) on rows r0.. r0 + rows: block (chunk, column block and
            // k range, h) reads x[(r·heads + h)·x_stride..][..K + rope] for its rows r <
            // rows, w[h·K·N..][..K·N], the rope tables at pos[r] (validated positions, the
            // tables cover them; rope only unsplit, in one slab from row 0) and writes
            // y/yb[(r·heads + h)·y_stride..][..N + rope] for r < rows only, or with a split
            // part[z][r·heads + h][..N] (ksplit × slab × heads × N allocated); every length
            // is checked above (y, yb null: not written, only with a split); 16-byte loads: K, N, x_stride
            // multiples of 8, 8, 4 (heads_tc_takes), 256-byte aligned buffers, so row
            // offsets of x_stride floats stay 16-byte aligned; kchunk a multiple of 64.
            unsafe {
                s.launch_builder(&self.heads_tc)
                    .arg(&yr)
                    .arg(&ybr)
                    .arg(&xr)
                    .arg(w)
                    .arg(&ri)
                    .arg(&args[0])
                    .arg(&args[1])
                    .arg(&args[2])
                    .arg(&args[3])
                    .arg(&args[4])
                    .arg(&args[5])
                    .arg(&cp)
                    .arg(&sp)
                    .arg(&pp)
                    .arg(&args[6])
                    .arg(&partp)
                    .arg(&kci)
                    .launch(cfg)
            }?;
            if qp != 0 {
                let groups = rows * t.heads;
                let qcfg = LaunchConfig {
                    grid_dim: (groups.div_ceil(8) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let (qr, sr) = (qp + (r0 * t.heads * t.n) as u64, sp_q + (r0 * t.heads) as u64 * 4);
                // SAFETY: heads_tc_reduce_quant(q, s, part, m, heads, ksplit) reads
                // part[z][i] for z < ksplit, i < rows × heads × 128 (all written by the
                // launch above, on this stream; N = 128 checked) and writes q[i] and
                // s[i / 128] from row r0: within q's m × heads × 128 bytes and the scales'
                // m × heads floats (checked above).
                unsafe {
                    s.launch_builder(&self.heads_tc_reduce_quant)
                        .arg(&qr)
                        .arg(&sr)
                        .arg(&partp)
                        .arg(&ri)
                        .arg(&args[0])
                        .arg(&ksi)
                        .launch(qcfg)
                }?;
            } else if ksplit > 1 {
                let len = rows * t.heads * t.n;
                let rcfg = LaunchConfig {
                    grid_dim: (len.div_ceil(256) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: heads_tc_reduce(y, yb, part, m, heads, N, y_stride, ksplit) reads
                // part[z][i] for z < ksplit, i < rows × heads × N (all written by the launch
                // above, on this stream) and writes y/yb[(i / N)·y_stride + i % N] from row
                // r0: within the rows × heads × y_stride checked above.
                unsafe {
                    s.launch_builder(&self.heads_tc_reduce)
                        .arg(&yr)
                        .arg(&ybr)
                        .arg(&partp)
                        .arg(&ri)
                        .arg(&args[0])
                        .arg(&args[2])
                        .arg(&args[4])
                        .arg(&ksi)
                        .launch(rcfg)
                }?;
            }
            r0 += rows;
        }
        Ok(())
    }

    /// Whether [`Ops::wuv_quant`] takes these widths: the tensor-core path with K split
    /// and one head a 128-channel group (V3: lora 512, vdim 128).
    pub fn wuv_quant_takes(lora: usize, vdim: usize) -> bool {
        vdim == 128 && heads_tc_takes(lora, vdim, lora, vdim) && heads_tc_split(lora, 0).0 > 1
    }

    /// [`Ops::wuv`]'s output quantised for an fp8 GEMM that reads it (o_proj), in the
    /// reduce of its split K: codes `q` `[n][heads · 128]` and scales `[n][heads]`, the
    /// bytes [`Ops::wuv`] then the activation quantisation give. Widths per
    /// [`Ops::wuv_quant_takes`], else an error.
    #[allow(clippy::too_many_arguments)]
    pub fn wuv_quant(
        &self,
        s: &Arc<CudaStream>,
        q: &mut CudaSlice<u8>,
        scale: &mut CudaSlice<f32>,
        o_lat: &CudaSlice<f32>,
        wuv: &CudaSlice<bf16>,
        n: usize,
        heads: usize,
        lora: usize,
        vdim: usize,
    ) -> Result<()> {
        const K: &str = "wuv_quant";
        need(K, "o_lat", o_lat.len(), n * heads * lora)?;
        need(K, "wuv", wuv.len(), heads * vdim * lora)?;
        if !Self::wuv_quant_takes(lora, vdim) {
            return Err(CudaError::shape(K, format!("lora {lora}, vdim {vdim}: not one 128-group a head")));
        }
        if n == 0 {
            return Ok(());
        }
        self.heads_tc(s, HeadsOut::Fp8 { q, scale }, o_lat, wuv, &wuv_gemm(n, heads, lora, vdim), None)
    }

    /// `out[r][h*vdim + v] = W_UV[h][v] . o_lat[r][h]` (bf16 out), on tensor cores
    /// (`heads_tc`) when the widths allow.
    #[allow(clippy::too_many_arguments)]
    pub fn wuv(
        &self,
        s: &Arc<CudaStream>,
        out: &mut CudaSlice<bf16>,
        o_lat: &CudaSlice<f32>,
        wuv: &CudaSlice<bf16>,
        n: usize,
        heads: usize,
        lora: usize,
        vdim: usize,
    ) -> Result<()> {
        const K: &str = "wuv_f32_obf16";
        need(K, "out", out.len(), n * heads * vdim)?;
        need(K, "o_lat", o_lat.len(), n * heads * lora)?;
        need(K, "wuv", wuv.len(), heads * vdim * lora)?;
        if n == 0 {
            return Ok(());
        }
        if heads_tc_takes(lora, vdim, lora, vdim) {
            let t = wuv_gemm(n, heads, lora, vdim);
            return self.heads_tc(s, HeadsOut::Rows { y: None, yb: out }, o_lat, wuv, &t, None);
        }
        let (hi, li, vi) = (i32_of(K, heads)?, i32_of(K, lora)?, i32_of(K, vdim)?);
        // SAFETY: block (h, r) reads o_lat[(r*heads+h)*lora..][..lora] and
        // wuv[h*vdim*lora..][..vdim*lora], writes out[(r*heads+h)*vdim..][..vdim]; lengths
        // checked; shared memory holds lora floats.
        unsafe {
            s.launch_builder(&self.wuv).arg(out).arg(o_lat).arg(wuv).arg(&hi).arg(&li).arg(&vi).launch(head_cfg(
                heads,
                n,
                128,
                lora * 4,
            ))
        }?;
        Ok(())
    }
}

/// W_UV as a head-wise GEMM: per row and head, the `lora` latent values into `vdim`
/// outputs by `W_UV[h]` (`[vdim][lora]`, k-major).
fn wuv_gemm(n: usize, heads: usize, lora: usize, vdim: usize) -> HeadsTc {
    HeadsTc { m: n, heads, k: lora, n: vdim, x_stride: lora, y_stride: vdim, w_kn: false }
}
