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

/// The greedy next token after a batch-1 prefill's logits `(1, s, vocab)`.
fn greedy_last(logits: &Tensor) -> u32 {
    let s = logits.dim(1).unwrap();
    logits
        .i((0, s - 1))
        .unwrap()
        .argmax(0)
        .unwrap()
        .to_scalar::<u32>()
        .unwrap()
}

/// Deterministic pseudo-random values in about [-1.7, 1.7], `(n, width)` f32 on the CPU.
fn fixed_input(n: usize, width: usize) -> Tensor {
    let v: Vec<f32> = (0..n * width)
        .map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * 3.4)
        .collect();
    Tensor::from_vec(v, (n, width), &Device::Cpu).unwrap()
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
        // Fixed inputs: with random ones, a bf16 router tie now and then sends a
        // token to another expert than f32 does, which is not what this checks.
        let x = fixed_input(n, cfg.hidden_size);
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
            ids.push(greedy_last(&want));
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

/// Graphed decode steps (bf16: the fused MoE, which captures) equal eager ones on
/// the same inputs, through batch buckets (3 rows padded to 4, then 2) and a
/// key/value bucket boundary (256 positions), and really replay graphs.
#[test]
fn thinker_graphed_steps_match_eager() {
    use super::thinker::ThinkerGraphs;
    let cfg = thinker_cfg();
    let dev = gpu();
    let model = Thinker::new(&cfg, vb(DType::BF16, &dev).pp("thinker")).unwrap();
    let (eager, graphed) = (
        model.new_slots(4, 600).unwrap(),
        model.new_slots(4, 600).unwrap(),
    );
    // The last prompt crosses 256 cached positions during the steps.
    let prompts: Vec<Vec<u32>> = vec![
        (1..9).collect(),
        (20..23).collect(),
        (0..250).map(|i| (i * 7 % 400) as u32).collect(),
    ];
    let (mut ids, mut pos, mut lens) = (vec![], vec![], vec![]);
    for (slot, p) in prompts.iter().enumerate() {
        let x = Tensor::from_vec(p.clone(), (1, p.len()), &dev).unwrap();
        let mut c = model.new_cache();
        let out = model.prefill(&x, None, None, &mut c, &[]).unwrap().logits;
        let (len, next) = model.load_slot(&eager, slot, &c, 0).unwrap();
        model.load_slot(&graphed, slot, &c, 0).unwrap();
        ids.push(greedy_last(&out));
        pos.push(next);
        lens.push(len);
    }
    let mut graphs = ThinkerGraphs::default();
    let mut worst = 0f32;
    for step in 0..12 {
        if step == 8 {
            // The middle request leaves: the last moves into its slot, in both.
            for s in eager.iter().chain(&graphed) {
                s.move_slot(2, 1).unwrap();
            }
            lens.remove(1);
            ids.remove(1);
            pos.remove(1);
        }
        let want = model.step_slots(&ids, &pos, &lens, &eager, &[0]).unwrap();
        let got = model
            .step_slots_graphed(&mut graphs, &ids, &pos, &lens, &graphed, &[0])
            .unwrap();
        let err = max_abs_diff(&got.logits, &want.logits);
        let err_h = max_abs_diff(&got.hidden_states[0], &want.hidden_states[0]);
        assert!(
            err < 0.1 && err_h == 0.0,
            "step {step}: logits {err}, embeddings {err_h}"
        );
        worst = worst.max(err);
        let next: Vec<u32> = want
            .logits
            .squeeze(1)
            .unwrap()
            .argmax(1)
            .unwrap()
            .to_vec1()
            .unwrap();
        let got_next: Vec<u32> = got
            .logits
            .squeeze(1)
            .unwrap()
            .argmax(1)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(next, got_next, "step {step}: greedy tokens differ");
        ids = next;
        pos.iter_mut().for_each(|p| *p += 1);
        lens.iter_mut().for_each(|l| *l += 1);
    }
    // Buckets (4 rows, 256), (4, 512), (2, 512) at least.
    assert!(
        graphs.captured() >= 3,
        "only {} graphs captured",
        graphs.captured()
    );
    eprintln!(
        "graphed Thinker steps: {} graphs, max |logit diff| against eager {worst:.2e}",
        graphs.captured()
    );
}

/// The code predictor's graphed frame draws the same greedy codes as the eager
/// device path, and sampled frames take fresh noise at every replay.
#[test]
fn code_predictor_graphed_frames_match_eager() {
    use super::code_predictor::{CodePredictor, PredictorGraphs};
    use super::sampling::SamplingConfig;
    let tcfg: serde_json::Value = fixtures::config()["talker_config"].clone();
    let cfg = serde_json::from_value(tcfg["code_predictor_config"].clone()).unwrap();
    let dev = gpu();
    let cp = CodePredictor::new(&cfg, vb(DType::BF16, &dev).pp("talker.code_predictor")).unwrap();
    let hidden = cfg.decoder.hidden_size;
    let mut graphs = PredictorGraphs::default();
    for b in [3usize, 1, 3] {
        let h = Tensor::randn(0f32, 1.0, (b, 1, hidden), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let e = Tensor::randn(0f32, 1.0, (b, 1, hidden), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let greedy = SamplingConfig::greedy();
        let want = cp.generate_on_device(&h, &e, &greedy).unwrap();
        let got = cp.generate_graphed(&mut graphs, &h, &e, &greedy).unwrap();
        assert_eq!(got.codes, want.codes, "{b} rows");
        assert_eq!(max_abs_diff(&got.embed_sum, &want.embed_sum), 0.0);
        let hot = SamplingConfig {
            temperature: 2.0,
            ..SamplingConfig::code_predictor()
        };
        let draws: Vec<Vec<Vec<u32>>> = (0..3)
            .map(|_| {
                cp.generate_graphed(&mut graphs, &h, &e, &hot)
                    .unwrap()
                    .codes
            })
            .collect();
        let vocab = cfg.decoder.vocab_size as u32;
        assert!(draws.iter().flatten().flatten().all(|&c| c < vocab));
        assert!(
            draws[0] != draws[1] || draws[1] != draws[2],
            "three sampled frames drew the same codes"
        );
    }
    eprintln!("graphed code predictor: greedy codes equal eager, sampled draws fresh");
}

/// The decode path (the engine's grouped GEMV) against candle's grouped GEMM, both
/// on the GPU in bf16, at every decode batch size a graph is captured at and more.
#[test]
fn moe_gemv_matches_grouped_gemm() {
    let cfg: DecoderConfig = thinker_cfg().text_config;
    let layer = (0..cfg.num_hidden_layers)
        .find(|&i| cfg.is_sparse_layer(i))
        .unwrap();
    let dev = gpu();
    let name = format!("thinker.model.layers.{layer}.mlp");
    let moe = SparseMoe::new(&cfg, vb(DType::BF16, &dev).pp(&name)).unwrap();
    let mut worst = Vec::new();
    for n in [1usize, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64] {
        let x = Tensor::randn(0f32, 1.0, (n, cfg.hidden_size), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let want = moe.forward_grouped(&x, true).unwrap();
        let got = moe.forward_grouped(&x, false).unwrap();
        let scale = max_abs_diff(&want, &want.zeros_like().unwrap());
        let err = max_abs_diff(&got, &want);
        eprintln!(
            "{n} tokens ({} experts, top {}): grouped GEMV vs GEMM {err:.2e} (max |value| {scale:.2e})",
            cfg.num_experts, cfg.num_experts_per_tok
        );
        worst.push((n, err / scale.max(1e-12)));
    }
    let bad: Vec<_> = worst.iter().filter(|(_, r)| *r > 0.02).collect();
    assert!(
        bad.is_empty(),
        "decode config differs at (tokens, relative error) {bad:?}"
    );
}

/// Times the pieces of one released-shape Thinker decode step (run by hand on the
/// GPU host with `--ignored`; docs/bench/gpu.md records what it printed).
#[test]
#[ignore]
fn profile_released_thinker_layer() {
    use super::layers::{DecoderLayer, KvSlots, SlotBatch};
    use std::time::Instant;
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/qwen3_omni_moe_bench/config.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cfg: DecoderConfig =
        serde_json::from_value(v["thinker_config"]["text_config"].clone()).unwrap();
    let dev = gpu();
    let vb = weights::random(DType::BF16, &dev);
    let layer = DecoderLayer::new(&cfg, 0, vb.pp("layer")).unwrap();
    let moe = SparseMoe::new(&cfg, vb.pp("moe")).unwrap();
    let head = candle_nn::linear_no_bias(cfg.hidden_size, cfg.vocab_size, vb.pp("head")).unwrap();
    let time = |what: &str, f: &mut dyn FnMut()| {
        for _ in 0..3 {
            f();
        }
        dev.synchronize().unwrap();
        let t = Instant::now();
        for _ in 0..20 {
            f();
        }
        dev.synchronize().unwrap();
        eprintln!("{what}: {:.1} us", t.elapsed().as_secs_f64() * 1e6 / 20.0);
    };
    let hd = cfg.head_dim();
    for b in [1usize, 8, 32] {
        let x = Tensor::randn(0f32, 1.0, (b, 1, cfg.hidden_size), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let slots = KvSlots::new(b, cfg.num_key_value_heads, 512, hd, DType::BF16, &dev).unwrap();
        let rows: Vec<usize> = (0..b).collect();
        let batch = SlotBatch::new(&slots, &rows, &vec![200; b]).unwrap();
        let cos = Tensor::ones((b, 1, hd / 2), DType::BF16, &dev).unwrap();
        let xs = x.reshape((b, cfg.hidden_size)).unwrap();
        time(
            &format!("b={b} decoder layer (attention + MoE)"),
            &mut || {
                layer.forward_slots(&x, &cos, &cos, &slots, &batch).unwrap();
            },
        );
        time(
            &format!("b={b} MoE, grouped GEMV (decode path)"),
            &mut || {
                moe.forward_grouped(&xs, false).unwrap();
            },
        );
        time(&format!("b={b} MoE, grouped GEMM (candle)"), &mut || {
            moe.forward_grouped(&xs, true).unwrap();
        });
        time(&format!("b={b} lm_head"), &mut || {
            head.forward(&xs).unwrap();
        });
    }
}
