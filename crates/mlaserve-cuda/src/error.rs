//! The crate's error type: cudarc's errors wrapped with `#[from]`, plus shape errors
//! raised by the launch wrappers before anything reaches the GPU.

/// Errors of the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A CUDA driver call failed (this includes a kernel fault reported at the next sync).
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("cuBLAS: {0:?}")]
    Cublas(#[from] cudarc::cublas::result::CublasError),
    /// (`NcclError` implements no `std::error::Error`, hence no `#[from]`.)
    #[error("NCCL: {0:?}")]
    Nccl(cudarc::nccl::result::NcclError),
    /// A tensor-parallel collective failed or timed out (the communicator is aborted).
    #[error("collective: {0}")]
    Collective(String),
    /// libcuda could not be loaded: no NVIDIA driver on this machine.
    #[error("no CUDA driver library (libcuda.so) could be loaded; is there a GPU and its driver?")]
    NoDriver,
    /// A wrapper was handed buffers or sizes that do not fit its kernel.
    #[error("{kernel}: {msg}")]
    Shape { kernel: &'static str, msg: String },
}

impl CudaError {
    /// A shape error of `kernel`.
    pub fn shape(kernel: &'static str, msg: impl Into<String>) -> Self {
        CudaError::Shape { kernel, msg: msg.into() }
    }
}

impl From<cudarc::nccl::result::NcclError> for CudaError {
    fn from(e: cudarc::nccl::result::NcclError) -> Self {
        CudaError::Nccl(e)
    }
}

pub type Result<T, E = CudaError> = std::result::Result<T, E>;

impl From<CudaError> for mlaserve_core::Error {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Collective(m) => mlaserve_core::Error::Collective(m),
            e => mlaserve_core::Error::Backend(e.to_string()),
        }
    }
}
