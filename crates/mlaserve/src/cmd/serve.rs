//! `mlaserve serve`: router + one worker group in one process, on the GPU when this build
//! has CUDA and a GPU is present, else on the CPU backend (`--backend` chooses).

use super::backend::{spawn_engine, BackendArgs};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub serve: mlaserve::serve::ServeArgs,
    #[command(flatten)]
    pub backend: BackendArgs,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let model = &a.serve.model;
    anyhow::ensure!(
        model.join("config.json").is_file(),
        "--model {}: no config.json there (a relative path is taken from the working directory {})",
        model.display(),
        std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_default()
    );
    super::runtime()?.block_on(async move {
        let w = a.serve.worker_args();
        let progress = std::sync::Arc::new(mlaserve_model::progress::LoadProgress::new(
            format!("loading {}", w.model.display()),
            0,
        ));
        let engine = spawn_engine(&a.backend, w.model.clone(), &w.engine, progress).await?;
        mlaserve::serve::run_with_engine(a.serve, engine).await?;
        anyhow::Ok(())
    })
}
