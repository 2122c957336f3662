//! The engine's own CUDA kernels (`kernels/*.cu`, compiled to PTX by `build.rs` in
//! the cuda build) for decode steps, each with the shapes it checks. All of them
//! allocate their outputs on the calling thread's stream and copy nothing to or
//! from the host, so a CUDA graph can capture them.
//!
//! - [`moe_gemv`]: grouped GEMV with candle's `moe_gemm` contract.
//! - [`moe_route`], [`moe_gate_up`], [`moe_down`], [`moe_sum`]: a decode MoE layer
//!   in four launches (router top-k and sort; gate/up with the SwiGLU; down; the
//!   sum over each token's choices); gate/up and down by GEMV or, for prefills,
//!   on the tensor cores ([`Mode`]), whose routing of any number of tokens is
//!   [`moe_route_many`].
//! - [`qk_norm_rope`]: a decode step's q/k norms, rotary embedding and KV-slot
//!   writes in one launch; [`qk_norm_rope_prefill`] the same for a prefill's
//!   tokens, in the attention's layouts.
//! - [`decode_attention`]: one query per row over KV slots, each row's visible
//!   positions only.
//! - [`masked_softmax`]: a prefill's scaled, masked softmax in one pass.
//! - [`argmax`]: each row's first largest logit, so a greedy step copies ids, not
//!   logits, to the host; [`sample_top_k`]: a top-k/top-p draw in one launch.
//! - [`silu_mul`], [`add_rms_norm`]: a dense layer's SwiGLU and its residual add
//!   with the norm after it, one launch each.
//! - [`snake_beta`]: Code2Wav's SnakeBeta activation in one pass (candle's ops
//!   take five); [`causal_conv`]: its convolutions as implicit GEMMs.
//!
//! Without the `cuda` feature each returns an error (the CPU paths never call them).

use candle_core::{Result, Tensor};

/// Whether decode steps use the kernels of this module (on by default);
/// `OMNISTREAM_DECODE_KERNELS=candle` runs candle's ops and the older grouped GEMV
/// instead, for side-by-side measurement (docs/bench/gpu.md).
pub fn enabled() -> bool {
    use std::sync::atomic::Ordering;
    match STATE.load(Ordering::Relaxed) {
        UNSET => {
            let on = std::env::var("OMNISTREAM_DECODE_KERNELS").map_or(true, |v| v != "candle");
            STATE.store(if on { ON } else { OFF }, Ordering::Relaxed);
            on
        }
        s => s == ON,
    }
}

/// Turns the kernels on or off for this process (the GPU tests time both paths).
#[cfg(all(test, feature = "cuda"))]
pub(crate) fn set_enabled(on: bool) {
    STATE.store(
        if on { ON } else { OFF },
        std::sync::atomic::Ordering::Relaxed,
    );
}

/// A kernel variant picked once per process from an environment variable (the
/// variants' figures side by side are in docs/bench/gpu.md), or set by the GPU
/// profile, which times each.
pub struct Variant {
    var: &'static str,
    pub choices: &'static [u32],
    default: u32,
    cell: std::sync::atomic::AtomicU32,
}

impl Variant {
    const fn new(var: &'static str, choices: &'static [u32], default: u32) -> Self {
        Self {
            var,
            choices,
            default,
            cell: std::sync::atomic::AtomicU32::new(Self::UNSET),
        }
    }

    /// Not read yet (no variant is this value; 0 is one).
    const UNSET: u32 = u32::MAX;

    pub fn get(&self) -> u32 {
        use std::sync::atomic::Ordering;
        match self.cell.load(Ordering::Relaxed) {
            Self::UNSET => {
                let v = std::env::var(self.var)
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .filter(|v| self.choices.contains(v))
                    .unwrap_or(self.default);
                self.cell.store(v, Ordering::Relaxed);
                v
            }
            v => v,
        }
    }

    /// Sets the variant for this process; `None`: the default.
    pub fn set(&self, v: Option<u32>) {
        let v = v.unwrap_or(self.default);
        assert!(self.choices.contains(&v), "{}: no variant {v}", self.var);
        self.cell.store(v, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Whether a decode step's dense projections (attention, MLP, heads) of up to
/// [`DENSE_GEMV_MAX_ROWS`] rows go through [`dense_gemv`] (1) or candle's
/// matmul, cuBLAS (0, the default: `OMNISTREAM_DENSE_GEMV`). On an H100 the
/// GEMV tied cuBLAS at one row inside a CUDA graph and was twice as slow at 8
/// (docs/bench/qwen3-tts-gpu.md); kept for the side-by-side of later kernels.
pub static DENSE_GEMV: Variant = Variant::new("OMNISTREAM_DENSE_GEMV", &[0, 1], 0);

/// The most rows [`dense_gemv`] takes (kernels/dense.cu, `GEMV_MAX_ROWS`).
pub const DENSE_GEMV_MAX_ROWS: usize = 8;

/// The widest input [`norm_gemv`] takes: its rows sit in a block's shared
/// memory ([`DENSE_GEMV_MAX_ROWS`] x 2048 bf16, 32 KiB, within the 48 KiB a
/// launch gets without opting in).
pub const NORM_GEMV_MAX_K: usize = 2048;

/// A code predictor step of up to this many rows runs its dense layers fused
/// (`OMNISTREAM_FUSED_DECODE_ROWS`; [`crate::models::qwen3_omni::layers::run_decoder_slots`]):
/// each norm inside the projection after it and each residual add inside the
/// projection before it, through kernels/dense.cu's GEMVs (six launches a
/// layer instead of nine to thirteen). 0 turns it off.
pub static FUSED_DECODE_ROWS: Variant =
    Variant::new("OMNISTREAM_FUSED_DECODE_ROWS", &[0, 1, 2, 4, 8], 0);

/// Whether the Talker's decode steps fuse as the code predictor's do
/// (`OMNISTREAM_FUSED_DECODE_TALKER=1`): off, as the GEMVs read its wider
/// weights slower than cuBLAS (docs/bench/qwen3-tts-gpu.md).
pub static FUSED_DECODE_TALKER: Variant =
    Variant::new("OMNISTREAM_FUSED_DECODE_TALKER", &[0, 1], 0);

/// The register budget of the MoE GEMV launches: the kernels are built for at
/// least 1, 4, 6 or 8 resident blocks a multiprocessor at 4 rows a warp, 1 to 4
/// at 8 (kernels/moe.cu, `MOE_GEMV_KERNELS`); more blocks keep more loads in
/// flight, fewer registers each keep fewer. `OMNISTREAM_MOE_GEMV_BLOCKS` picks;
/// 4, the default, spills nothing at 4 rows.
pub static GEMV_BLOCKS: Variant =
    Variant::new("OMNISTREAM_MOE_GEMV_BLOCKS", &[1, 2, 3, 4, 6, 8], 4);

/// The weight rows a warp of the MoE GEMV streams at once, 4, 8 or 16
/// (`OMNISTREAM_MOE_GEMV_ROWS`; kernels/moe.cu): 8 keeps twice the loads in
/// flight and halves the input loads and reductions per weight byte, taking 4
/// pairs a pass over the weights instead of 8 (`MOE_GEMV_KERNELS`); 16 is the
/// tensor cores' tile (`MOE_MMA_GEMV_KERNELS`, mma.m16n8k16 over 8 pairs a
/// pass, weights straight into the fragments), for widths that are multiples
/// of 32. 16, the default, read the released Thinker's experts at 1, 8 and 32
/// rows in 85%, 87% and 74% of the time 4 took (docs/bench/gpu.md, run 13).
pub static GEMV_ROWS: Variant = Variant::new("OMNISTREAM_MOE_GEMV_ROWS", &[4, 8, 16], 16);

/// The GEMV variants built (kernels/moe.cu, `MOE_GEMV_KERNELS`,
/// `MOE_MMA_GEMV_KERNELS`): (rows a warp, blocks a multiprocessor).
pub const GEMV_BUILT: [(u32, u32); 11] = [
    (4, 1),
    (4, 4),
    (4, 6),
    (4, 8),
    (8, 1),
    (8, 2),
    (8, 3),
    (8, 4),
    (16, 4),
    (16, 6),
    (16, 8),
];

/// The process's GEMV variant for a width of `k`: [`GEMV_ROWS`] and
/// [`GEMV_BLOCKS`], the budget falling back to 4 blocks where that shape has no
/// kernel for it, and the tensor cores' tile to 4 rows where `k` is no multiple
/// of 32.
pub fn gemv_variant(k: usize) -> (u32, u32) {
    let (rows, blocks) = match (GEMV_ROWS.get(), GEMV_BLOCKS.get()) {
        (16, _) if !k.is_multiple_of(32) => (4, 4),
        v => v,
    };
    if GEMV_BUILT.contains(&(rows, blocks)) {
        (rows, blocks)
    } else {
        (rows, 4)
    }
}

/// How [`sample_top_k`] finds a row's candidates where the row has at most 2,048
/// logits and k is at most 64 (`OMNISTREAM_TOPK_MERGE`; kernels/sampling.cu): 1,
/// the default, sorts 64 values a warp in registers and merges the warps' lists
/// (`sample_top_k_fast_f32`); 0 sorts the whole row in shared memory, as wider
/// rows always do. Both draw the same ids from the same uniforms.
pub static TOPK_MERGE: Variant = Variant::new("OMNISTREAM_TOPK_MERGE", &[0, 1], 1);

/// The tensor-core MoE kernels' pipeline depth, 2 or 3 tiles
/// (`OMNISTREAM_MOE_TC_STAGES`; kernels/moe.cu, `MOE_TC_KERNELS`); 3, the
/// default, was 4 to 8% faster on the H200's prefills.
pub static TC_STAGES: Variant = Variant::new("OMNISTREAM_MOE_TC_STAGES", &[2, 3], 3);

const UNSET: u8 = 0;
const ON: u8 = 1;
const OFF: u8 = 2;
static STATE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(UNSET);

/// Whether [`decode_attention`] is built for `heads` query heads over `kv_heads`
/// key/value heads of `head_dim`.
pub fn attention_supported(heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    head_dim == ATTENTION_HEAD_DIM
        && kv_heads > 0
        && heads.is_multiple_of(kv_heads)
        && heads / kv_heads <= ATTENTION_MAX_REP
}

const ATTENTION_HEAD_DIM: usize = 128;
const ATTENTION_MAX_REP: usize = 16;

/// The routing of an MoE step on the device: per pair (token-major, choice in
/// descending order) its weight, the pairs ordered by expert, and the routed
/// ranges (`meta`: count, then expert, first and end pair per range; one range
/// per routed expert from [`moe_route`], ranges of at most [`TC_ROWS`] pairs from
/// [`moe_route_many`]); `ranges` bounds their count (the launches' width).
#[derive(Debug)]
pub struct Routing {
    pub weights: Tensor,
    pub sorted: Tensor,
    pub meta: Tensor,
    pub top_k: usize,
    pub ranges: usize,
    /// The experts it routes among (the weights it meets must have as many).
    pub n_experts: usize,
}

/// The input rows one block of the tensor-core MoE kernels multiplies at once.
pub const TC_ROWS: usize = 64;

/// Whether the tensor-core MoE kernels take experts of `hidden` inputs and
/// outputs and `inter` intermediate width (their tiles' multiples).
pub fn tc_supported(hidden: usize, inter: usize) -> bool {
    hidden.is_multiple_of(TC_BN) && inter.is_multiple_of(TC_BN / 2) && inter.is_multiple_of(TC_BK)
}

const TC_BN: usize = 128;
const TC_BK: usize = 32;

/// Whether [`moe_route`] takes `tokens` tokens of `experts` experts, top `top_k`:
/// one block routes them all, so each is bounded.
pub fn route_supported(tokens: usize, experts: usize, top_k: usize) -> bool {
    (1..=ROUTE_MAX_TOKENS).contains(&tokens) && route_many_supported(experts, top_k)
}

/// Whether [`moe_route_many`] routes among `experts` with `top_k` choices (any
/// number of tokens).
pub fn route_many_supported(experts: usize, top_k: usize) -> bool {
    experts <= ROUTE_MAX_EXPERTS && (1..=ROUTE_MAX_TOPK.min(experts)).contains(&top_k)
}

const ROUTE_MAX_TOKENS: usize = 128;
const ROUTE_MAX_EXPERTS: usize = 256;
const ROUTE_MAX_TOPK: usize = 16;

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
    use candle_core::{DType, Layout, Storage};

    const MOE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/moe.ptx"));
    const ATTENTION_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
    const SAMPLING_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/sampling.ptx"));
    const CODE2WAV_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/code2wav.ptx"));
    const DENSE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/dense.ptx"));
    const DENSE_THREADS: u32 = 256;
    /// Warps a block of the dense GEMV (kernels/dense.cu, `GEMV_WARPS`).
    const GEMV_WARPS: u32 = 4;
    /// Warps a block of the normed GEMV (`NORM_GEMV_WARPS`).
    const NORM_GEMV_WARPS: u32 = 8;
    const ARGMAX_THREADS: u32 = 1024;
    const TC_THREADS: u32 = 256;
    // kernels/code2wav.cu's conv tiles (its block is TC_THREADS too).
    const CV_BM: u32 = 64;
    const CV_BN: u32 = 128;
    const CV_BK: usize = 32;
    // The kernels' tiling (kernels/moe.cu, kernels/attention.cu).
    const WARPS: u32 = 4;
    const ROWS_PER_WARP: u32 = 4;
    const ROUTE_THREADS: u32 = 1024;
    const ROUTE_TOKENS_PER_BLOCK: usize = 8;
    const CHUNK: usize = 64;
    const ATTN_THREADS: u32 = 128;
    const SOFTMAX_THREADS: u32 = 256;
    const SOFTMAX_WARP_ROW: usize = 32 * 16; // kernels/attention.cu, 32 * SM_PER

    /// A view of `t`'s storage from its offset; the guard must outlive it.
    fn view<'a, T: CudaDType>(st: &'a Storage, l: &Layout) -> Result<CudaView<'a, T>> {
        match st {
            Storage::Cuda(c) => Ok(c.as_cuda_slice::<T>()?.slice(l.start_offset()..)),
            _ => candle_core::bail!("a CUDA kernel got a tensor not on a CUDA device"),
        }
    }

    /// `t` contiguous, of `dtype`, at any offset: for kernels that read it one
    /// element at a time.
    fn contiguous_of(t: &Tensor, dtype: DType, what: &str) -> Result<Tensor> {
        if t.dtype() != dtype {
            candle_core::bail!("{what}: {:?}, expected {dtype:?}", t.dtype());
        }
        t.contiguous()
    }

    /// `t` contiguous, of `dtype`, with its first element 16-byte aligned.
    fn checked(t: &Tensor, dtype: DType, what: &str) -> Result<Tensor> {
        let t = contiguous_of(t, dtype, what)?;
        if !(t.layout().start_offset() * dtype.size_in_bytes()).is_multiple_of(16) {
            candle_core::bail!("{what}: unaligned");
        }
        Ok(t)
    }

    fn wrap<T: CudaDType + DeviceRepr>(
        s: CudaSlice<T>,
        dev: &CudaDevice,
        shape: impl Into<candle_core::Shape>,
    ) -> Tensor {
        let st = candle_core::CudaStorage::wrap_cuda_slice(s, dev.clone());
        Tensor::from_storage(
            Storage::Cuda(st),
            shape,
            candle_core::op::BackpropOp::none(),
            false,
        )
    }

    /// `(experts, n, k)` bf16 expert weights and `(rows, k)` bf16 inputs, k a multiple of 8.
    fn expert_shapes(x: &Tensor, w: &Tensor, what: &str) -> Result<(usize, usize, usize)> {
        let (e, n, k) = w.dims3()?;
        let (_, kx) = x.dims2()?;
        if kx != k || !k.is_multiple_of(8) {
            candle_core::bail!(
                "{what}: x {:?} and w {:?}, k a multiple of 8",
                x.dims(),
                w.dims()
            );
        }
        Ok((e, n, k))
    }

    pub fn moe_gemv(
        x: &Tensor,
        w: &Tensor,
        pair_weights: Option<&Tensor>,
        sorted: &Tensor,
        experts: &Tensor,
        topk: usize,
    ) -> Result<Tensor> {
        let (x, w) = (
            checked(x, DType::BF16, "moe_gemv x")?,
            checked(w, DType::BF16, "moe_gemv w")?,
        );
        let (sorted, experts) = (sorted.contiguous()?, experts.contiguous()?);
        let (n_experts, n, k) = expert_shapes(&x, &w, "moe_gemv")?;
        let p = sorted.dim(0)?;
        let dev = x.device().as_cuda_device()?;
        let func = dev.get_or_load_custom_func("moe_gemv_bf16", "omnistream_moe", MOE_PTX)?;
        let out = unsafe { dev.alloc::<half::bf16>(p * n) }?;
        let pw = pair_weights
            .map(|t| t.to_dtype(DType::F32)?.contiguous())
            .transpose()?;
        let (x_st, x_l) = x.storage_and_layout();
        let (w_st, w_l) = w.storage_and_layout();
        let (s_st, s_l) = sorted.storage_and_layout();
        let (e_st, e_l) = experts.storage_and_layout();
        let pw_guard = pw.as_ref().map(|t| t.storage_and_layout());
        let pw_view = match &pw_guard {
            Some((st, l)) => Some(view::<f32>(st, l)?),
            None => None,
        };
        let (xs, ws) = (
            view::<half::bf16>(&x_st, x_l)?,
            view::<half::bf16>(&w_st, w_l)?,
        );
        let (ss, es) = (view::<u32>(&s_st, s_l)?, view::<u32>(&e_st, e_l)?);
        let cfg = LaunchConfig {
            grid_dim: (
                n_experts as u32,
                (n as u32).div_ceil(WARPS * ROWS_PER_WARP),
                1,
            ),
            block_dim: (WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (p_i, n_i, k_i, topk_i) = (p as i32, n as i32, k as i32, topk as i32);
        let null = 0u64;
        let mut b = func.builder();
        b.arg(&xs).arg(&ws).arg(&ss).arg(&es);
        match &pw_view {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
        b.arg(&out).arg(&p_i).arg(&n_i).arg(&k_i).arg(&topk_i);
        // SAFETY: the arguments match the kernel's signature; every index it forms is
        // within the shapes checked above (pairs index rows of x by the contract).
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
        Ok(wrap(out, dev, (p, n)))
    }

    pub fn moe_route(logits: &Tensor, top_k: usize, norm: bool) -> Result<Routing> {
        let logits = checked(logits, DType::BF16, "moe_route logits")?;
        let (n, n_experts) = logits.dims2()?;
        if !route_supported(n, n_experts, top_k) {
            candle_core::bail!(
                "moe_route: {n} tokens of {n_experts} experts, top {top_k} (at most \
                 {ROUTE_MAX_TOKENS} tokens, {ROUTE_MAX_EXPERTS} experts, top {ROUTE_MAX_TOPK})"
            );
        }
        let dev = logits.device().as_cuda_device()?;
        let func = dev.get_or_load_custom_func("moe_route_bf16", "omnistream_moe", MOE_PTX)?;
        let p = n * top_k;
        let weights = unsafe { dev.alloc::<f32>(p) }?;
        let sorted = unsafe { dev.alloc::<u32>(p) }?;
        let meta = unsafe { dev.alloc::<u32>(1 + 3 * n_experts) }?;
        let (l_st, l_l) = logits.storage_and_layout();
        let ls = view::<half::bf16>(&l_st, l_l)?;
        let (n_i, e_i, k_i, norm_i) = (n as i32, n_experts as i32, top_k as i32, norm as i32);
        let mut b = func.builder();
        b.arg(&ls).arg(&weights).arg(&sorted).arg(&meta);
        b.arg(&n_i).arg(&e_i).arg(&k_i).arg(&norm_i);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (ROUTE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: shapes checked above against the kernel's shared-memory limits.
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
        Ok(Routing {
            weights: wrap(weights, dev, p),
            sorted: wrap(sorted, dev, p),
            meta: wrap(meta, dev, 1 + 3 * n_experts),
            top_k,
            // One range per routed expert: at most the pairs, at most the experts.
            ranges: p.min(n_experts),
            n_experts,
        })
    }

    pub fn moe_route_many(logits: &Tensor, top_k: usize, norm: bool) -> Result<Routing> {
        let logits = checked(logits, DType::BF16, "moe_route_many logits")?;
        let (n, n_experts) = logits.dims2()?;
        let p = n * top_k;
        if n == 0 || !route_many_supported(n_experts, top_k) || p > i32::MAX as usize {
            candle_core::bail!(
                "moe_route_many: {n} tokens of {n_experts} experts, top {top_k} (at most \
                 {ROUTE_MAX_EXPERTS} experts, top {ROUTE_MAX_TOPK})"
            );
        }
        let dev = logits.device().as_cuda_device()?;
        let topk = dev.get_or_load_custom_func("moe_topk_bf16", "omnistream_moe", MOE_PTX)?;
        let sort = dev.get_or_load_custom_func("moe_sort_bf16", "omnistream_moe", MOE_PTX)?;
        // One range per TC_ROWS pairs of an expert: at most this many.
        let ranges = p.div_ceil(TC_ROWS) + n_experts;
        let weights = unsafe { dev.alloc::<f32>(p) }?;
        let pair_expert = unsafe { dev.alloc::<u32>(p) }?;
        let rank = unsafe { dev.alloc::<u32>(p) }?;
        let sorted = unsafe { dev.alloc::<u32>(p) }?;
        let meta = unsafe { dev.alloc::<u32>(1 + 3 * ranges) }?;
        let (l_st, l_l) = logits.storage_and_layout();
        let ls = view::<half::bf16>(&l_st, l_l)?;
        let (n_i, e_i, k_i, norm_i) = (n as i32, n_experts as i32, top_k as i32, norm as i32);
        let mut b = topk.builder();
        b.arg(&ls).arg(&weights).arg(&pair_expert);
        b.arg(&n_i).arg(&e_i).arg(&k_i).arg(&norm_i);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(ROUTE_TOKENS_PER_BLOCK) as u32, 1, 1),
            block_dim: (32 * ROUTE_TOKENS_PER_BLOCK as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: a warp per token of the checked shapes.
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
        let (p_i, rows_i) = (p as i32, TC_ROWS as i32);
        let mut b = sort.builder();
        b.arg(&pair_expert).arg(&rank).arg(&sorted).arg(&meta);
        b.arg(&p_i).arg(&e_i).arg(&rows_i);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (ROUTE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every pair's expert is below n_experts (moe_topk keeps them so);
        // meta holds the most ranges the pairs can make.
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
        Ok(Routing {
            weights: wrap(weights, dev, p),
            sorted: wrap(sorted, dev, p),
            meta: wrap(meta, dev, 1 + 3 * ranges),
            top_k,
            ranges,
            n_experts,
        })
    }

    /// The gate/up or down kernel of `mode` over a width of `k` at the process's
    /// variant ([`gemv_variant`], [`TC_STAGES`]), and the GEMV's rows a warp.
    fn moe_kernel(gate_up: bool, mode: Mode, k: usize) -> (String, u32) {
        let what = if gate_up { "gate_up" } else { "down" };
        match mode {
            Mode::Gemv => {
                let (rows, blocks) = gemv_variant(k);
                (format!("moe_{what}_r{rows}_b{blocks}_bf16"), rows)
            }
            Mode::Tensor => match TC_STAGES.get() {
                3 => (format!("moe_{what}_tc_s3_bf16"), 0),
                _ => (format!("moe_{what}_tc_bf16"), 0),
            },
        }
    }

    /// A gate/up or down launch over `r`'s ranges: `gemv_y` block rows down the
    /// output for the GEMV, `tc_y` for the tensor tiles; `r` must route among at
    /// most the weights' `n_experts`.
    fn experts_launch(
        r: &Routing,
        n_experts: usize,
        mode: Mode,
        gemv_y: u32,
        tc_y: usize,
        what: &str,
    ) -> Result<LaunchConfig> {
        if r.n_experts > n_experts {
            candle_core::bail!(
                "{what}: a routing of {} experts for {n_experts}",
                r.n_experts
            );
        }
        let (y, threads) = match mode {
            Mode::Gemv => (gemv_y, WARPS * 32),
            Mode::Tensor => (tc_y as u32, TC_THREADS),
        };
        Ok(LaunchConfig {
            grid_dim: (r.ranges as u32, y, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    pub fn moe_gate_up(x: &Tensor, gate_up: &Tensor, r: &Routing, mode: Mode) -> Result<Tensor> {
        let (x, w) = (
            checked(x, DType::BF16, "moe_gate_up x")?,
            checked(gate_up, DType::BF16, "moe_gate_up w")?,
        );
        let (n_experts, n2, k) = expert_shapes(&x, &w, "moe_gate_up")?;
        let inter = n2 / 2;
        if x.dim(0)? * r.top_k != r.sorted.dim(0)? || !n2.is_multiple_of(2) {
            candle_core::bail!(
                "moe_gate_up: x {:?}, w {:?}, top {}",
                x.dims(),
                w.dims(),
                r.top_k
            );
        }
        if mode == Mode::Tensor && !(inter.is_multiple_of(TC_BN / 2) && k.is_multiple_of(TC_BK)) {
            candle_core::bail!("moe_gate_up: the tensor-core tiles take no width {inter} of {k}");
        }
        let p = r.sorted.dim(0)?;
        let dev = x.device().as_cuda_device()?;
        let (name, rows) = moe_kernel(true, mode, k);
        let func = dev.get_or_load_custom_func(&name, "omnistream_moe", MOE_PTX)?;
        let h = unsafe { dev.alloc::<half::bf16>(p * inter) }?;
        let (x_st, x_l) = x.storage_and_layout();
        let (w_st, w_l) = w.storage_and_layout();
        let (s_st, s_l) = r.sorted.storage_and_layout();
        let (m_st, m_l) = r.meta.storage_and_layout();
        let (xs, ws) = (
            view::<half::bf16>(&x_st, x_l)?,
            view::<half::bf16>(&w_st, w_l)?,
        );
        let (ss, ms) = (view::<u32>(&s_st, s_l)?, view::<u32>(&m_st, m_l)?);
        let (inter_i, k_i, topk_i) = (inter as i32, k as i32, r.top_k as i32);
        let mut b = func.builder();
        b.arg(&xs).arg(&ws).arg(&ss).arg(&ms).arg(&h);
        b.arg(&inter_i).arg(&k_i).arg(&topk_i);
        let gemv_y = (inter as u32).div_ceil(WARPS * rows.max(2) / 2);
        let cfg = experts_launch(
            r,
            n_experts,
            mode,
            gemv_y,
            inter / (TC_BN / 2),
            "moe_gate_up",
        )?;
        // SAFETY: pairs index rows of x (token = pair / top_k < rows); meta's experts
        // are below the weights' expert count (the routing was made for them); the
        // tensor tiles divide the widths (checked above).
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
        Ok(wrap(h, dev, (p, inter)))
    }

    pub fn moe_down(h: &Tensor, down: &Tensor, r: &Routing, mode: Mode) -> Result<Tensor> {
        let (h, w) = (
            checked(h, DType::BF16, "moe_down h")?,
            checked(down, DType::BF16, "moe_down w")?,
        );
        let (n_experts, n, k) = expert_shapes(&h, &w, "moe_down")?;
        let p = r.sorted.dim(0)?;
        if h.dim(0)? != p {
            candle_core::bail!("moe_down: {} rows for {p} pairs", h.dim(0)?);
        }
        if mode == Mode::Tensor && !(n.is_multiple_of(TC_BN) && k.is_multiple_of(TC_BK)) {
            candle_core::bail!("moe_down: the tensor-core tiles take no width {n} of {k}");
        }
        let dev = h.device().as_cuda_device()?;
        let (name, rows) = moe_kernel(false, mode, k);
        let func = dev.get_or_load_custom_func(&name, "omnistream_moe", MOE_PTX)?;
        let out = unsafe { dev.alloc::<half::bf16>(p * n) }?;
        let (h_st, h_l) = h.storage_and_layout();
        let (w_st, w_l) = w.storage_and_layout();
        let (s_st, s_l) = r.sorted.storage_and_layout();
        let (m_st, m_l) = r.meta.storage_and_layout();
        let (pw_st, pw_l) = r.weights.storage_and_layout();
        let (hs, ws) = (
            view::<half::bf16>(&h_st, h_l)?,
            view::<half::bf16>(&w_st, w_l)?,
        );
        let (ss, ms) = (view::<u32>(&s_st, s_l)?, view::<u32>(&m_st, m_l)?);
        let pws = view::<f32>(&pw_st, pw_l)?;
        let (n_i, k_i) = (n as i32, k as i32);
        let mut b = func.builder();
        b.arg(&hs).arg(&ws).arg(&ss).arg(&ms).arg(&pws).arg(&out);
        b.arg(&n_i).arg(&k_i);
        let gemv_y = (n as u32).div_ceil(WARPS * rows.max(1));
        let cfg = experts_launch(r, n_experts, mode, gemv_y, n / TC_BN, "moe_down")?;
        // SAFETY: as for moe_gate_up, with one input row per pair.
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
        Ok(wrap(out, dev, (p, n)))
    }

    pub fn snake_beta(x: &Tensor, alpha: &Tensor, inv_beta: &Tensor) -> Result<Tensor> {
        let x = checked(x, DType::BF16, "snake_beta x")?;
        let (rows, c, len) = x.dims3()?;
        let alpha = checked(&alpha.flatten_all()?, DType::BF16, "snake_beta alpha")?;
        let inv_beta = checked(&inv_beta.flatten_all()?, DType::BF16, "snake_beta beta")?;
        if !len.is_multiple_of(8) || alpha.dim(0)? != c || inv_beta.dim(0)? != c {
            candle_core::bail!(
                "snake_beta: x {:?}, alpha {:?}, beta {:?}, len a multiple of 8",
                x.dims(),
                alpha.dims(),
                inv_beta.dims()
            );
        }
        let total8 = rows * c * len / 8;
        let dev = x.device().as_cuda_device()?;
        let func =
            dev.get_or_load_custom_func("snake_beta_bf16", "omnistream_code2wav", CODE2WAV_PTX)?;
        let out = unsafe { dev.alloc::<half::bf16>(total8 * 8) }?;
        let (x_st, x_l) = x.storage_and_layout();
        let xs = view::<half::bf16>(&x_st, x_l)?;
        let (a_st, a_l) = alpha.storage_and_layout();
        let a = view::<half::bf16>(&a_st, a_l)?;
        let (b_st, b_l) = inv_beta.storage_and_layout();
        let b_ = view::<half::bf16>(&b_st, b_l)?;
        let (c_i, len8, total) = (c as i32, (len / 8) as i32, total8 as i64);
        let mut b = func.builder();
        b.arg(&xs)
            .arg(&a)
            .arg(&b_)
            .arg(&out)
            .arg(&c_i)
            .arg(&len8)
            .arg(&total);
        let cfg = LaunchConfig {
            grid_dim: ((total8 as u32).div_ceil(256).max(1), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the grid-stride loop covers total8 16-byte groups of the checked,
        // aligned, contiguous shapes; alpha and beta hold `c` values each.
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
        Ok(wrap(out, dev, (rows, c, len)))
    }

    pub fn causal_conv(
        x: &Tensor,
        prev: Option<&Tensor>,
        taps_w: &Tensor,
        bias: &Tensor,
        residual: Option<&Tensor>,
        dilation: usize,
    ) -> Result<Tensor> {
        let x = checked(x, DType::BF16, "causal_conv x")?;
        // Without left context the kernel reads none: x stands in for the pointer.
        let prev = match prev {
            Some(p) => checked(p, DType::BF16, "causal_conv prev")?,
            None => x.narrow(2, 0, 0)?,
        };
        let w = checked(taps_w, DType::BF16, "causal_conv weight")?;
        let bias = checked(&bias.flatten_all()?, DType::BF16, "causal_conv bias")?;
        let (b, cin, len) = x.dims3()?;
        let (cout, kdim) = w.dims2()?;
        let (pb, pc, ctx) = prev.dims3()?;
        let taps = kdim / cin.max(1);
        let res = residual
            .map(|r| checked(r, DType::BF16, "causal_conv residual"))
            .transpose()?;
        if !cin.is_multiple_of(CV_BK)
            || taps == 0
            || taps * cin != kdim
            || (pb, pc, ctx) != (b, cin, (taps - 1) * dilation)
            || bias.dim(0)? != cout
            || res.as_ref().is_some_and(|r| r.dims() != [b, cout, len])
            || b == 0
            || len == 0
        {
            candle_core::bail!(
                "causal_conv: x {:?}, prev {:?}, weight {:?}, bias {:?}, dilation {dilation}, \
                 cin a multiple of {CV_BK}",
                x.dims(),
                prev.dims(),
                w.dims(),
                bias.dims()
            );
        }
        let dev = x.device().as_cuda_device()?;
        let func =
            dev.get_or_load_custom_func("causal_conv_bf16", "omnistream_code2wav", CODE2WAV_PTX)?;
        let out = unsafe { dev.alloc::<half::bf16>(b * cout * len) }?;
        let (x_st, x_l) = x.storage_and_layout();
        let xs = view::<half::bf16>(&x_st, x_l)?;
        let (p_st, p_l) = prev.storage_and_layout();
        let ps = view::<half::bf16>(&p_st, p_l)?;
        let (w_st, w_l) = w.storage_and_layout();
        let ws = view::<half::bf16>(&w_st, w_l)?;
        let (b_st, b_l) = bias.storage_and_layout();
        let bs = view::<half::bf16>(&b_st, b_l)?;
        // Without a residual the kernel reads none: x stands in for the pointer.
        let r = res.as_ref().unwrap_or(&x);
        let (r_st, r_l) = r.storage_and_layout();
        let rs = view::<half::bf16>(&r_st, r_l)?;
        let ints = [cin, cout, len, ctx, taps, dilation, res.is_some() as usize];
        let [cin_i, cout_i, len_i, ctx_i, taps_i, dil_i, has_res] = ints.map(|v| v as i32);
        let mut bld = func.builder();
        bld.arg(&xs)
            .arg(&ps)
            .arg(&ws)
            .arg(&bs)
            .arg(&rs)
            .arg(&out)
            .arg(&cin_i)
            .arg(&cout_i)
            .arg(&len_i)
            .arg(&ctx_i)
            .arg(&taps_i)
            .arg(&dil_i)
            .arg(&has_res);
        let cfg = LaunchConfig {
            grid_dim: (
                (len as u32).div_ceil(CV_BN),
                (cout as u32).div_ceil(CV_BM),
                b as u32,
            ),
            block_dim: (TC_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the shapes are checked above: the kernel reads x (b, cin, len), prev
        // (b, cin, ctx) below ctx, the weight rows of cout and the residual only with
        // has_res, all contiguous, and writes out (b, cout, len) within its bounds.
        unsafe { bld.launch(cfg) }.w()?;
        drop(bld);
        Ok(wrap(out, dev, (b, cout, len)))
    }

    pub fn moe_sum(y: &Tensor, top_k: usize) -> Result<Tensor> {
        let y = checked(y, DType::BF16, "moe_sum y")?;
        let (p, n) = y.dims2()?;
        if top_k == 0 || !p.is_multiple_of(top_k) {
            candle_core::bail!("moe_sum: {p} rows for top {top_k}");
        }
        let tokens = p / top_k;
        let dev = y.device().as_cuda_device()?;
        let func = dev.get_or_load_custom_func("moe_sum_bf16", "omnistream_moe", MOE_PTX)?;
        let out = unsafe { dev.alloc::<half::bf16>(tokens * n) }?;
        let (y_st, y_l) = y.storage_and_layout();
        let ys = view::<half::bf16>(&y_st, y_l)?;
        let (n_i, k_i) = (n as i32, top_k as i32);
        let mut b = func.builder();
        b.arg(&ys).arg(&out).arg(&n_i).arg(&k_i);
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(256), tokens as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one thread per output element of the checked shapes.
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
        Ok(wrap(out, dev, (tokens, n)))
    }

    /// `(b, cols)` f32 logits whose rows are contiguous: a narrowed vocabulary keeps
    /// its rows' stride (no copy); other layouts are copied.
    fn f32_rows(logits: &Tensor, what: &str) -> Result<Tensor> {
        if logits.dtype() != DType::F32 {
            candle_core::bail!("{what}: {:?} logits, expected f32", logits.dtype());
        }
        match logits.stride() {
            [_, 1] => Ok(logits.clone()),
            _ => logits.contiguous(),
        }
    }

    pub fn argmax(logits: &Tensor) -> Result<Tensor> {
        let logits = f32_rows(logits, "argmax")?;
        let (b, cols) = logits.dims2()?;
        let stride = logits.stride()[0] as i64;
        let dev = logits.device().as_cuda_device()?;
        if b == 0 || cols == 0 {
            candle_core::bail!("argmax: empty logits {:?}", logits.dims());
        }
        let func =
            dev.get_or_load_custom_func("argmax_f32", "omnistream_sampling", SAMPLING_PTX)?;
        let out = unsafe { dev.alloc::<u32>(b) }?;
        let (l_st, l_l) = logits.storage_and_layout();
        let ls = view::<f32>(&l_st, l_l)?;
        let cols_i = cols as i32;
        let mut bld = func.builder();
        bld.arg(&ls).arg(&out).arg(&cols_i).arg(&stride);
        let cfg = LaunchConfig {
            grid_dim: (b as u32, 1, 1),
            block_dim: (ARGMAX_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one block per row; row r reads [r * stride, r * stride + cols),
        // inside the view by the layout's shape and strides.
        unsafe { bld.launch(cfg) }.w()?;
        drop(bld);
        Ok(wrap(out, dev, b))
    }

    pub fn sample_top_k(
        logits: &Tensor,
        uniform: &Tensor,
        inv_temp: f32,
        top_p: f32,
    ) -> Result<Tensor> {
        let logits = f32_rows(logits, "sample_top_k")?;
        let (b, cols) = logits.dims2()?;
        // A graphed frame's uniforms are views into one (groups, rows, k) tensor,
        // at offsets of `k` floats: read one by one, they need no alignment.
        let u = contiguous_of(uniform, DType::F32, "sample_top_k uniform")?;
        let (ub, k) = u.dims2()?;
        if !top_k_supported(cols, k) || ub != b || b == 0 {
            candle_core::bail!(
                "sample_top_k: logits {:?}, uniform {:?}: at most {TOPK_MAX_COLS} columns, \
                 1 to {} candidates",
                logits.dims(),
                u.dims(),
                TOPK_MAX_COLS.min(cols)
            );
        }
        let stride = logits.stride()[0] as i64;
        let dev = logits.device().as_cuda_device()?;
        let merge = cols <= TOPK_FAST_COLS && k <= TOPK_FAST_K && TOPK_MERGE.get() == 1;
        let name = match merge {
            true => "sample_top_k_fast_f32",
            false => "sample_top_k_f32",
        };
        let func = dev.get_or_load_custom_func(name, "omnistream_sampling", SAMPLING_PTX)?;
        let out = unsafe { dev.alloc::<u32>(b) }?;
        let (l_st, l_l) = logits.storage_and_layout();
        let ls = view::<f32>(&l_st, l_l)?;
        let (u_st, u_l) = u.storage_and_layout();
        let us = view::<f32>(&u_st, u_l)?;
        let [cols_i, n_i, k_i] = [cols, cols.next_power_of_two(), k].map(|v| v as i32);
        let mut bld = func.builder();
        bld.arg(&ls).arg(&stride).arg(&us).arg(&out).arg(&cols_i);
        if !merge {
            bld.arg(&n_i);
        }
        bld.arg(&k_i).arg(&inv_temp).arg(&top_p);
        let cfg = LaunchConfig {
            grid_dim: (b as u32, 1, 1),
            block_dim: (ARGMAX_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one block per row; row r reads [r * stride, r * stride + cols) of the
        // logits and [r * k, (r + 1) * k) of the checked uniforms; n <= TOPK_MAX_COLS
        // fits the sorting kernel's shared arrays, cols <= TOPK_FAST_COLS (32 warps of
        // 64) and k <= 64 the merging one's.
        unsafe { bld.launch(cfg) }.w()?;
        drop(bld);
        Ok(wrap(out, dev, b))
    }

    pub fn masked_softmax(scores: &Tensor, mask: Option<&Tensor>, scale: f64) -> Result<Tensor> {
        let (b, heads, q_len, kv) = scores.dims4()?;
        if let Some(m) = mask {
            if m.dims() != [b, 1, q_len, kv] {
                candle_core::bail!(
                    "masked_softmax: mask {:?} for scores {:?}",
                    m.dims(),
                    scores.dims()
                );
            }
        }
        let scores = checked(scores, DType::BF16, "masked_softmax scores")?;
        let mask = mask
            .map(|m| checked(m, DType::F32, "masked_softmax mask"))
            .transpose()?;
        let dev = scores.device().as_cuda_device()?;
        // Rows of up to 512 scores held in a warp's registers, read once; longer
        // rows take a block and three passes.
        let warp_rows = kv <= SOFTMAX_WARP_ROW;
        let name = match warp_rows {
            true => "masked_softmax_warp_bf16",
            false => "masked_softmax_bf16",
        };
        let func = dev.get_or_load_custom_func(name, "omnistream_attention", ATTENTION_PTX)?;
        let n = scores.elem_count();
        let probs = unsafe { dev.alloc::<half::bf16>(n) }?;
        let (s_st, s_l) = scores.storage_and_layout();
        let ss = view::<half::bf16>(&s_st, s_l)?;
        let m_guard = mask.as_ref().map(|t| t.storage_and_layout());
        let m_view = match &m_guard {
            Some((st, l)) => Some(view::<f32>(st, l)?),
            None => None,
        };
        let (h_i, q_i, kv_i, scale) = (heads as i32, q_len as i32, kv as i32, scale as f32);
        let rows = b * heads * q_len;
        let rows_u = rows as u64;
        let null = 0u64;
        let mut bld = func.builder();
        bld.arg(&ss);
        match &m_view {
            Some(v) => bld.arg(v),
            None => bld.arg(&null),
        };
        bld.arg(&probs);
        if warp_rows {
            bld.arg(&rows_u);
        }
        bld.arg(&h_i).arg(&q_i).arg(&kv_i).arg(&scale);
        let blocks = match warp_rows {
            true => rows.div_ceil(SOFTMAX_THREADS as usize / 32),
            false => rows,
        };
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (SOFTMAX_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: a warp (rows it holds whole) or a block per row of the checked
        // shapes.
        unsafe { bld.launch(cfg) }.w()?;
        drop(bld);
        Ok(wrap(probs, dev, (b, heads, q_len, kv)))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_rope(
        qkv: &Tensor,
        q_norm: &Tensor,
        k_norm: &Tensor,
        eps: f32,
        cos: &Tensor,
        sin: &Tensor,
        scatter: &Tensor,
        k_slots: &Tensor,
        v_slots: &Tensor,
        heads: usize,
        kvh: usize,
    ) -> Result<Tensor> {
        let d = ATTENTION_HEAD_DIM;
        let b = qkv.dim(0)?;
        if scatter.elem_count() != b * kvh * d || scatter.dtype() != DType::U32 {
            candle_core::bail!("qk_norm_rope: scatter {:?} for {b} rows", scatter.dims());
        }
        let scatter = scatter.contiguous()?;
        let (k_slots, v_slots) = (
            checked(k_slots, DType::BF16, "qk_norm_rope k")?,
            checked(v_slots, DType::BF16, "qk_norm_rope v")?,
        );
        if k_slots.dims() != v_slots.dims() || k_slots.dims().last() != Some(&d) {
            candle_core::bail!("qk_norm_rope: slots {:?}", k_slots.dims());
        }
        let norms = (q_norm, k_norm, eps);
        let q = launch_qk_norm_rope(
            qkv,
            norms,
            cos,
            sin,
            Some(&scatter),
            &k_slots,
            &v_slots,
            heads,
            kvh,
            b,
            1,
        )?;
        q.reshape((b, heads, d))
    }

    /// A prefill's queries `(b, heads, s, D)` and keys and values `(b, kvh, s, D)`
    /// from the fused projection `qkv` `(b, s, (heads + 2 * kvh) * D)`, as
    /// [`qk_norm_rope`] makes a decode step's (cos/sin `(b, s, D / 2)`).
    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_rope_prefill(
        qkv: &Tensor,
        q_norm: &Tensor,
        k_norm: &Tensor,
        eps: f32,
        cos: &Tensor,
        sin: &Tensor,
        heads: usize,
        kvh: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let d = ATTENTION_HEAD_DIM;
        let (b, s, _) = qkv.dims3()?;
        let dev = qkv.device().as_cuda_device()?;
        let n = b * kvh * s * d;
        // SAFETY: the kernel writes every element (each (token, kv head) row).
        let (kc, vc) = unsafe { (dev.alloc::<half::bf16>(n)?, dev.alloc::<half::bf16>(n)?) };
        let (k, v) = (wrap(kc, dev, (b, kvh, s, d)), wrap(vc, dev, (b, kvh, s, d)));
        let qkv = qkv.reshape((b * s, ()))?;
        let norms = (q_norm, k_norm, eps);
        let q = launch_qk_norm_rope(&qkv, norms, cos, sin, None, &k, &v, heads, kvh, b, s)?;
        Ok((q.reshape((b, heads, s, d))?, k, v))
    }

    /// [`qk_norm_rope`]'s launch over `b * seq` token rows: keys and values to the
    /// scatter rows of `kc`/`vc`, or without scatter to `(b, kvh, seq, D)` layouts.
    #[allow(clippy::too_many_arguments)]
    fn launch_qk_norm_rope(
        qkv: &Tensor,
        (q_norm, k_norm, eps): (&Tensor, &Tensor, f32),
        cos: &Tensor,
        sin: &Tensor,
        scatter: Option<&Tensor>,
        kc: &Tensor,
        vc: &Tensor,
        heads: usize,
        kvh: usize,
        b: usize,
        seq: usize,
    ) -> Result<Tensor> {
        let d = ATTENTION_HEAD_DIM;
        let rows = b * seq;
        let width = (heads + 2 * kvh) * d;
        let bad = qkv.elem_count() != rows * width
            || q_norm.elem_count() != d
            || k_norm.elem_count() != d
            || cos.elem_count() != rows * d / 2
            || sin.elem_count() != rows * d / 2
            || (scatter.is_none() && kc.elem_count() != rows * kvh * d);
        if bad {
            candle_core::bail!(
                "qk_norm_rope: qkv {:?}, cos {:?}, out {:?}, {heads}/{kvh} heads, {b} x {seq} rows",
                qkv.dims(),
                cos.dims(),
                kc.dims()
            );
        }
        let qkv = checked(qkv, DType::BF16, "qk_norm_rope qkv")?;
        let (qw, kw) = (q_norm.contiguous()?, k_norm.contiguous()?);
        let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
        for t in [&qw, &kw, &cos, &sin] {
            if t.dtype() != DType::BF16 {
                candle_core::bail!("qk_norm_rope: {:?} weights or rotary tables", t.dtype());
            }
        }
        let dev = qkv.device().as_cuda_device()?;
        let func = dev.get_or_load_custom_func(
            "qk_norm_rope_bf16",
            "omnistream_attention",
            ATTENTION_PTX,
        )?;
        let q = unsafe { dev.alloc::<half::bf16>(rows * heads * d) }?;
        let (a_st, a_l) = qkv.storage_and_layout();
        let (qw_st, qw_l) = qw.storage_and_layout();
        let (kw_st, kw_l) = kw.storage_and_layout();
        let (c_st, c_l) = cos.storage_and_layout();
        let (s_st, s_l) = sin.storage_and_layout();
        let sc_guard = scatter.map(|t| t.storage_and_layout());
        let sc_view = match &sc_guard {
            Some((st, l)) => Some(view::<u32>(st, l)?),
            None => None,
        };
        let (k_st, k_l) = kc.storage_and_layout();
        let (v_st, v_l) = vc.storage_and_layout();
        let views = [
            view::<half::bf16>(&a_st, a_l)?,
            view::<half::bf16>(&qw_st, qw_l)?,
            view::<half::bf16>(&kw_st, kw_l)?,
            view::<half::bf16>(&c_st, c_l)?,
            view::<half::bf16>(&s_st, s_l)?,
        ];
        let (ks, vs) = (
            view::<half::bf16>(&k_st, k_l)?,
            view::<half::bf16>(&v_st, v_l)?,
        );
        let (heads_i, kvh_i, seq_i) = (heads as i32, kvh as i32, seq as i32);
        let null = 0u64;
        let mut bld = func.builder();
        for v in &views {
            bld.arg(v);
        }
        match &sc_view {
            Some(v) => bld.arg(v),
            None => bld.arg(&null),
        };
        bld.arg(&q).arg(&ks).arg(&vs);
        bld.arg(&heads_i).arg(&kvh_i).arg(&seq_i).arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, (heads + kvh) as u32, 1),
            block_dim: (d as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: shapes checked above; the scatter rows index the slot tensors
        // (SlotBatch checked them against the slots' shape), or the outputs hold
        // (b, kvh, seq, D).
        unsafe { bld.launch(cfg) }.w()?;
        drop(bld);
        Ok(wrap(q, dev, rows * heads * d))
    }

    pub fn decode_attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        slot_of_row: Option<&Tensor>,
        scale: f64,
    ) -> Result<Tensor> {
        let (n_slots, kvh, max_len, d) = k.dims4()?;
        let (b, heads, d_q) = q.dims3()?;
        let (mb, _, _, kv_len) = mask.dims4()?;
        if !attention_supported(heads, kvh, d)
            || d_q != d
            || v.dims() != k.dims()
            || mb != b
            || kv_len == 0
            || kv_len > max_len
            || (slot_of_row.is_none() && b > n_slots)
        {
            candle_core::bail!(
                "decode_attention: q {:?}, k {:?}, v {:?}, mask {:?}",
                q.dims(),
                k.dims(),
                v.dims(),
                mask.dims()
            );
        }
        let rep = heads / kvh;
        let q = checked(q, DType::BF16, "decode_attention q")?;
        let (k, v) = (
            checked(k, DType::BF16, "decode_attention k")?,
            checked(v, DType::BF16, "decode_attention v")?,
        );
        let mask = checked(mask, DType::F32, "decode_attention mask")?;
        let rows = slot_of_row.map(|t| t.contiguous()).transpose()?;
        if let Some(r) = &rows {
            if r.dims1()? != b || r.dtype() != DType::U32 {
                candle_core::bail!("decode_attention: slots {:?} for {b} rows", r.dims());
            }
        }
        let dev = q.device().as_cuda_device()?;
        let func = dev.get_or_load_custom_func(
            "decode_attention_bf16",
            "omnistream_attention",
            ATTENTION_PTX,
        )?;
        let splits = kv_len.div_ceil(CHUNK);
        let out = unsafe { dev.alloc::<half::bf16>(b * heads * d) }?;
        // One split writes `out` itself; the partials then stay unused (one element).
        let part = if splits > 1 { b * heads * splits } else { 1 };
        let part_o = unsafe { dev.alloc::<f32>(part * d) }?;
        let part_ml = unsafe { dev.alloc::<f32>(part * 2) }?;
        let (q_st, q_l) = q.storage_and_layout();
        let (k_st, k_l) = k.storage_and_layout();
        let (v_st, v_l) = v.storage_and_layout();
        let (m_st, m_l) = mask.storage_and_layout();
        let r_guard = rows.as_ref().map(|t| t.storage_and_layout());
        let r_view = match &r_guard {
            Some((st, l)) => Some(view::<u32>(st, l)?),
            None => None,
        };
        let qs = view::<half::bf16>(&q_st, q_l)?;
        let (ks, vs) = (
            view::<half::bf16>(&k_st, k_l)?,
            view::<half::bf16>(&v_st, v_l)?,
        );
        let ms = view::<f32>(&m_st, m_l)?;
        let (kvh_i, rep_i, len_i, kv_i) = (kvh as i32, rep as i32, max_len as i32, kv_len as i32);
        let scale = scale as f32;
        let null = 0u64;
        let mut bld = func.builder();
        bld.arg(&qs).arg(&ks).arg(&vs).arg(&ms);
        match &r_view {
            Some(r) => bld.arg(r),
            None => bld.arg(&null),
        };
        bld.arg(&out).arg(&part_o).arg(&part_ml);
        bld.arg(&kvh_i)
            .arg(&rep_i)
            .arg(&len_i)
            .arg(&kv_i)
            .arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: ((b * kvh) as u32, splits as u32, 1),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: shapes checked above; rows' slots index the slot tensors (the
        // caller's slot ids are below `n_slots`, as for candle's gather).
        unsafe { bld.launch(cfg) }.w()?;
        drop(bld);
        if splits > 1 {
            let combine = dev.get_or_load_custom_func(
                "decode_attention_combine",
                "omnistream_attention",
                ATTENTION_PTX,
            )?;
            let splits_i = splits as i32;
            let mut bld = combine.builder();
            bld.arg(&part_o).arg(&part_ml).arg(&out).arg(&splits_i);
            let cfg = LaunchConfig {
                grid_dim: ((b * heads) as u32, 1, 1),
                block_dim: (d as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the partials were sized for (b * heads, splits) above.
            unsafe { bld.launch(cfg) }.w()?;
        }
        Ok(wrap(out, dev, (b, heads, d)))
    }

    pub fn silu_mul(gate_up: &Tensor) -> Result<Tensor> {
        let gu = checked(gate_up, DType::BF16, "silu_mul")?;
        let mut dims = gu.dims().to_vec();
        let two_n = dims.last().copied().unwrap_or(0);
        if !two_n.is_multiple_of(16) || two_n == 0 {
            candle_core::bail!("silu_mul: {:?}, last dim a multiple of 16", gu.dims());
        }
        let n = two_n / 2;
        let total8 = gu.elem_count() / 16;
        let dev = gu.device().as_cuda_device()?;
        let func = dev.get_or_load_custom_func("silu_mul_bf16", "omnistream_dense", DENSE_PTX)?;
        let out = unsafe { dev.alloc::<half::bf16>(total8 * 8) }?;
        let (g_st, g_l) = gu.storage_and_layout();
        let gs = view::<half::bf16>(&g_st, g_l)?;
        let (n8, total) = ((n / 8) as i32, total8 as i64);
        let mut b = func.builder();
        b.arg(&gs).arg(&out).arg(&n8).arg(&total);
        let cfg = LaunchConfig {
            grid_dim: ((total8 as u32).div_ceil(DENSE_THREADS).max(1), 1, 1),
            block_dim: (DENSE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the grid-stride loop covers total8 16-byte groups of the checked,
        // aligned, contiguous input, each reading its row's gate and up halves.
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
        if let Some(last) = dims.last_mut() {
            *last = n;
        }
        Ok(wrap(out, dev, dims))
    }

    pub fn dense_gemv(x: &Tensor, w: &Tensor, swiglu: bool) -> Result<Tensor> {
        gemv_launch(x, w, Gemv::Plain(swiglu))
    }

    pub fn dense_gemv_residual(x: &Tensor, w: &Tensor, resid: &Tensor) -> Result<Tensor> {
        gemv_launch(x, w, Gemv::Residual(resid))
    }

    pub fn norm_gemv(
        x: &Tensor,
        norm: &Tensor,
        eps: f32,
        w: &Tensor,
        swiglu: bool,
    ) -> Result<Tensor> {
        gemv_launch(x, w, Gemv::Norm(norm, eps, swiglu))
    }

    /// What a [`gemv_launch`] adds to the projection.
    enum Gemv<'a> {
        /// Nothing; or the SwiGLU (true).
        Plain(bool),
        /// The residual `(m, n)` added after.
        Residual(&'a Tensor),
        /// The RMSNorm of `x` by this weight and eps before; the SwiGLU after (true).
        Norm(&'a Tensor, f32, bool),
    }

    /// kernels/dense.cu's GEMVs: `x` `(m, k)` by `w` `(n, k)` (`(2n, k)` with the SwiGLU).
    fn gemv_launch(x: &Tensor, w: &Tensor, op: Gemv) -> Result<Tensor> {
        let (x, w) = (
            checked(x, DType::BF16, "dense_gemv x")?,
            checked(w, DType::BF16, "dense_gemv w")?,
        );
        let (m, k) = x.dims2()?;
        let (rows, kw) = w.dims2()?;
        let swiglu = matches!(op, Gemv::Plain(true) | Gemv::Norm(_, _, true));
        let n = if swiglu { rows / 2 } else { rows };
        if kw != k
            || !k.is_multiple_of(8)
            || !(1..=DENSE_GEMV_MAX_ROWS).contains(&m)
            || (swiglu && !rows.is_multiple_of(2))
            || n == 0
        {
            candle_core::bail!(
                "dense_gemv: x {:?}, w {:?} (1 to {DENSE_GEMV_MAX_ROWS} rows, k a multiple of 8)",
                x.dims(),
                w.dims()
            );
        }
        let extra = match op {
            Gemv::Residual(r) => {
                let r = checked(r, DType::BF16, "dense_gemv residual")?;
                if r.dims() != [m, n] {
                    candle_core::bail!("dense_gemv: residual {:?} for ({m}, {n})", r.dims());
                }
                Some(r)
            }
            Gemv::Norm(nw, ..) => {
                let nw = checked(nw, DType::BF16, "norm_gemv weight")?;
                if nw.elem_count() != k || k > NORM_GEMV_MAX_K {
                    candle_core::bail!(
                        "norm_gemv: norm weight {:?} for k {k} (at most {NORM_GEMV_MAX_K})",
                        nw.dims()
                    );
                }
                Some(nw)
            }
            Gemv::Plain(_) => None,
        };
        let (name, warps) = match op {
            Gemv::Plain(false) | Gemv::Residual(_) => ("dense_gemv_bf16", GEMV_WARPS),
            Gemv::Plain(true) => ("dense_gate_up_bf16", GEMV_WARPS),
            Gemv::Norm(_, _, false) => ("norm_gemv_bf16", NORM_GEMV_WARPS),
            Gemv::Norm(_, _, true) => ("norm_gate_up_bf16", NORM_GEMV_WARPS),
        };
        let dev = x.device().as_cuda_device()?;
        let func = dev.get_or_load_custom_func(name, "omnistream_dense", DENSE_PTX)?;
        let out = unsafe { dev.alloc::<half::bf16>(m * n) }?;
        let (x_st, x_l) = x.storage_and_layout();
        let (w_st, w_l) = w.storage_and_layout();
        let (xs, ws) = (
            view::<half::bf16>(&x_st, x_l)?,
            view::<half::bf16>(&w_st, w_l)?,
        );
        let guard = extra.as_ref().map(|t| t.storage_and_layout());
        let es = match &guard {
            Some((st, l)) => Some(view::<half::bf16>(st, l)?),
            None => None,
        };
        let (m_i, n_i, k8) = (m as i32, n as i32, (k / 8) as i32);
        let null = 0u64;
        let mut b = func.builder();
        let mut shared = 0u32;
        match (&op, &es) {
            (Gemv::Norm(_, eps, _), Some(nw)) => {
                b.arg(&xs).arg(nw).arg(&ws).arg(&out);
                b.arg(&m_i).arg(&n_i).arg(&k8).arg(eps);
                shared = (m * k * 2) as u32;
            }
            (Gemv::Residual(_), Some(r)) => {
                b.arg(&xs)
                    .arg(&ws)
                    .arg(r)
                    .arg(&out)
                    .arg(&m_i)
                    .arg(&n_i)
                    .arg(&k8);
            }
            (Gemv::Plain(false), _) => {
                b.arg(&xs)
                    .arg(&ws)
                    .arg(&null)
                    .arg(&out)
                    .arg(&m_i)
                    .arg(&n_i)
                    .arg(&k8);
            }
            _ => {
                b.arg(&xs).arg(&ws).arg(&out).arg(&m_i).arg(&n_i).arg(&k8);
            }
        }
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(warps), 1, 1),
            block_dim: (warps * 32, 1, 1),
            shared_mem_bytes: shared,
        };
        // SAFETY: one warp a weight row below n (2n rows with the SwiGLU), m <= the
        // kernel's rows, k a multiple of 8 over checked, aligned, contiguous inputs;
        // the residual is (m, n), the norm weight k long, the shared memory m * k
        // bf16.
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
        Ok(wrap(out, dev, (m, n)))
    }

    pub fn add_rms_norm(
        x: &Tensor,
        h: &Tensor,
        weight: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor)> {
        let x = checked(x, DType::BF16, "add_rms_norm x")?;
        let h = checked(h, DType::BF16, "add_rms_norm h")?;
        let w = checked(weight, DType::BF16, "add_rms_norm weight")?;
        let hidden = x.dims().last().copied().unwrap_or(0);
        if h.dims() != x.dims() || w.elem_count() != hidden || !hidden.is_multiple_of(8) {
            candle_core::bail!(
                "add_rms_norm: x {:?}, h {:?}, weight {:?}, hidden a multiple of 8",
                x.dims(),
                h.dims(),
                w.dims()
            );
        }
        let rows = x.elem_count() / hidden.max(1);
        let dev = x.device().as_cuda_device()?;
        let func =
            dev.get_or_load_custom_func("add_rms_norm_bf16", "omnistream_dense", DENSE_PTX)?;
        let (sum, out) = unsafe {
            (
                dev.alloc::<half::bf16>(rows * hidden)?,
                dev.alloc::<half::bf16>(rows * hidden)?,
            )
        };
        let (x_st, x_l) = x.storage_and_layout();
        let (h_st, h_l) = h.storage_and_layout();
        let (w_st, w_l) = w.storage_and_layout();
        let (xs, hs, ws) = (
            view::<half::bf16>(&x_st, x_l)?,
            view::<half::bf16>(&h_st, h_l)?,
            view::<half::bf16>(&w_st, w_l)?,
        );
        let n8 = (hidden / 8) as i32;
        let mut b = func.builder();
        b.arg(&xs)
            .arg(&hs)
            .arg(&ws)
            .arg(&sum)
            .arg(&out)
            .arg(&n8)
            .arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (rows.max(1) as u32, 1, 1),
            block_dim: (DENSE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: a block per row of `hidden` values of the checked, aligned,
        // contiguous inputs; the weight holds `hidden` values.
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
        let shape = x.dims().to_vec();
        Ok((wrap(sum, dev, shape.clone()), wrap(out, dev, shape)))
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    fn no_cuda<T>() -> Result<T> {
        candle_core::bail!("the engine's CUDA kernels need the cuda build")
    }

    pub fn moe_gemv(
        _x: &Tensor,
        _w: &Tensor,
        _pair_weights: Option<&Tensor>,
        _sorted: &Tensor,
        _experts: &Tensor,
        _topk: usize,
    ) -> Result<Tensor> {
        no_cuda()
    }

    pub fn moe_route(_logits: &Tensor, _top_k: usize, _norm: bool) -> Result<Routing> {
        no_cuda()
    }

    pub fn moe_route_many(_logits: &Tensor, _top_k: usize, _norm: bool) -> Result<Routing> {
        no_cuda()
    }

    pub fn moe_gate_up(_x: &Tensor, _gate_up: &Tensor, _r: &Routing, _m: Mode) -> Result<Tensor> {
        no_cuda()
    }

    pub fn moe_down(_h: &Tensor, _down: &Tensor, _r: &Routing, _m: Mode) -> Result<Tensor> {
        no_cuda()
    }

    pub fn snake_beta(_x: &Tensor, _alpha: &Tensor, _inv_beta: &Tensor) -> Result<Tensor> {
        no_cuda()
    }

    pub fn causal_conv(
        _x: &Tensor,
        _prev: Option<&Tensor>,
        _taps_w: &Tensor,
        _bias: &Tensor,
        _residual: Option<&Tensor>,
        _dilation: usize,
    ) -> Result<Tensor> {
        no_cuda()
    }

    pub fn silu_mul(_gate_up: &Tensor) -> Result<Tensor> {
        no_cuda()
    }

    pub fn dense_gemv(_x: &Tensor, _w: &Tensor, _swiglu: bool) -> Result<Tensor> {
        no_cuda()
    }

    pub fn dense_gemv_residual(_x: &Tensor, _w: &Tensor, _resid: &Tensor) -> Result<Tensor> {
        no_cuda()
    }

    pub fn norm_gemv(
        _x: &Tensor,
        _norm: &Tensor,
        _eps: f32,
        _w: &Tensor,
        _swiglu: bool,
    ) -> Result<Tensor> {
        no_cuda()
    }

    pub fn add_rms_norm(
        _x: &Tensor,
        _h: &Tensor,
        _weight: &Tensor,
        _eps: f32,
    ) -> Result<(Tensor, Tensor)> {
        no_cuda()
    }

    pub fn moe_sum(_y: &Tensor, _top_k: usize) -> Result<Tensor> {
        no_cuda()
    }

    pub fn sample_top_k(
        _logits: &Tensor,
        _uniform: &Tensor,
        _inv_temp: f32,
        _top_p: f32,
    ) -> Result<Tensor> {
        no_cuda()
    }

    pub fn masked_softmax(_scores: &Tensor, _mask: Option<&Tensor>, _scale: f64) -> Result<Tensor> {
        no_cuda()
    }

    pub fn argmax(_logits: &Tensor) -> Result<Tensor> {
        no_cuda()
    }

    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_rope(
        _qkv: &Tensor,
        _q_norm: &Tensor,
        _k_norm: &Tensor,
        _eps: f32,
        _cos: &Tensor,
        _sin: &Tensor,
        _scatter: &Tensor,
        _k_slots: &Tensor,
        _v_slots: &Tensor,
        _heads: usize,
        _kvh: usize,
    ) -> Result<Tensor> {
        no_cuda()
    }

    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_rope_prefill(
        _qkv: &Tensor,
        _q_norm: &Tensor,
        _k_norm: &Tensor,
        _eps: f32,
        _cos: &Tensor,
        _sin: &Tensor,
        _heads: usize,
        _kvh: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        no_cuda()
    }

    pub fn decode_attention(
        _q: &Tensor,
        _k: &Tensor,
        _v: &Tensor,
        _mask: &Tensor,
        _slot_of_row: Option<&Tensor>,
        _scale: f64,
    ) -> Result<Tensor> {
        no_cuda()
    }
}

/// Grouped GEMV with the contract of `candle_nn::moe::moe_gemm`: `x` `(rows, k)`,
/// `w` `(experts, n, k)`, pairs `sorted` by expert with their `experts`; returns
/// `(pairs, n)`. bf16.
pub use imp::moe_gemv;

/// Routes `(n, experts)` bf16 router logits (softmax in f32, top-k, renormalised
/// when `norm`), for the sizes of [`route_supported`].
pub use imp::moe_route;

/// The routing of any number of tokens `(n, experts)` (prefills), as
/// [`moe_route`]'s but in two launches and with ranges of at most [`TC_ROWS`]
/// pairs, for the tensor-core kernels: nothing goes through the host.
pub use imp::moe_route_many;

/// `silu(gate(x)) * up(x)` `(pairs, inter)` for every routed pair, from `x`
/// `(tokens, hidden)` and the stacked `(experts, 2 * inter, hidden)` gate/up weights,
/// by the GEMV (decode steps) or the tensor-core tiles ([`tc_supported`] widths).
pub use imp::moe_gate_up;

/// How [`moe_gate_up`] and [`moe_down`] multiply: the GEMV's warps (decode
/// steps), or the tensor-core tiles (prefills).
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Mode {
    Gemv,
    Tensor,
}

/// Each pair's row of `h` `(pairs, inter)` through its expert's down projection
/// `(experts, hidden, inter)`, times the pair's weight: `(pairs, hidden)`.
pub use imp::moe_down;

/// Each token's routed experts summed: `(tokens * top_k, n)` rows in choice order
/// to `(tokens, n)`, in f32.
pub use imp::moe_sum;

/// A decode step's projection `x` `(m, k)` by `w` `(n, k)`: `(m, n)`, one warp a
/// weight row (kernels/dense.cu), for m up to [`DENSE_GEMV_MAX_ROWS`]; with
/// `swiglu`, `w` is gate rows then up rows `(2n, k)` and the result
/// `silu(gate) * up` `(m, n)`, rounded as [`silu_mul`] after the projection.
/// bf16, k a multiple of 8.
pub use imp::dense_gemv;

/// [`dense_gemv`] plus `resid` `(m, n)`: the projection rounded to bf16, then
/// the sum (as the unfused add after it). A residual block's last projection.
pub use imp::dense_gemv_residual;

/// [`dense_gemv`] (with `swiglu`) of the RMSNorm of `x` `(m, k)` by `norm` `(k)`
/// and `eps`, normed in f32 and rounded once as candle's bf16 `rms_norm`, in one
/// launch: a decode step's projection after a norm. m up to
/// [`DENSE_GEMV_MAX_ROWS`], k a multiple of 8 and at most [`NORM_GEMV_MAX_K`].
pub use imp::norm_gemv;

/// SwiGLU on a fused gate/up projection `(.., 2 * n)` bf16 (gate first, n a
/// multiple of 8): `silu(gate) * up` `(.., n)`, in f32, rounded once.
pub use imp::silu_mul;

/// A residual add and the RMSNorm after it on `(.., hidden)` bf16 (hidden a multiple
/// of 8): `(x + h, rms_norm(x + h) * weight)`, the sum rounded to bf16 as an add
/// does, the norm in f32 rounded once as candle's kernel.
pub use imp::add_rms_norm;

/// Code2Wav's SnakeBeta `x + inv_beta * sin(x * alpha)^2` on `(rows, channels, len)`
/// bf16, len a multiple of 8, with `alpha` and `inv_beta` one value a channel:
/// computed in f32 and rounded once.
pub use imp::snake_beta;

/// A causal convolution of `x` `(b, cin, len)` bf16 after its left context `prev`
/// `(b, cin, (taps - 1) * dilation)` (`None` for one tap), with `taps_w` `(cout, taps * cin)` (tap-major
/// rows) and `bias` `(cout)`, plus `residual` `(b, cout, len)` when given: `(b, cout,
/// len)`, an implicit GEMM on the tensor cores (no stacked copy of the taps), the
/// bias and residual added in f32 and rounded once. cin a multiple of 32.
pub use imp::causal_conv;

/// Prefill attention's probabilities `(b, heads, q, kv)` bf16 from the unscaled
/// scores of the same shape: `softmax(scores * scale + mask)` in f32, the additive
/// `mask` `(b, 1, q, kv)` f32 shared by the heads; rows with every key hidden are zeros.
pub use imp::masked_softmax;

/// Each row's first index of its largest value, `(b,)` u32, from `(b, cols)` f32
/// logits (a narrowed view reads in place): torch.argmax's and the host sampler's
/// choice among ties, which candle's reduction does not promise.
pub use imp::argmax;

/// One draw per row of `logits` `(b, cols)` f32 among its `k` largest (`k` =
/// `uniform`'s width, the row's uniforms `(b, k)`): tempered by `inv_temp`, cut at
/// `top_p` and chosen by Gumbel-max, as `sampling::sample_on_device_with` does it
/// with candle's ops, in one launch; `(b,)` u32. For [`top_k_supported`] shapes.
pub use imp::sample_top_k;

/// Whether [`sample_top_k`] takes rows of `cols` logits and `k` candidates: the
/// row fits its shared-memory sort.
pub fn top_k_supported(cols: usize, k: usize) -> bool {
    (1..=TOPK_MAX_COLS).contains(&cols) && (1..=cols).contains(&k)
}

/// kernels/sampling.cu's widest row for [`sample_top_k`].
const TOPK_MAX_COLS: usize = 4096;
/// The widest row and the most candidates of its merging kernel ([`TOPK_MERGE`]).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const TOPK_FAST_COLS: usize = 2048;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const TOPK_FAST_K: usize = 64;

/// A decode step's queries `(b, heads, 128)` from the fused q/k/v projection `qkv`
/// `(b, (heads + 2 * kv_heads) * 128)`: q_norm/k_norm, the rotary embedding at each
/// row's `cos`/`sin` `(b, 64)`; its keys (normed, rotated) and values go straight
/// into the slots at the batch's `scatter` rows.
pub use imp::qk_norm_rope;

/// A prefill's queries `(b, heads, s, 128)`, keys and values `(b, kv_heads, s, 128)`
/// from the fused projection `qkv` `(b, s, (heads + 2 * kv_heads) * 128)`, normed
/// and rotated as [`qk_norm_rope`] does a decode step's (cos/sin `(b, s, 64)`).
pub use imp::qk_norm_rope_prefill;

/// Attention of `q` `(b, heads, 128)` over keys/values `(slots, kv_heads, max_len, 128)`
/// through the additive `mask` `(b, 1, 1, kv_len)` (row `i` in slot `slot_of_row[i]`,
/// or slot `i`): `(b, heads, 128)`, for the shapes of [`attention_supported`].
pub use imp::decode_attention;

#[cfg(test)]
mod tests {
    use super::Variant;

    /// A variant whose value is 0 stays set (0 once meant "not read yet", so
    /// setting it read the environment's default instead).
    #[test]
    fn a_variant_of_zero_is_kept() {
        static V: Variant = Variant::new("OMNISTREAM_TEST_VARIANT_NEVER_SET", &[0, 1], 1);
        assert_eq!(V.get(), 1);
        V.set(Some(0));
        assert_eq!(V.get(), 0);
        V.set(None);
        assert_eq!(V.get(), 1);
    }
}
