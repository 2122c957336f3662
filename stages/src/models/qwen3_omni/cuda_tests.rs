//! The GPU paths against the CPU ones on the fixture checkpoint. Built only with
//! the `cuda` feature and run on the GPU host (docs/gpu.md): CI has no GPU.

use candle_core::{DType, Device, IndexOp, Module, Tensor};

use super::fixtures::{self, max_abs_diff};
use super::layers::{DecoderConfig, SparseMoe};
use super::thinker::{Thinker, ThinkerConfig};
use super::weights;

fn gpu() -> Device {
    Device::new_cuda(0).expect("the cuda build's tests need a CUDA device")
}

fn vb(dtype: DType, dev: &Device) -> candle_nn::VarBuilder<'static> {
    weights::from_checkpoint(&fixtures::dir().join("model"), dtype, dev, None)
        .expect("fixture checkpoint")
}

fn thinker_cfg() -> ThinkerConfig {
    serde_json::from_value(fixtures::config()["thinker_config"].clone()).unwrap()
}

/// The grouped-GEMM MoE (bf16, GPU) equals the per-expert MoE (f32, CPU), for one
/// token (decode) and for several (prefill). (Over thousands of tokens some bf16
/// router scores tie where f32's do not, and a token takes another expert: the
/// long-prefill path is checked against the grouped kernel on the GPU instead,
/// in `layers.rs`.)
#[test]
fn fused_moe_matches_per_expert() {
    let cfg: DecoderConfig = thinker_cfg().text_config;
    let layer = (0..cfg.num_hidden_layers)
        .find(|&i| cfg.is_sparse_layer(i))
        .unwrap();
    let name = format!("thinker.model.layers.{layer}.mlp");
    let cpu = SparseMoe::new(&cfg, vb(DType::F32, &Device::Cpu).pp(&name)).unwrap();
    let dev = gpu();
    let fused = SparseMoe::new(&cfg, vb(DType::BF16, &dev).pp(&name)).unwrap();
    for n in [1usize, 3, 40] {
        let x = Tensor::randn(0f32, 1.0, (n, cfg.hidden_size), &Device::Cpu).unwrap();
        let want = cpu.forward(&x).unwrap();
        let got = fused
            .forward(&x.to_dtype(DType::BF16).unwrap().to_device(&dev).unwrap())
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap();
        let scale = max_abs_diff(&want, &want.zeros_like().unwrap());
        let err = max_abs_diff(&got, &want);
        eprintln!("fused MoE, {n} tokens: max |diff| {err:.2e} (max |value| {scale:.2e})");
        assert!(
            err <= 0.02 * scale + 1e-3,
            "fused MoE differs by {err} at {n} tokens"
        );
    }
}

/// Prefill and batched slot decoding on the GPU equal the CPU's: f32 to 1e-3; bf16
/// (fused MoE) within bf16 rounding.
#[test]
fn thinker_slots_on_gpu_match_cpu() {
    let cfg = thinker_cfg();
    let cpu = Thinker::new(&cfg, vb(DType::F32, &Device::Cpu).pp("thinker")).unwrap();
    let dev = gpu();
    let prompts: Vec<Vec<u32>> = vec![(1..9).collect(), (20..23).collect(), (40..57).collect()];
    for (dtype, tol) in [(DType::F32, 1e-3f32), (DType::BF16, 0.1)] {
        let model = Thinker::new(&cfg, vb(dtype, &dev).pp("thinker")).unwrap();
        let slots = model.new_slots(4, 64).unwrap();
        let (mut ids, mut pos, mut lens) = (vec![], vec![], vec![]);
        let mut want_caches = vec![];
        for (slot, p) in prompts.iter().enumerate() {
            let x = Tensor::from_vec(p.clone(), (1, p.len()), &Device::Cpu).unwrap();
            let mut c = cpu.new_cache();
            let want = cpu.prefill(&x, None, None, &mut c, &[]).unwrap().logits;
            let mut g = model.new_cache();
            let got = model
                .prefill(&x.to_device(&dev).unwrap(), None, None, &mut g, &[])
                .unwrap()
                .logits;
            let err = max_abs_diff(&got.to_device(&Device::Cpu).unwrap(), &want);
            eprintln!(
                "{dtype:?} prefill of {} tokens: max |diff| {err:.2e}",
                p.len()
            );
            assert!(err < tol, "{dtype:?} prefill differs by {err}");
            let (len, next) = model.load_slot(&slots, slot, &g, 0).unwrap();
            ids.push(
                want.i((0, p.len() - 1))
                    .unwrap()
                    .argmax(0)
                    .unwrap()
                    .to_scalar::<u32>()
                    .unwrap(),
            );
            pos.push(next);
            lens.push(len);
            want_caches.push(c);
        }
        for step in 0..8 {
            let out = model.step_slots(&ids, &pos, &lens, &slots, &[]).unwrap();
            let got = out.logits.to_device(&Device::Cpu).unwrap();
            for row in 0..prompts.len() {
                let x = Tensor::from_vec(vec![ids[row]], (1, 1), &Device::Cpu).unwrap();
                let want = cpu
                    .step(&x, &mut want_caches[row], &[])
                    .unwrap()
                    .logits
                    .i((0, 0))
                    .unwrap();
                let err = max_abs_diff(&got.i((row, 0)).unwrap(), &want);
                assert!(
                    err < tol,
                    "{dtype:?} step {step} row {row} differs by {err}"
                );
                ids[row] = want.argmax(0).unwrap().to_scalar::<u32>().unwrap();
                pos[row] += 1;
                lens[row] += 1;
            }
        }
        eprintln!("{dtype:?}: 8 batched decode steps of 3 requests match the CPU");
    }
}
