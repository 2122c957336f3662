//! With the `cuda` feature: compiles the engine's own CUDA kernels
//! (`src/models/qwen3_omni/kernels/*.cu`) to PTX with nvcc (scripts/cuda/build.sh
//! puts it on the PATH), for the compute capability candle's kernels are built
//! for. Without it (CPU builds, CI) there is nothing to do.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    println!("cargo:rerun-if-changed=src/models/qwen3_omni/kernels/bf16.cuh");
    for name in ["moe", "attention", "sampling", "code2wav", "dense"] {
        let src = format!("src/models/qwen3_omni/kernels/{name}.cu");
        println!("cargo:rerun-if-changed={src}");
        let status = std::process::Command::new("nvcc")
            .args(["--ptx", "-O3", &format!("-arch=compute_{cap}"), &src, "-o"])
            .arg(out.join(format!("{name}.ptx")))
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("nvcc failed on {src}: {s}"),
            Err(e) => {
                panic!("nvcc not found ({e}): build the cuda feature with scripts/cuda/build.sh")
            }
        }
    }
}
