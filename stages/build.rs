//! With the `cuda` feature: compiles the engine's own CUDA kernels to PTX with
//! nvcc (scripts/cuda/build.sh puts it on the PATH), for the compute capability
//! candle's kernels are built for. Without it (CPU builds, CI) there is nothing to do.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let src = "src/models/qwen3_omni/kernels/moe_gemv.cu";
    println!("cargo:rerun-if-changed={src}");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let ptx = out.join("moe_gemv.ptx");
    let status = std::process::Command::new("nvcc")
        .args(["--ptx", "-O3", &format!("-arch=compute_{cap}"), src, "-o"])
        .arg(&ptx)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("nvcc failed on {src}: {s}"),
        Err(e) => panic!("nvcc not found ({e}): build the cuda feature with scripts/cuda/build.sh"),
    }
}
