//! `mlaserve-cuda-check`: the GPU machine's one-stop check of the decode kernels.
//!
//! Runs every kernel check against the CPU reference, then (unless `--no-bench`) the
//! decode benchmark sweep beside the copy-bandwidth and cuBLAS ceilings. Exits non-zero
//! if any check fails.
//!
//! Usage: mlaserve-cuda-check [--no-bench] [--no-check] [--quick] [--device N]
//!        [--kernel mma.sync|wgmma-ss|wgmma-t|auto]   (default: checks of every
//!        kernel, bench of auto) [--merge cluster|last-cta|kernel] (how the 64-token kernels
//!        merge split-KV partials; default cluster)
//!        mlaserve-cuda-check --bench-step [--moe-layers N] [--context T] [--batch-invariant] [--device N]
//!        (one decode step at DeepSeek-V3's dimensions, `bench_step::bench_step`)
//!        mlaserve-cuda-check --fp8 [--no-check] [--no-bench] [--quick] [--device N]
//!        (the fp8 GEMMs: checks against the f64 reference, batch invariance, and the
//!        `bench_fp8` sweep at V3's projection shapes, then the grouped fp8 experts'
//!        sweep; `--grouped-only` skips the dense checks and sweep)

use anyhow::{bail, Context, Result};
use mlaserve_cuda::{Gpu, MlaDecode, MlaKernel, SplitMerge};
use mlaserve_cuda_lab::bench::{bench_mla_decode, MlaDecodeBenchOpts};
use mlaserve_cuda_lab::check::{run_decode_case, run_op_checks, standard_cases};
use mlaserve_cuda_lab::util::Util;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |f: &str| args.iter().any(|a| a == f);
    let device = match args.iter().position(|a| a == "--device") {
        Some(i) => args.get(i + 1).context("--device needs a number")?.parse()?,
        None => 0,
    };
    // --kernel NAME: only this tensor-core kernel (mma.sync, wgmma-ss, wgmma-t), so that a
    // run of each in its own process keeps one kernel's fault from hiding the others.
    let only = match args.iter().position(|a| a == "--kernel") {
        Some(i) => Some(args.get(i + 1).context("--kernel needs a name")?.clone()),
        None => None,
    };
    let merge = match args.iter().position(|a| a == "--merge") {
        Some(i) => {
            let name = args.get(i + 1).context("--merge needs a name")?;
            SplitMerge::from_name(name)
                .with_context(|| format!("--merge: unknown merge {name:?} (cluster, last-cta, kernel)"))?
        }
        None => SplitMerge::Cluster,
    };
    if flag("--bench-step") {
        let num = |name: &str, default: usize| -> Result<usize> {
            match args.iter().position(|a| a == name) {
                Some(i) => Ok(args.get(i + 1).context("a number")?.parse()?),
                None => Ok(default),
            }
        };
        let d = mlaserve_cuda_lab::bench_step::StepBenchOpts::default();
        let opts = mlaserve_cuda_lab::bench_step::StepBenchOpts {
            ordinal: device,
            moe_layers: num("--moe-layers", d.moe_layers)?,
            context: num("--context", d.context)?,
            batch_invariant: flag("--batch-invariant"),
            ..d
        };
        let report = mlaserve_cuda_lab::bench_step::bench_step(&opts).context("bench step")?;
        print!("{report}");
        return Ok(());
    }
    let gpu = Gpu::new(device).context("opening the GPU")?;
    if flag("--fp8") {
        let dense = !flag("--grouped-only");
        return fp8(&gpu, !dense || flag("--no-check"), !dense || flag("--no-bench"), flag("--quick"))
            .and(fp8_grouped_bench(&gpu, flag("--no-bench"), flag("--quick")));
    }
    println!(
        "device {device}: {} (sm_{}{}), {} SMs, {} KB shared memory per block (opt-in)",
        gpu.name,
        gpu.compute_capability.0,
        gpu.compute_capability.1,
        gpu.num_sms,
        gpu.max_smem_optin / 1024
    );

    let mut failed = 0;
    if !flag("--no-check") {
        let util = Util::new(&gpu)?;
        let mut mla = MlaDecode::new(&gpu)?;
        mla.set_split_merge(merge);
        println!("== mla_decode vs CPU reference (fresh random inputs, NaN-poisoned outputs and cache padding)");
        let mut total = 0;
        let kernels = if only.as_deref() == Some("auto") { vec![MlaKernel::Auto] } else { mla.available_kernels() };
        for kernel in kernels {
            if only.as_deref().is_some_and(|k| k != kernel.name()) {
                continue;
            }
            mla.set_kernel(kernel)?;
            for (i, case) in standard_cases().iter().enumerate() {
                let r = run_decode_case(&gpu, &mla, &util, case, 1000 + i as u64)
                    .with_context(|| format!("case {} ({})", case.name, kernel.name()))?;
                println!("{r}");
                failed += usize::from(!r.passed());
                total += 1;
            }
        }
        println!("mla_decode checks: {} passed, {failed} failed", total - failed);
        if only.is_none() {
            println!("== small kernels vs CPU reference");
            let reports = run_op_checks(&gpu, 2000)?;
            let bad = reports.iter().filter(|r| !r.passed()).count();
            for r in &reports {
                println!("{r}");
            }
            println!("small kernel checks: {} passed, {bad} failed", reports.len() - bad);
            failed += bad;
        }
    }
    if !flag("--no-bench") {
        let mut opts = MlaDecodeBenchOpts { merges: Some(vec![merge]), ..Default::default() };
        if let Some(k) = &only {
            let mla = MlaDecode::new(&gpu)?;
            let mut all = mla.available_kernels();
            all.push(MlaKernel::Auto);
            let kernel = all.into_iter().find(|x| x.name() == k);
            opts.kernels = Some(vec![kernel.with_context(|| format!("kernel {k} not available here"))?]);
        }
        if flag("--quick") {
            opts.batches = vec![64];
            opts.seq_lens = vec![4096];
            opts.iters = 10;
        }
        println!("== bench mla-decode (bf16 cache 512+64, bf16 out, CUDA events, median of {})", opts.iters);
        let report = bench_mla_decode(&gpu, &opts)?;
        print!("{report}");
    }
    if failed > 0 {
        bail!("{failed} check(s) failed");
    }
    Ok(())
}

/// `--fp8`'s grouped part: the grouped fp8 experts' sweep (`bench_fp8_grouped`), beside
/// the bf16 experts on the same routing (Hopper; elsewhere it says why and skips).
fn fp8_grouped_bench(gpu: &Gpu, no_bench: bool, quick: bool) -> Result<()> {
    if no_bench {
        return Ok(());
    }
    if mlaserve_cuda::fp8_grouped::Fp8Grouped::new(gpu).is_err() {
        println!("== bench grouped fp8 experts: skipped (needs a Hopper GPU)");
        return Ok(());
    }
    let iters = if quick { 5 } else { 10 };
    println!(
        "== bench grouped fp8 experts (256 experts; CUDA graphs of 8 calls, median of {iters} replays; bf16 out; \
         GB/s and %copy on the codes + scales of the experts with rows)"
    );
    print!("{}", mlaserve_cuda_lab::bench_fp8::bench_fp8_grouped(gpu, iters, true)?);
    Ok(())
}

/// `--fp8`: the fp8 checks (act_quant bit-exact, every V3 shape × row count × kernel,
/// batch invariance of the streaming kernel), then the fp8 benchmark sweep.
fn fp8(gpu: &Gpu, no_check: bool, no_bench: bool, quick: bool) -> Result<()> {
    use mlaserve_cuda::fp8::Fp8Gemm;
    use mlaserve_cuda::fp8_plan::Fp8Path;
    use mlaserve_cuda_lab::check_fp8::{self, Fp8Pair};
    println!("device: {} (sm_{}{}), {} SMs", gpu.name, gpu.compute_capability.0, gpu.compute_capability.1, gpu.num_sms);
    let mut failed = 0;
    if !no_check {
        let util = Util::new(gpu)?;
        let fp8 = Fp8Gemm::new(gpu, Fp8Path::Auto)?;
        println!("== fp8 act_quant vs CPU reference (bit-exact)");
        match check_fp8::check_act_quant(gpu, &fp8, 11)? {
            None => println!("act_quant: PASS"),
            Some(e) => {
                println!("act_quant: FAIL {e}");
                failed += 1;
            }
        }
        println!("== fp8 GEMMs vs f64 reference");
        let rows: &[usize] = if quick { &[1, 64, 256] } else { check_fp8::ROWS };
        let reports = check_fp8::run_fp8_checks(gpu, &util, 12, rows)?;
        for r in &reports {
            println!("{r}");
        }
        let bad = reports.iter().filter(|r| !r.passed()).count();
        println!("fp8 GEMM checks: {} passed, {bad} failed", reports.len() - bad);
        failed += bad;
        println!("== fp8 batch invariance (a row alone / in another batch: bit-identical f32)");
        let mut rng = mlaserve_cuda_lab::rng::Rng::new(13);
        let paths = check_fp8::fp8_paths(&fp8);
        for (n, k) in [(576, 7168), (7168, 2048), (3072, 1536)] {
            let w = Fp8Pair::random(gpu, &mut rng, n, k)?;
            for &path in &paths {
                for m in [64, 300] {
                    let bad = check_fp8::run_fp8_invariance(gpu, &util, path, &w, m, 14)?;
                    let required = path.batch_invariant();
                    println!(
                        "invariance {} [{n}, {k}] m={m}: {}{}",
                        path.name(),
                        if bad.is_empty() { "bit-identical".to_string() } else { bad.join("; ") },
                        if required { "" } else { " (not required of this path)" }
                    );
                    if required && !bad.is_empty() {
                        failed += 1;
                    }
                }
            }
        }
    }
    if !no_bench {
        let mut opts = mlaserve_cuda_lab::bench_fp8::Fp8BenchOpts::default();
        if quick {
            opts.rows = vec![1, 64, 4096];
            opts.iters = 10;
        }
        // --rows 256,4096 and --shape NAME (shapes whose name contains it) narrow the sweep.
        let args: Vec<String> = std::env::args().collect();
        let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1));
        if let Some(v) = value("--rows") {
            opts.rows =
                v.split(',').map(|r| r.parse().with_context(|| format!("--rows: {r:?}"))).collect::<Result<_>>()?;
        }
        if let Some(v) = value("--shape") {
            opts.shapes.retain(|(name, _, _)| name.contains(v.as_str()));
        }
        println!(
            "== bench fp8 GEMM (CUDA graphs of one call per weight copy, copies over 256 MB; median of {} replays; \
             bf16 out; quant per call)",
            opts.iters
        );
        print!("{}", mlaserve_cuda_lab::bench_fp8::bench_fp8(gpu, &opts)?);
    }
    if failed > 0 {
        bail!("{failed} fp8 check(s) failed");
    }
    Ok(())
}
