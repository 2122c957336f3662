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

/// Graphed Talker decode steps (replayed on the urgent stream) equal eager ones on
/// the same inputs: rows in scattered slots, padded into scratch slots (3 rows at
/// bucket 4, then 2), across a key/value bucket boundary (at step 3, with 3 rows),
/// so buckets (4, 256), (4, 512), (2, 512); logits and hidden states.
#[test]
fn talker_graphed_steps_match_eager() {
    use super::layers::KvCache;
    use super::talker::{SlotRows, Talker, TalkerConfig, TalkerGraphs};
    let cfg: TalkerConfig =
        serde_json::from_value(fixtures::config()["talker_config"].clone()).unwrap();
    let dev = gpu();
    let talker = Talker::new(&cfg, vb(DType::BF16, &dev).pp("talker")).unwrap();
    let tc = &cfg.text_config;
    let (requests, max_len) = (4usize, 600usize);
    let scratch = TalkerGraphs::scratch_slots(requests);
    let (eager, graphed) = (
        talker.new_slots(requests + scratch, max_len).unwrap(),
        talker.new_slots(requests + scratch, max_len).unwrap(),
    );
    // Random cached keys/values for slots 0..3, the same in both.
    let mut lens = vec![5usize, 248, 9];
    for (slot, &len) in lens.iter().enumerate() {
        for (e, g) in eager.iter().zip(&graphed) {
            let kv = bf16_randn((1, tc.num_key_value_heads, len, tc.head_dim()), &dev);
            let mut c = KvCache::new();
            c.append(&kv, &kv).unwrap();
            e.load(slot, &c, 0, 0).unwrap();
            g.load(slot, &c, 0, 0).unwrap();
        }
    }
    let mut slots = vec![2usize, 0, 1];
    lens.swap(0, 2);
    lens.swap(1, 2);
    let mut pos: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
    let mut graphs = TalkerGraphs::new(requests);
    let mut worst = 0f32;
    for step in 0..10 {
        if step == 6 {
            slots.remove(1);
            lens.remove(1);
            pos.remove(1);
        }
        let b = slots.len();
        let input = bf16_randn((b, 1, tc.hidden_size), &dev);
        let hidden = input.zeros_like().unwrap();
        let rows = SlotRows {
            slots: &slots,
            lens: &lens,
            pos: &pos,
            last_hidden: &hidden,
        };
        let (want_h, want_l) = talker.decode_slots(&eager, &rows, &input, None).unwrap();
        let (got_h, got_l) = talker
            .decode_slots(&graphed, &rows, &input, Some(&mut graphs))
            .unwrap();
        let (err_l, err_h) = (max_abs_diff(&got_l, &want_l), max_abs_diff(&got_h, &want_h));
        assert!(
            err_l < 0.05 && err_h < 0.05,
            "step {step}: logits {err_l}, hidden {err_h}"
        );
        worst = worst.max(err_l.max(err_h));
        pos.iter_mut().for_each(|p| *p += 1);
        lens.iter_mut().for_each(|l| *l += 1);
    }
    assert!(
        graphs.captured() >= 3,
        "only {} graphs captured",
        graphs.captured()
    );
    eprintln!(
        "graphed Talker steps: {} graphs, max |diff| against eager {worst:.2e}",
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
    // Every bucket was captured: a failed one would run eagerly, unseen here
    // (sampled frames of one row did, from the draw's uniforms at odd offsets).
    assert_eq!(
        graphs.failed(),
        0,
        "a code predictor bucket failed to capture"
    );
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

/// The bench config: the released model's shapes (deploy/qwen3_omni_moe_bench).
fn bench_config() -> serde_json::Value {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/qwen3_omni_moe_bench/config.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A released-shape decoder config from the bench config: `thinker` or `talker`.
fn released(which: &str) -> DecoderConfig {
    serde_json::from_value(bench_config()[format!("{which}_config")]["text_config"].clone())
        .unwrap()
}

fn bf16_randn(shape: impl Into<candle_core::Shape>, dev: &Device) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
}

/// The decode MoE kernels at the released Thinker's and Talker's shapes (random
/// bf16): the routing is a true top-k of the router's softmax with the right
/// weights, every pair once, grouped by expert in ascending order; the routed
/// experts' sum equals the same routing computed expert by expert in f32.
#[test]
fn decode_moe_kernels_match_f32_experts() {
    let dev = gpu();
    for which in ["thinker", "talker"] {
        let cfg = released(which);
        let moe = SparseMoe::new(&cfg, weights::random(DType::BF16, &dev).pp("moe")).unwrap();
        let (k, e_count) = (cfg.num_experts_per_tok, cfg.num_experts);
        for n in [1usize, 2, 3, 8, 16, 32, 48, 64] {
            let x = bf16_randn((n, cfg.hidden_size), &dev);
            let (logits, r, got, gate_up, down) = moe.decode_parts(&x).unwrap();
            assert_eq!(r.top_k, k);
            let probs = candle_nn::ops::softmax_last_dim(&logits.to_dtype(DType::F32).unwrap())
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let weights = r.weights.to_vec1::<f32>().unwrap();
            let sorted = r.sorted.to_vec1::<u32>().unwrap();
            let meta = r.meta.to_vec1::<u32>().unwrap();
            // Each pair's expert, from the routed experts' list.
            let mut expert_of = vec![u32::MAX; n * k];
            let mut last = None;
            for a in 0..meta[0] as usize {
                let (e, lo, hi) = (meta[1 + 3 * a], meta[2 + 3 * a], meta[3 + 3 * a]);
                assert!(last.is_none_or(|l| l < e) && (e as usize) < e_count && lo < hi);
                last = Some(e);
                for &p in &sorted[lo as usize..hi as usize] {
                    assert_eq!(expert_of[p as usize], u32::MAX, "pair {p} twice");
                    expert_of[p as usize] = e;
                }
            }
            assert!(expert_of.iter().all(|&e| e != u32::MAX), "a pair unrouted");
            for t in 0..n {
                let chosen: Vec<usize> = (0..k).map(|j| expert_of[t * k + j] as usize).collect();
                let floor = chosen.iter().map(|&e| probs[t][e]).fold(f32::MAX, f32::min);
                let above = (0..e_count)
                    .filter(|e| !chosen.contains(e) && probs[t][*e] > floor)
                    .count();
                assert_eq!(above, 0, "token {t}: not a top-{k}");
                let sum: f32 = chosen.iter().map(|&e| probs[t][e]).sum();
                for (j, &e) in chosen.iter().enumerate() {
                    let want = if cfg.norm_topk_prob {
                        probs[t][e] / sum
                    } else {
                        probs[t][e]
                    };
                    let w = weights[t * k + j];
                    assert!(
                        (w - want).abs() <= 1e-5 * want.max(1e-3),
                        "token {t} weight {w} vs {want}"
                    );
                    if j > 0 {
                        assert!(
                            probs[t][chosen[j - 1]] >= probs[t][e],
                            "token {t}: choices out of order"
                        );
                    }
                }
            }
            // The same routing, expert by expert, in f32.
            let xf = x.to_dtype(DType::F32).unwrap();
            let inter = down.dim(2).unwrap();
            let mut want = Tensor::zeros((n, cfg.hidden_size), DType::F32, &dev).unwrap();
            for p in 0..n * k {
                let t = p / k;
                let e = expert_of[p] as usize;
                let gu = xf
                    .narrow(0, t, 1)
                    .unwrap()
                    .matmul(
                        &gate_up
                            .get(e)
                            .unwrap()
                            .to_dtype(DType::F32)
                            .unwrap()
                            .t()
                            .unwrap(),
                    )
                    .unwrap();
                let g = candle_nn::ops::silu(&gu.narrow(1, 0, inter).unwrap()).unwrap();
                let h = (g * gu.narrow(1, inter, inter).unwrap()).unwrap();
                let y = h
                    .matmul(
                        &down
                            .get(e)
                            .unwrap()
                            .to_dtype(DType::F32)
                            .unwrap()
                            .t()
                            .unwrap(),
                    )
                    .unwrap();
                let y = (y * weights[p] as f64).unwrap();
                want = want
                    .slice_assign(
                        &[t..t + 1, 0..cfg.hidden_size],
                        &(want.narrow(0, t, 1).unwrap() + y).unwrap(),
                    )
                    .unwrap();
            }
            let got = got.to_dtype(DType::F32).unwrap();
            let scale = max_abs_diff(&want, &want.zeros_like().unwrap());
            let err = max_abs_diff(&got, &want);
            eprintln!("{which} decode MoE, {n} tokens ({} experts routed): max |diff| {err:.2e} (max |value| {scale:.2e})", meta[0]);
            assert!(
                err <= 0.02 * scale,
                "{which} decode MoE differs by {err} at {n} tokens"
            );
        }
    }
}

/// The tensor-core MoE kernels against the GEMV (checked against f32 experts in
/// decode_moe_kernels_match_f32_experts) at the released Thinker's and Talker's
/// shapes: the same routing through both, the decode routing up to 128 tokens
/// and the prefill routing past that (bf16 products summed in another order).
/// Every variant (the GEMV's register budgets, the tensor cores' pipeline
/// depths) is checked.
#[test]
fn tensor_core_moe_matches_gemv() {
    use super::kernels::{Mode, GEMV_BLOCKS, GEMV_BUILT, GEMV_ROWS, TC_STAGES};
    let dev = gpu();
    for which in ["thinker", "talker"] {
        let cfg = released(which);
        let moe = SparseMoe::new(&cfg, weights::random(DType::BF16, &dev).pp("moe")).unwrap();
        let check = |what: &str, n: usize, want: &Tensor, got: &Tensor| {
            let scale = max_abs_diff(want, &want.zeros_like().unwrap());
            let err = max_abs_diff(got, want);
            eprintln!(
                "{which} MoE {what}, {n} tokens: max |diff| {err:.2e} (max |value| {scale:.2e})"
            );
            assert!(
                err <= 0.02 * scale,
                "{which} MoE {what} differs by {err} at {n} tokens"
            );
        };
        // The decode routing up to 128 tokens, the prefill routing past that
        // (device_prefill_routing_is_a_sorted_top_k checks it); both are
        // deterministic, so every variant sees the same routing.
        for n in [1usize, 8, 33, 64, 100, 128, 129, 700, 2500] {
            let x = bf16_randn((n, cfg.hidden_size), &dev);
            // The scalar GEMV at 4 rows a warp is the baseline.
            GEMV_ROWS.set(Some(4));
            GEMV_BLOCKS.set(Some(4));
            let gemv = moe.routed_in_mode(&x, Mode::Gemv).unwrap();
            for (rows, blocks) in GEMV_BUILT {
                GEMV_ROWS.set(Some(rows));
                GEMV_BLOCKS.set(Some(blocks));
                let other = moe.routed_in_mode(&x, Mode::Gemv).unwrap();
                if rows == 16 {
                    // The tensor cores' tile sums in its own order.
                    check(
                        &format!("tensor-core GEMV ({blocks} blocks/SM) vs GEMV"),
                        n,
                        &gemv,
                        &other,
                    );
                    continue;
                }
                // The same sums in the same order: equal, whatever the shape
                // and the registers.
                assert_eq!(
                    max_abs_diff(&gemv, &other),
                    0.0,
                    "GEMV, {rows} rows a warp, {blocks} blocks/SM"
                );
            }
            GEMV_ROWS.set(None);
            GEMV_BLOCKS.set(None);
            for &stages in TC_STAGES.choices {
                TC_STAGES.set(Some(stages));
                let tc = moe.routed_in_mode(&x, Mode::Tensor).unwrap();
                check(
                    &format!("tensor cores ({stages} stages) vs GEMV"),
                    n,
                    &gemv,
                    &tc,
                );
            }
            TC_STAGES.set(None);
        }
    }
}

/// The prefill routing on the device (`moe_route_many`) at the released
/// Thinker's and Talker's shapes, 129 to 16,384 tokens, against the router's
/// probabilities computed apart: each token's choices are a top-k in descending
/// order (equal probabilities in either order: bf16 logits tie often), with
/// their renormalised weights; every pair once, ordered by expert and by pair
/// within one, in ranges of at most 64 pairs of one expert.
#[test]
fn device_prefill_routing_is_a_sorted_top_k() {
    use super::kernels::TC_ROWS;
    let dev = gpu();
    for which in ["thinker", "talker"] {
        let cfg = released(which);
        let moe = SparseMoe::new(&cfg, weights::random(DType::BF16, &dev).pp("moe")).unwrap();
        let k = cfg.num_experts_per_tok;
        for n in [129usize, 2500, 16_384] {
            let x = bf16_randn((n, cfg.hidden_size), &dev);
            let (routing, probs) = moe.routing_many_for_test(&x).unwrap();
            let probs: Vec<Vec<f32>> = probs.to_vec2().unwrap();
            let meta: Vec<u32> = routing.meta.to_vec1().unwrap();
            let sorted: Vec<u32> = routing.sorted.to_vec1().unwrap();
            let weights: Vec<f32> = routing.weights.to_vec1().unwrap();
            let ranges = meta[0] as usize;
            assert!(
                ranges <= routing.ranges,
                "{which}: the launch bound holds the ranges"
            );
            // Ranges: consecutive, one expert each, experts ascending, short enough.
            let mut expert_of = vec![u32::MAX; n * k];
            let (mut at, mut last) = (0usize, None);
            for r in meta[1..1 + 3 * ranges].chunks(3) {
                let (e, lo, hi) = (r[0], r[1] as usize, r[2] as usize);
                assert!(
                    lo == at && hi > lo && hi - lo <= TC_ROWS,
                    "{which}: range {r:?}"
                );
                assert!(last.is_none_or(|l| l <= e), "{which}: experts out of order");
                // Within an expert, pairs ascend (also across its ranges).
                let prev = (last == Some(e)).then(|| sorted[lo - 1]);
                let seg = &sorted[lo..hi];
                assert!(
                    seg.windows(2).all(|w| w[0] < w[1]) && prev.is_none_or(|p| p < seg[0]),
                    "{which}: pairs of expert {e} out of order"
                );
                for &p in seg {
                    assert_eq!(expert_of[p as usize], u32::MAX, "{which}: pair {p} twice");
                    expert_of[p as usize] = e;
                }
                (at, last) = (hi, Some(e));
            }
            assert_eq!(at, n * k, "{which}: every pair routed");
            let mut max_w = 0f32;
            for (t, pr) in probs.iter().enumerate() {
                let chosen: Vec<usize> = (0..k).map(|j| expert_of[t * k + j] as usize).collect();
                let floor = chosen.iter().map(|&e| pr[e]).fold(f32::INFINITY, f32::min);
                let above = (0..pr.len())
                    .filter(|e| !chosen.contains(e))
                    .map(|e| pr[e])
                    .fold(0f32, f32::max);
                assert!(above <= floor + 1e-6, "{which}, token {t}: not a top-{k}");
                assert!(
                    chosen.windows(2).all(|w| pr[w[0]] >= pr[w[1]] - 1e-6),
                    "{which}, token {t}: choices not descending"
                );
                let total: f32 = chosen.iter().map(|&e| pr[e]).sum();
                for (j, &e) in chosen.iter().enumerate() {
                    let want = if cfg.norm_topk_prob {
                        pr[e] / total
                    } else {
                        pr[e]
                    };
                    max_w = max_w.max((weights[t * k + j] - want).abs());
                }
            }
            eprintln!("{which} prefill routing, {n} tokens: {ranges} ranges, max |weight diff| {max_w:.2e}");
            assert!(
                max_w <= 1e-5,
                "{which}, {n} tokens: weights differ by {max_w}"
            );
        }
    }
}

/// The argmax kernel chooses as torch and the host sampler do: the first index of
/// the largest value, across threads, warps and a narrowed vocabulary's stride.
#[test]
fn argmax_kernel_takes_the_first_largest() {
    use super::sampling;
    let dev = gpu();
    let (rows, cols, vocab) = (6usize, 152_064usize, 151_643usize);
    let mut v: Vec<f32> = fixed_input(rows, cols)
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let mut plant = |r: usize, c: usize, x: f32| v[r * cols + c] = x;
    // Ties: in one thread's columns, across threads of one warp, across warps.
    plant(0, 5, 9.0);
    plant(0, 5 + 1024, 9.0);
    plant(1, 40, 9.0);
    plant(1, 39, 9.0);
    plant(2, 100_000, 9.0);
    plant(2, 70_001, 9.0);
    // Past the vocabulary: never chosen.
    plant(3, vocab + 3, 99.0);
    plant(3, 17, 9.0);
    for c in 0..cols {
        plant(4, c, f32::NEG_INFINITY);
    }
    plant(5, 150_000, f32::NAN);
    let host = Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap();
    let want: Vec<u32> = (0..rows)
        .map(|r| {
            let row: Vec<f32> = host.i((r, ..vocab)).unwrap().to_vec1().unwrap();
            sampling::argmax(&row)
        })
        .collect();
    let on_gpu = host.to_device(&dev).unwrap().narrow(1, 0, vocab).unwrap();
    let got: Vec<u32> = sampling::argmax_rows(&on_gpu).unwrap().to_vec1().unwrap();
    assert_eq!(&want[..4], &[5, 39, 70_001, 17]);
    assert_eq!(want[4], 0);
    assert_eq!(got, want, "device argmax vs host");
}

/// A prefill's attention through the engine's kernels (one q/k/v projection,
/// norms + rotary in one launch, grouped heads without repeated keys, the
/// one-pass softmax) against candle's ops, at the released Thinker's and
/// Talker's heads: left padding, a second chunk over the first one's cache, and
/// rows of 57 and 700 keys (the warp's and the block's softmax).
#[test]
fn prefill_attention_kernels_match_candle_ops() {
    use super::kernels;
    use super::layers::{attention_mask, Attention, KvCache};
    let dev = gpu();
    for which in ["thinker", "talker"] {
        let cfg = released(which);
        let attn = Attention::new(&cfg, weights::random(DType::BF16, &dev).pp("attn")).unwrap();
        let hd = cfg.head_dim();
        for (b, first, second) in [(3usize, 37usize, 20usize), (1, 600, 100)] {
            let mut caches = [KvCache::new(), KvCache::new()];
            let mut past = 0;
            for s in [first, second] {
                let x = bf16_randn((b, s, cfg.hidden_size), &dev);
                let rot = || {
                    Tensor::rand(-1f32, 1.0, (b, s, hd / 2), &dev)
                        .unwrap()
                        .to_dtype(DType::BF16)
                        .unwrap()
                };
                let (cos, sin) = (rot(), rot());
                let kv = past + s;
                // Row 0 left-padded by 5 positions: its first queries see no key.
                let pad: Vec<f32> = (0..b * kv).map(|i| if i < 5 { 0.0 } else { 1.0 }).collect();
                let pad = Tensor::from_vec(pad, (b, kv), &dev).unwrap();
                let mask = attention_mask(Some(&pad), b, s, kv, &dev).unwrap();
                let mut outs = Vec::new();
                for (on, cache) in [true, false].into_iter().zip(caches.iter_mut()) {
                    kernels::set_enabled(on);
                    let out = attn
                        .forward(&x, &cos, &sin, mask.as_ref(), Some(cache))
                        .unwrap();
                    outs.push(out.to_dtype(DType::F32).unwrap());
                }
                kernels::set_enabled(true);
                let err = max_abs_diff(&outs[0], &outs[1]);
                let scale = max_abs_diff(&outs[1], &outs[1].zeros_like().unwrap());
                eprintln!(
                    "{which} prefill attention, {b} x {s} after {past}: max |diff| {err:.2e} (max |value| {scale:.2e})"
                );
                assert!(
                    err <= 2e-2 * scale,
                    "{which} prefill attention differs by {err}"
                );
                past = kv;
            }
        }
    }
}

/// The decode attention kernel against the same attention in f32 through candle,
/// at the Thinker's, Talker's and code predictor's head groupings: rows in
/// scattered slots and in slots `0..b`, lengths from 1 to eleven chunks (some rows' chunks
/// wholly hidden).
#[test]
fn decode_attention_kernel_matches_f32() {
    use super::kernels;
    use super::layers::MASK_MIN;
    let dev = gpu();
    let (d, n_slots, max_len) = (128usize, 6usize, 1024usize);
    for (heads, kvh) in [(32usize, 4usize), (16, 2), (16, 8)] {
        let k = bf16_randn((n_slots, kvh, max_len, d), &dev);
        let v = bf16_randn((n_slots, kvh, max_len, d), &dev);
        for (slots, lens) in [
            (vec![3u32, 0, 5, 1], vec![10usize, 300, 700, 0]),
            (vec![0, 1, 2], vec![255, 256, 5]),
            (vec![0], vec![0]),
        ] {
            let b = slots.len();
            let kv_len = lens.iter().max().unwrap() + 1;
            let mask: Vec<f32> = lens
                .iter()
                .flat_map(|&l| (0..kv_len).map(move |j| if j <= l { 0.0 } else { MASK_MIN }))
                .collect();
            let mask = Tensor::from_vec(mask, (b, 1, 1, kv_len), &dev).unwrap();
            let q = bf16_randn((b, heads, d), &dev);
            let identity = slots.iter().enumerate().all(|(i, &s)| i as u32 == s);
            let ids = Tensor::from_vec(slots.clone(), b, &dev).unwrap();
            let scale = (d as f64).powf(-0.5);
            let got =
                kernels::decode_attention(&q, &k, &v, &mask, (!identity).then_some(&ids), scale)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap();
            let rep = heads / kvh;
            let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let kk = f(&k
                .index_select(&ids, 0)
                .unwrap()
                .narrow(2, 0, kv_len)
                .unwrap());
            let vv = f(&v
                .index_select(&ids, 0)
                .unwrap()
                .narrow(2, 0, kv_len)
                .unwrap());
            let qq = f(&q).reshape((b, kvh, rep, d)).unwrap();
            let scores = (qq.matmul(&kk.t().unwrap()).unwrap() * scale).unwrap();
            let probs =
                candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask).unwrap()).unwrap();
            let want = probs.matmul(&vv).unwrap().reshape((b, heads, d)).unwrap();
            let err = max_abs_diff(&got, &want);
            let scale_v = max_abs_diff(&want, &want.zeros_like().unwrap());
            eprintln!("attention {heads}/{kvh} heads, lens {lens:?}: max |diff| {err:.2e} (max |value| {scale_v:.2e})");
            assert!(err <= 1e-2 * scale_v.max(0.1), "attention differs by {err}");
        }
    }
}

/// Gumbel-max draws on the GPU follow softmax(l / t) (as on the CPU, in
/// sampling.rs), and over a full vocabulary a dominant logit always wins: no
/// uniform draw of exactly 1.0 turns into infinite noise.
#[test]
fn gumbel_max_on_gpu_follows_the_tempered_softmax() {
    use super::sampling::gumbel_max_rows;
    let dev = gpu();
    let l = [1.0f32, 0.0, -1.0, 2.0];
    let rows = 40_000;
    let logits = Tensor::from_vec(l.repeat(rows), (rows, 4), &dev).unwrap();
    let ids = gumbel_max_rows(&logits, &vec![0.7; rows])
        .unwrap()
        .to_vec1::<u32>()
        .unwrap();
    let z: f32 = l.iter().map(|x| (x / 0.7).exp()).sum();
    for (k, x) in l.iter().enumerate() {
        let want = (x / 0.7).exp() / z;
        let got = ids.iter().filter(|&&i| i == k as u32).count() as f32 / rows as f32;
        assert!((got - want).abs() < 0.01, "id {k}: {got} vs {want}");
    }
    let (b, vocab) = (64usize, 151_936usize);
    let mut wide = vec![0f32; b * vocab];
    for r in 0..b {
        wide[r * vocab + 7] = 40.0;
    }
    let wide = Tensor::from_vec(wide, (b, vocab), &dev).unwrap();
    for _ in 0..8 {
        let ids = gumbel_max_rows(&wide, &vec![1.0; b])
            .unwrap()
            .to_vec1::<u32>()
            .unwrap();
        assert!(ids.iter().all(|&i| i == 7), "{ids:?}");
    }
}

/// The one-launch top-k/top-p draw against the same draw in candle's ops, on the
/// same logits and uniforms: the code predictor's config and others (no top-p,
/// a low temperature, every column a candidate, a width no power of two): the
/// same ids but for rows where rounding moves a candidate across the top-p line
/// or swaps two near-equal scores (counted, at most 1 in 100), each among its
/// row's k largest. Rows wider than the kernel's sort are refused.
#[test]
fn top_k_kernel_matches_ops() {
    use super::kernels;
    use super::sampling::{sample_with_ops, SamplingConfig};
    let dev = gpu();
    let rows = 512;
    for (cols, top_k, top_p, t) in [
        (2048usize, 50usize, 0.8f32, 1.0f32),
        (2048, 50, 1.0, 0.7),
        (2048, 2048, 0.9, 1.0),
        (3000, 100, 0.95, 1.3),
        (64, 1, 1.0, 1.0),
    ] {
        let cfg = SamplingConfig {
            top_k,
            top_p,
            temperature: t,
            ..SamplingConfig::code_predictor()
        };
        let logits = (Tensor::randn(0f32, 1.0, (rows, cols), &dev).unwrap() * 2.0).unwrap();
        let u = Tensor::rand(1e-20f32, 1.0, (rows, top_k), &dev).unwrap();
        let got = kernels::sample_top_k(&logits, &u, 1.0 / t, top_p)
            .unwrap()
            .to_vec1::<u32>()
            .unwrap();
        let want = sample_with_ops(&logits, &cfg, &u)
            .unwrap()
            .to_vec1::<u32>()
            .unwrap();
        let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        let host = logits.to_vec2::<f32>().unwrap();
        for (row, &id) in host.iter().zip(&got) {
            let mut sorted = row.clone();
            sorted.sort_unstable_by(|a, b| b.total_cmp(a));
            assert!(
                row[id as usize] >= sorted[top_k - 1],
                "id {id} not in the top {top_k}"
            );
        }
        eprintln!(
            "sample_top_k {rows}x{cols} top_k {top_k} top_p {top_p} t {t}: {differ} of {rows} \
             rows differ from candle's ops"
        );
        assert!(differ * 100 <= rows, "{differ} rows differ");
    }
    // A graphed frame hands each code group its uniforms as a view into one
    // (groups, rows, k) tensor: with one row of 50, an odd group starts 200
    // bytes in. Such a view draws as the same values at offset 0 do.
    let logits = Tensor::randn(0f32, 1.0, (1, 2048), &dev).unwrap();
    let noise = Tensor::rand(1e-20f32, 1.0, (3, 1, 50), &dev).unwrap();
    let draw = |u: &Tensor| {
        kernels::sample_top_k(&logits, u, 1.0, 0.8)
            .unwrap()
            .to_vec1::<u32>()
            .unwrap()
    };
    for g in 0..3 {
        let view = noise.get(g).unwrap();
        let fresh = Tensor::new(view.to_vec2::<f32>().unwrap(), &dev).unwrap();
        assert_eq!(draw(&view), draw(&fresh), "group {g}");
    }
    let wide = Tensor::zeros((1, 5000), DType::F32, &dev).unwrap();
    let u = Tensor::ones((1, 50), DType::F32, &dev).unwrap();
    assert!(kernels::sample_top_k(&wide, &u, 1.0, 1.0).is_err());
}

/// The top-k draw's two ways to find the candidates (the warps' merged lists and
/// the whole row sorted, [`kernels::TOPK_MERGE`]) draw the same ids from the same
/// uniforms: rows with ties (integer logits), NaNs, widths no warp divides, every
/// k up to 64; then each one's time a draw at the code predictor's 32 x 2048,
/// top 50, in a graph of a frame's 15 draws.
#[test]
fn top_k_merge_draws_as_the_full_sort() {
    use super::kernels::{self, TOPK_MERGE};
    use std::time::Instant;
    let dev = gpu();
    let rows = 256;
    for (cols, k, top_p) in [
        (2048usize, 50usize, 0.8f32),
        (2048, 64, 1.0),
        (1000, 7, 0.9),
        (64, 64, 1.0),
        (33, 1, 1.0),
    ] {
        let logits = (Tensor::randn(0f32, 1.0, (rows, cols), &dev).unwrap() * 2.0)
            .unwrap()
            .round()
            .unwrap();
        // A NaN in every row (column 3, or the last): never a candidate.
        let nan_col = 3.min(cols - 1);
        let nan = Tensor::full(f32::NAN, (rows, 1), &dev).unwrap();
        let logits = logits
            .slice_assign(&[0..rows, nan_col..nan_col + 1], &nan)
            .unwrap();
        let u = Tensor::rand(1e-20f32, 1.0, (rows, k), &dev).unwrap();
        let draw = |merge: u32| {
            TOPK_MERGE.set(Some(merge));
            kernels::sample_top_k(&logits, &u, 1.3, top_p)
                .unwrap()
                .to_vec1::<u32>()
                .unwrap()
        };
        let (merged, sorted) = (draw(1), draw(0));
        assert_eq!(merged, sorted, "{cols} columns, top {k}");
        assert!(merged
            .iter()
            .all(|&id| (id as usize) < cols && id as usize != nan_col));
    }
    // Timed as a graph of 15 draws (a frame's), so the GPU's time is measured,
    // not the launches'.
    let logits = Tensor::randn(0f32, 1.0, (32, 2048), &dev).unwrap();
    let u = Tensor::rand(1e-20f32, 1.0, (32, 50), &dev).unwrap();
    let mut us = Vec::new();
    for merge in [0u32, 1] {
        TOPK_MERGE.set(Some(merge));
        // The draws' outputs are dropped inside: the graph allocates and frees them.
        let graph = super::graphs::StepGraph::capture(&dev, || {
            for _ in 0..15 {
                kernels::sample_top_k(&logits, &u, 1.0, 0.8)?;
            }
            Ok(())
        })
        .unwrap();
        for _ in 0..3 {
            graph.launch().unwrap();
        }
        dev.synchronize().unwrap();
        let t = Instant::now();
        for _ in 0..20 {
            graph.launch().unwrap();
        }
        dev.synchronize().unwrap();
        us.push(t.elapsed().as_secs_f64() * 1e6 / (20.0 * 15.0));
    }
    TOPK_MERGE.set(None);
    eprintln!(
        "sample_top_k 32x2048 top 50, graphed, a draw: whole row sorted {:.1} us, warps merged {:.1} us",
        us[0], us[1]
    );
}

/// The dense layer's fused kernels against f32 on the same bf16 inputs: SwiGLU on
/// the stacked gate/up projection and the residual add with its RMSNorm, within
/// one rounding to bf16 (the add's sum exactly as candle's bf16 add); shapes the
/// kernels do not take are refused.
#[test]
fn dense_kernels_match_f32() {
    use super::kernels;
    let dev = gpu();
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    for (rows, n) in [(1usize, 3072usize), (32, 3072), (7, 24)] {
        let gu = (bf16_randn((rows, 1, 2 * n), &dev) * 3.0).unwrap();
        let got = f(&kernels::silu_mul(&gu).unwrap());
        assert_eq!(got.dims(), &[rows, 1, n]);
        let g = f(&gu.narrow(2, 0, n).unwrap());
        let u = f(&gu.narrow(2, n, n).unwrap());
        let want = (candle_nn::ops::silu(&g).unwrap() * u).unwrap();
        let scale = (want.abs().unwrap() + 1e-3).unwrap();
        let rel = max_abs_diff(&(&got / &scale).unwrap(), &(&want / &scale).unwrap());
        eprintln!("silu_mul {rows}x{n}: max rel err {rel:.2e}");
        assert!(rel <= 2f32.powi(-8), "silu_mul off by {rel}");
    }
    for (rows, hidden) in [(1usize, 1024usize), (32, 2048), (5, 8)] {
        let x = (bf16_randn((rows, 1, hidden), &dev) * 4.0).unwrap();
        let h = bf16_randn((rows, 1, hidden), &dev);
        let w = bf16_randn(hidden, &dev);
        let (sum, normed) = kernels::add_rms_norm(&x, &h, &w, 1e-6).unwrap();
        assert_eq!(max_abs_diff(&sum, &(&x + &h).unwrap()), 0.0, "the sum");
        let s = f(&sum);
        let want = candle_nn::ops::rms_norm(&s, &f(&w), 1e-6).unwrap();
        let scale = (want.abs().unwrap() + 1e-3).unwrap();
        let rel = max_abs_diff(&(&f(&normed) / &scale).unwrap(), &(&want / &scale).unwrap());
        eprintln!("add_rms_norm {rows}x{hidden}: max rel err {rel:.2e}");
        assert!(rel <= 2f32.powi(-8), "add_rms_norm off by {rel}");
    }
    let odd = bf16_randn((2, 12), &dev);
    assert!(kernels::silu_mul(&odd).is_err());
    assert!(kernels::add_rms_norm(&odd, &odd, &bf16_randn(12, &dev), 1e-6).is_err());
}

/// The fused SnakeBeta kernel against the activation in f32 on the same bf16
/// inputs: within one rounding to bf16 (candle's five bf16 ops, printed beside,
/// round five times); lengths not a multiple of 8 are refused.
#[test]
fn snake_beta_kernel_matches_f32() {
    use super::kernels;
    let dev = gpu();
    for (rows, c, len) in [(3usize, 96usize, 7680usize), (2, 1536, 16), (1, 7, 8)] {
        let x = (bf16_randn((rows, c, len), &dev) * 3.0).unwrap();
        let alpha = bf16_randn((1, c, 1), &dev)
            .affine(0.3, 0.0)
            .unwrap()
            .exp()
            .unwrap();
        let inv_beta = (bf16_randn((1, c, 1), &dev)
            .affine(0.3, 0.0)
            .unwrap()
            .exp()
            .unwrap()
            + 1e-9)
            .unwrap()
            .recip()
            .unwrap();
        let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let snake = |x: &Tensor, a: &Tensor, b: &Tensor| {
            let s = x.broadcast_mul(a).unwrap().sin().unwrap().sqr().unwrap();
            (x + s.broadcast_mul(b).unwrap()).unwrap()
        };
        let want = snake(&f(&x), &f(&alpha), &f(&inv_beta));
        let got = f(&kernels::snake_beta(&x, &alpha, &inv_beta).unwrap());
        let ops = f(&snake(&x, &alpha, &inv_beta));
        // Relative to each value (|want| + 1e-3): one bf16 rounding is at most 2^-9.
        let scale = (want.abs().unwrap() + 1e-3).unwrap();
        let rel = |t: &Tensor| max_abs_diff(&(t / &scale).unwrap(), &(&want / &scale).unwrap());
        let (k, o) = (rel(&got), rel(&ops));
        eprintln!(
            "snake_beta {rows}x{c}x{len}: kernel max rel err {k:.2e}, candle's bf16 ops {o:.2e}"
        );
        assert!(k <= 2f32.powi(-8), "kernel off by {k}");
    }
    let odd = bf16_randn((1, 4, 12), &dev);
    let a = bf16_randn((1, 4, 1), &dev);
    let err = kernels::snake_beta(&odd, &a, &a).unwrap_err();
    assert!(err.to_string().contains("multiple of 8"), "{err}");
}

/// The implicit-GEMM causal conv kernel against candle's conv1d in f32 on the same
/// bf16 inputs (the left context concatenated, the bias and residual added): within
/// about one bf16 rounding of the largest output, at Code2Wav's shapes (k=7 at
/// dilations 1, 3 and 9 with left context, longer and shorter than the chunk; a
/// first chunk's zero context; k=1 with the residual; one output channel; a
/// length no tile divides). candle's bf16 conv1d with its own bias and residual
/// adds is printed beside. Input channels not a multiple of 32 are refused.
#[test]
fn causal_conv_kernel_matches_f32() {
    use super::kernels;
    let dev = gpu();
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    // (batch, cin, cout, len, taps, dilation, residual)
    let cases = [
        (3usize, 96usize, 96usize, 7680usize, 7usize, 9usize, true),
        (2, 768, 768, 128, 7, 1, false),
        (2, 384, 384, 20, 7, 9, false),
        (2, 192, 192, 640, 7, 3, false),
        (2, 1024, 1536, 17, 7, 1, false),
        (4, 192, 192, 640, 1, 1, true),
        (2, 96, 1, 100, 7, 1, false),
    ];
    for (b, cin, cout, len, taps, dil, with_res) in cases {
        let ctx = (taps - 1) * dil;
        let x = bf16_randn((b, cin, len), &dev);
        let prev = (ctx > 0).then(|| bf16_randn((b, cin, ctx), &dev));
        let w = (bf16_randn((cout, taps * cin), &dev) / ((taps * cin) as f64).sqrt()).unwrap();
        let bias = bf16_randn(cout, &dev);
        let res = with_res.then(|| bf16_randn((b, cout, len), &dev));
        let got =
            f(&kernels::causal_conv(&x, prev.as_ref(), &w, &bias, res.as_ref(), dil).unwrap());
        let conv =
            |x: &Tensor, prev: Option<&Tensor>, w: &Tensor, bias: &Tensor, res: Option<&Tensor>| {
                let xx = match prev {
                    Some(p) => Tensor::cat(&[p, x], 2).unwrap(),
                    None => x.clone(),
                };
                let w = w
                    .reshape((cout, taps, cin))
                    .unwrap()
                    .permute((0, 2, 1))
                    .unwrap()
                    .contiguous()
                    .unwrap();
                let y = xx
                    .conv1d(&w, 0, 1, dil, 1)
                    .unwrap()
                    .broadcast_add(&bias.reshape((1, cout, 1)).unwrap())
                    .unwrap();
                match res {
                    Some(r) => (y + r).unwrap(),
                    None => y,
                }
            };
        let want = conv(
            &f(&x),
            prev.as_ref().map(f).as_ref(),
            &f(&w),
            &f(&bias),
            res.as_ref().map(f).as_ref(),
        );
        let ops = f(&conv(&x, prev.as_ref(), &w, &bias, res.as_ref()));
        let top = max_abs_diff(&want, &want.zeros_like().unwrap());
        let (k, o) = (
            max_abs_diff(&got, &want) / top,
            max_abs_diff(&ops, &want) / top,
        );
        eprintln!(
            "causal_conv {b}x{cin}->{cout}x{len} k{taps} d{dil}{}: kernel max err {k:.2e} of the largest output, candle's bf16 conv1d {o:.2e}",
            if with_res { " + residual" } else { "" }
        );
        assert!(k <= 2f32.powi(-8), "kernel off by {k}");
    }
    let odd = bf16_randn((1, 40, 16), &dev);
    let w = bf16_randn((8, 40), &dev);
    let err = kernels::causal_conv(&odd, None, &w, &bf16_randn(8, &dev), None, 1).unwrap_err();
    assert!(err.to_string().contains("multiple of 32"), "{err}");
}

/// The dense GEMV (kernels/dense.cu) against candle's matmul (cuBLAS) at the
/// Qwen3-TTS Talker's and code predictor's decode shapes, 1 to 8 rows, and its
/// SwiGLU against `silu_mul` of the matmul: within a bf16 rounding or two of
/// the largest output (the sums run in another order); 9 rows are refused.
#[test]
fn dense_gemv_matches_matmul() {
    use super::kernels;
    let dev = gpu();
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let mut worst = 0f32;
    for (n, k) in [
        (1024, 1024),
        (4096, 1024),
        (1024, 3072),
        (2048, 2048),
        (4096, 2048),
        (2048, 6144),
        (3072, 1024),
        (1000, 1032),
    ] {
        let w = bf16_randn((n, k), &dev);
        for m in [1usize, 2, 3, 8] {
            let x = bf16_randn((m, k), &dev);
            let want = x.matmul(&w.t().unwrap()).unwrap();
            let got = kernels::dense_gemv(&x, &w, false).unwrap();
            assert_eq!(got.dims(), &[m, n]);
            let scale = max_abs_diff(&f(&want), &f(&want).zeros_like().unwrap());
            let e = max_abs_diff(&f(&got), &f(&want)) / scale;
            assert!(e < 2e-2, "{m} rows of {n} x {k}: {e}");
            worst = worst.max(e);
            // silu_mul takes gate/up widths of multiples of 16.
            if n.is_multiple_of(16) {
                let want = kernels::silu_mul(&want).unwrap();
                let got = kernels::dense_gemv(&x, &w, true).unwrap();
                assert_eq!(got.dims(), &[m, n / 2]);
                let scale = max_abs_diff(&f(&want), &f(&want).zeros_like().unwrap());
                let e = max_abs_diff(&f(&got), &f(&want)) / scale;
                assert!(e < 2e-2, "{m} rows of {n} x {k}, SwiGLU: {e}");
                worst = worst.max(e);
            }
        }
    }
    eprintln!("dense GEMV vs matmul: max |diff| {worst:.2e} of the largest output");
    let nine = bf16_randn((9, 1024), &dev);
    let w = bf16_randn((1024, 1024), &dev);
    assert!(kernels::dense_gemv(&nine, &w, false).is_err());
}

/// The fused decode step (`run_decoder_slots` with `FUSED_DECODE_ROWS`: norms in
/// the projections after them, residual adds in the ones before) against the
/// unfused one, at the Qwen3-TTS 1.7B shapes (random bf16, 200 cached positions):
/// the Talker's decode (28 layers) at 1, 2, 4 and 8 rows and its code
/// predictor's greedy frame (5 layers, 15 steps) at 1 and 2 rows. First the
/// kernels alone against candle's ops; then the hidden states and logits within
/// a few bf16 roundings of their scale (the GEMVs sum in another order than
/// cuBLAS; a wrong norm, residual or row would be off by the scale itself), and
/// the frame's codes the same until a draw's logits tie within that rounding.
#[test]
fn fused_decode_step_matches_unfused() {
    use super::kernels;
    use super::sampling::SamplingConfig;
    use super::talker::SlotRows;
    use crate::models::qwen3_tts::config::Qwen3TtsConfig;
    use crate::models::qwen3_tts::talker::Qwen3TtsTalker;
    let dev = gpu();
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let rel = |got: &Tensor, want: &Tensor| {
        let scale = max_abs_diff(&f(want), &f(want).zeros_like().unwrap());
        max_abs_diff(&f(got), &f(want)) / scale
    };
    // The kernels alone: the normed GEMV (plain and SwiGLU) and the residual one.
    for (n, k) in [(4096usize, 1024usize), (4096, 2048), (2048, 6144)] {
        let w = bf16_randn((n, k), &dev);
        let nw = (bf16_randn(k, &dev) * 0.1)
            .unwrap()
            .affine(1.0, 1.0)
            .unwrap();
        let nw = nw.to_dtype(DType::BF16).unwrap();
        for m in [1usize, 2, 8] {
            let x = bf16_randn((m, k), &dev);
            let normed = candle_nn::ops::rms_norm(&x, &nw, 1e-6).unwrap();
            let want = normed.matmul(&w.t().unwrap()).unwrap();
            if k <= kernels::NORM_GEMV_MAX_K {
                let got = kernels::norm_gemv(&x, &nw, 1e-6, &w, false).unwrap();
                assert!(rel(&got, &want) < 2e-2, "norm_gemv {m} x {k} -> {n}");
                let got = kernels::norm_gemv(&x, &nw, 1e-6, &w, true).unwrap();
                let want = kernels::silu_mul(&want).unwrap();
                assert!(rel(&got, &want) < 2e-2, "norm_gemv SwiGLU {m} x {k} -> {n}");
            }
            let r = bf16_randn((m, n), &dev);
            let want = (x.matmul(&w.t().unwrap()).unwrap() + &r).unwrap();
            let got = kernels::dense_gemv_residual(&x, &w, &r).unwrap();
            assert!(
                rel(&got, &want) < 2e-2,
                "dense_gemv_residual {m} x {k} -> {n}"
            );
        }
    }

    let dir = tts_bench_dir("1.7b-customvoice");
    let cfg = Qwen3TtsConfig::load(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let talker = Qwen3TtsTalker::new(&cfg, weights::random(DType::BF16, &dev)).unwrap();
    let talker = talker.talker();
    let tc = cfg.talker();
    let tc = &tc.text_config;
    let cached = 200usize;
    let slots = talker_slots(talker, tc, 8, 8, cached);
    let both = |run: &mut dyn FnMut() -> Vec<Tensor>| {
        kernels::FUSED_DECODE_ROWS.set(Some(0));
        let want = run();
        kernels::FUSED_DECODE_ROWS.set(Some(8));
        kernels::FUSED_DECODE_TALKER.set(Some(1));
        let got = run();
        kernels::FUSED_DECODE_ROWS.set(None);
        kernels::FUSED_DECODE_TALKER.set(None);
        (want, got)
    };
    let mut worst = 0f32;
    for b in [1usize, 2, 4, 8] {
        let ids: Vec<usize> = (0..b).collect();
        let (lens, pos) = (vec![cached; b], vec![cached as u32; b]);
        let hidden = bf16_randn((b, 1, tc.hidden_size), &dev);
        let rows = SlotRows {
            slots: &ids,
            lens: &lens,
            pos: &pos,
            last_hidden: &hidden,
        };
        // Both write the same position's keys and values: the second overwrites.
        let (want, got) = both(&mut || {
            let (h, logits) = talker.decode_slots(&slots, &rows, &hidden, None).unwrap();
            vec![h, logits]
        });
        // 28 layers of random weights: their roundings add up to a few percent.
        for (w, g) in want.iter().zip(&got) {
            let e = rel(g, w);
            assert!(e < 8e-2, "Talker decode, {b} rows: {e}");
            worst = worst.max(e);
        }
    }
    eprintln!("fused Talker decode vs unfused: max |diff| {worst:.2e} of the largest value");
    let cp = talker.code_predictor();
    let greedy = SamplingConfig::greedy();
    let mut worst = 0f32;
    for b in [1usize, 2] {
        let (ph, e0) = (
            bf16_randn((b, 1, tc.hidden_size), &dev),
            bf16_randn((b, 1, tc.hidden_size), &dev),
        );
        let mut frames = Vec::new();
        both(&mut || {
            frames.push(cp.generate_on_device(&ph, &e0, &greedy).unwrap());
            Vec::new()
        });
        let (want, got) = (&frames[0], &frames[1]);
        // Compared up to the first code the two paths drew differently.
        let same = (0..want.logits.len())
            .take_while(|&g| (0..b).all(|r| want.codes[r][g] == got.codes[r][g]))
            .count();
        for g in 0..(same + 1).min(want.logits.len()) {
            let e = rel(&got.logits[g], &want.logits[g]);
            assert!(e < 5e-2, "code predictor, {b} rows, code {}: {e}", g + 1);
            worst = worst.max(e);
        }
        eprintln!("code predictor, {b} rows: the first {same} of 15 codes the same");
        assert!(
            same >= 1,
            "the first code differs: {:?} / {:?}",
            want.codes,
            got.codes
        );
    }
    eprintln!("fused code predictor vs unfused: max |diff| {worst:.2e} of the largest logit");
}

/// Code2Wav at the released shapes with random bf16 weights on `dev`.
fn released_code2wav(dev: &Device) -> super::code2wav::Code2Wav {
    use super::code2wav::{Code2Wav, Code2WavConfig};
    let cfg: Code2WavConfig =
        serde_json::from_value(bench_config()["code2wav_config"].clone()).unwrap();
    Code2Wav::new(&cfg, weights::random(DType::BF16, dev)).unwrap()
}

/// Code2Wav's graphed steps (released shapes, random bf16) match its eager ones:
/// two sets of slots with the same streams, one stepped eagerly and one through
/// graphs, over chunks of 4 frames past and inside the attention window, with 3
/// rows (a bucket of 4: one padding row on the scratch slot), then 2 of them,
/// then new streams' first chunks in the same slots; the graphs captured before
/// any stream (`warm_up_graphs`). Within bf16 rounding of a different GEMM batch (a state in the wrong slot
/// would differ by the signal itself); the figure is printed.
#[test]
fn code2wav_graphed_steps_match_eager() {
    use super::code2wav::Code2WavGraphs;
    let dev = gpu();
    let c2w = released_code2wav(&dev);
    let codes = |b: usize, n: usize, seed: usize| {
        let v: Vec<u32> = (0..b * 16 * n)
            .map(|i| ((i * 7919 + seed * 104_729) % 2048) as u32)
            .collect();
        Tensor::from_vec(v, (b, 16, n), &Device::Cpu).unwrap()
    };
    let (mut eager, mut graphed) = (c2w.new_slots(4), c2w.new_slots(4));
    let mut graphs = Code2WavGraphs::default();
    // Before any stream: buckets 1, 2 and 4, first chunks of 1 frame and chunks of 4.
    let n = c2w
        .warm_up_graphs(&mut graphed, &mut graphs, 4, &[(1, true), (4, false)])
        .unwrap();
    assert_eq!(n, 6);
    let ids = [2usize, 0, 3];
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let first = codes(3, 1, 0);
    let a = c2w.step_slots(&mut eager, &ids, &first).unwrap();
    let b = c2w
        .step_slots_graphed(&mut graphed, &mut graphs, &ids, &first)
        .unwrap();
    let scale = max_abs_diff(&f(&a), &f(&a).zeros_like().unwrap());
    let mut worst = max_abs_diff(&f(&a), &f(&b)) / scale;
    for step in 0..24 {
        let rows: &[usize] = if step < 20 { &ids } else { &ids[1..] };
        let chunk = codes(rows.len(), 4, step + 1);
        let a = c2w.step_slots(&mut eager, rows, &chunk).unwrap();
        let b = c2w
            .step_slots_graphed(&mut graphed, &mut graphs, rows, &chunk)
            .unwrap();
        assert_eq!(a.dims(), b.dims());
        let d = max_abs_diff(&f(&a), &f(&b));
        let scale = max_abs_diff(&f(&a), &f(&a).zeros_like().unwrap());
        assert!(scale > 1e-3, "step {step}: silent output");
        worst = worst.max(d / scale);
        for &s in rows {
            assert_eq!(eager.frames(s), graphed.frames(s));
        }
    }
    // New streams in the same slots: their first chunks graphed too (the slots
    // exist now), then two more.
    for s in ids {
        eager.reset(s);
        graphed.reset(s);
    }
    for step in 0..3 {
        let chunk = codes(3, if step == 0 { 1 } else { 4 }, 100 + step);
        let a = c2w.step_slots(&mut eager, &ids, &chunk).unwrap();
        let b = c2w
            .step_slots_graphed(&mut graphed, &mut graphs, &ids, &chunk)
            .unwrap();
        let scale = max_abs_diff(&f(&a), &f(&a).zeros_like().unwrap());
        worst = worst.max(max_abs_diff(&f(&a), &f(&b)) / scale);
    }
    eprintln!("code2wav graphed vs eager, 27 chunks: max |diff| {worst:.2e} of the signal's max");
    assert!(
        worst <= 0.1,
        "graphed steps differ by {worst} of the signal"
    );
}

/// A released Qwen3-TTS variant's folder of deploy/qwen3_tts_released/bench:
/// from the repository root (as the GPU scripts run the tests), else where the
/// binary was built.
fn tts_bench_dir(variant: &str) -> std::path::PathBuf {
    let bench = std::path::Path::new("deploy/qwen3_tts_released/bench");
    match bench.is_dir() {
        true => bench.to_path_buf(),
        false => std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/qwen3_tts_released/bench"),
    }
    .join(variant)
}

/// Qwen3-TTS's decoder at the released shapes (random bf16): two streams seeded
/// with a 5 s clip through the captured steps (the transformer over the clip,
/// the convolutions over its last frames) continue as two seeded by one eager
/// pass of the whole clip through the whole decoder, over four chunks after the
/// seed. Within bf16 rounding of a different GEMM batch; the figure is printed.
#[test]
fn tts_code2wav_seed_matches_eager() {
    use super::code2wav::{Code2Wav, Code2WavGraphs};
    use crate::models::qwen3_tts::config::SpeechTokenizerConfig;
    let dir = tts_bench_dir("1.7b-base");
    let cfg =
        SpeechTokenizerConfig::load(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let dev = gpu();
    let c2w = Code2Wav::new(
        &cfg.decoder_config,
        weights::random(DType::BF16, &dev).pp("decoder"),
    )
    .unwrap();
    let codes = |b: usize, n: usize, seed: usize| {
        let v: Vec<u32> = (0..b * 16 * n)
            .map(|i| ((i * 7919 + seed * 104_729) % 2048) as u32)
            .collect();
        Tensor::from_vec(v, (b, 16, n), &Device::Cpu).unwrap()
    };
    let sizes = [(1, true), (2, false), (4, false), (8, false)];
    let (mut eager, mut graphed) = (c2w.new_slots(4), c2w.new_slots(4));
    let mut graphs = Code2WavGraphs::default();
    c2w.warm_up_graphs(&mut graphed, &mut graphs, 4, &sizes)
        .unwrap();
    let ids = [3usize, 1];
    let clip = codes(2, 63, 1);
    c2w.step_slots(&mut eager, &ids, &clip).unwrap();
    c2w.seed_slots(&mut graphed, Some(&mut graphs), &ids, &clip, &sizes)
        .unwrap();
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let mut worst = 0f32;
    for (step, n) in [1usize, 2, 4, 8].into_iter().enumerate() {
        let chunk = codes(2, n, 10 + step);
        let a = c2w.step_slots(&mut eager, &ids, &chunk).unwrap();
        let b = c2w
            .step_slots_graphed(&mut graphed, &mut graphs, &ids, &chunk)
            .unwrap();
        let scale = max_abs_diff(&f(&a), &f(&a).zeros_like().unwrap());
        assert!(scale > 1e-3, "chunk {step}: silent output");
        worst = worst.max(max_abs_diff(&f(&a), &f(&b)) / scale);
    }
    eprintln!("tts code2wav seeded by graphs vs eager: max |diff| {worst:.2e} of the signal's max");
    assert!(
        worst <= 0.1,
        "the seeded streams differ by {worst} of the signal"
    );
}

/// Code2Wav at the released shapes (random bf16), alone on the GPU: the first
/// chunk (one frame) and steady 4-frame chunks of 1, 8 and 32 streams in one
/// `step_slots`, synchronized, mean of 5 after 2 warm-ups.
#[test]
#[ignore]
fn profile_code2wav_chunks() {
    use std::time::Instant;
    let dev = gpu();
    let c2w = released_code2wav(&dev);
    let codes = |n: usize| {
        Tensor::from_vec(
            (0..16 * n)
                .map(|i| (i * 37 % 2048) as u32)
                .collect::<Vec<_>>(),
            (16, n),
            &Device::Cpu,
        )
        .unwrap()
    };
    for b in [1usize, 8, 32] {
        let mut slots = c2w.new_slots(b);
        let ids: Vec<usize> = (0..b).collect();
        let t = Instant::now();
        c2w.step_slots(
            &mut slots,
            &ids,
            &codes(1).unsqueeze(0).unwrap().repeat((b, 1, 1)).unwrap(),
        )
        .unwrap();
        dev.synchronize().unwrap();
        eprintln!(
            "code2wav {b} streams, first chunk (1 frame): {:.1} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        let chunk = codes(4).unsqueeze(0).unwrap().repeat((b, 1, 1)).unwrap();
        for _ in 0..2 {
            c2w.step_slots(&mut slots, &ids, &chunk).unwrap();
        }
        dev.synchronize().unwrap();
        let t = Instant::now();
        for _ in 0..5 {
            c2w.step_slots(&mut slots, &ids, &chunk).unwrap();
        }
        // The host's launches alone: when this is most of the step, the step is
        // launch-bound, not GPU-bound.
        let queued = t.elapsed().as_secs_f64() * 1e3 / 5.0;
        dev.synchronize().unwrap();
        let ms = t.elapsed().as_secs_f64() * 1e3 / 5.0;
        eprintln!(
            "code2wav {b} streams, 4-frame chunk in one step_slots: {ms:.1} ms ({:.0} audio-s/s), \
             {queued:.1} ms of it launching",
            b as f64 * 0.32 / (ms / 1e3)
        );
        // Graphed, with candle's convolutions and SnakeBeta, then the engine's.
        for engine in [false, true] {
            super::kernels::set_enabled(engine);
            let mut graphs = super::code2wav::Code2WavGraphs::default();
            for _ in 0..2 {
                c2w.step_slots_graphed(&mut slots, &mut graphs, &ids, &chunk)
                    .unwrap();
            }
            dev.synchronize().unwrap();
            let t = Instant::now();
            for _ in 0..5 {
                c2w.step_slots_graphed(&mut slots, &mut graphs, &ids, &chunk)
                    .unwrap();
            }
            dev.synchronize().unwrap();
            let ms = t.elapsed().as_secs_f64() * 1e3 / 5.0;
            let ops = if engine { "engine's" } else { "candle's" };
            eprintln!(
                "code2wav {b} streams, 4-frame chunk graphed, {ops} convs: {ms:.1} ms ({:.0} audio-s/s)",
                b as f64 * 0.32 / (ms / 1e3)
            );
        }
    }
}

/// Where a batched 4-frame Code2Wav step of 8 and 32 streams spends its time:
/// the device is synchronised after each part (the state's stacking and splitting,
/// the pre-transformer, each decoder block's SnakeBeta, transposed conv and
/// residual units), so each figure is its launches and its GPU work together;
/// last, the stage's copy of the audio to the host.
#[test]
#[ignore]
fn profile_code2wav_parts() {
    use std::time::Instant;
    let dev = gpu();
    let c2w = released_code2wav(&dev);
    let codes = |n: usize, seed: usize| {
        Tensor::from_vec(
            (0..16 * n)
                .map(|i| ((i + seed) * 37 % 2048) as u32)
                .collect::<Vec<_>>(),
            (16, n),
            &Device::Cpu,
        )
        .unwrap()
    };
    const ITERS: usize = 5;
    for (b, engine) in [(8usize, true), (32, false), (32, true)] {
        // candle's convolutions and SnakeBeta, or the engine's.
        super::kernels::set_enabled(engine);
        let mut slots = c2w.new_slots(b);
        let ids: Vec<usize> = (0..b).collect();
        let batch = |n: usize| {
            let rows: Vec<Tensor> = (0..b).map(|i| codes(n, i)).collect();
            Tensor::stack(&rows, 0).unwrap()
        };
        c2w.step_slots(&mut slots, &ids, &batch(1)).unwrap();
        // Past the attention window (71 frames), as in a running conversation.
        let chunk = batch(4);
        for _ in 0..18 {
            c2w.step_slots(&mut slots, &ids, &chunk).unwrap();
        }
        dev.synchronize().unwrap();
        let mut parts: Vec<(super::code2wav::Part, f64)> = Vec::new();
        let mut copies = 0.0;
        let t0 = Instant::now();
        for _ in 0..ITERS {
            let mut t = Instant::now();
            let wav = c2w
                .step_slots_marked(&mut slots, &ids, &chunk, &mut |part| {
                    dev.synchronize()?;
                    let ms = t.elapsed().as_secs_f64() * 1e3;
                    match parts.iter_mut().find(|(p, _)| *p == part) {
                        Some((_, total)) => *total += ms,
                        None => parts.push((part, ms)),
                    }
                    t = Instant::now();
                    Ok(())
                })
                .unwrap();
            let t = Instant::now();
            wav.flatten_from(1)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            copies += t.elapsed().as_secs_f64() * 1e3;
        }
        let wall = t0.elapsed().as_secs_f64() * 1e3 / ITERS as f64;
        let ops = if engine { "engine's" } else { "candle's" };
        eprintln!("code2wav {b} streams, 4-frame chunk, {ops} convs, synchronised after each part: {wall:.1} ms a step");
        for (part, ms) in &parts {
            eprintln!("  {:<34} {:>7.2} ms", part.to_string(), ms / ITERS as f64);
        }
        eprintln!(
            "  {:<34} {:>7.2} ms",
            "copies to the host, per stream",
            copies / ITERS as f64
        );
    }
}

/// The decode kernels alone at the released Thinker's shapes, a few launches each
/// at 1, 8 and 32 rows, then each MoE GEMV variant at 8 and 32, for `ncu`
/// (scripts/cuda/gpu_bench.sh's `ncu` step).
#[test]
#[ignore]
fn profile_decode_kernels() {
    use super::kernels;
    use super::layers::{DecoderLayer, KvSlots, SlotBatch};
    let cfg = released("thinker");
    let dev = gpu();
    let vb = weights::random(DType::BF16, &dev);
    let layer = DecoderLayer::new(&cfg, 0, vb.pp("layer")).unwrap();
    let hd = cfg.head_dim();
    for b in [1usize, 8, 32] {
        let x = bf16_randn((b, 1, cfg.hidden_size), &dev);
        let slots = KvSlots::new(b, cfg.num_key_value_heads, 4096, hd, DType::BF16, &dev).unwrap();
        let rows: Vec<usize> = (0..b).collect();
        let batch = SlotBatch::new(&slots, &rows, &vec![300; b]).unwrap();
        let cos = Tensor::ones((b, 1, hd / 2), DType::BF16, &dev).unwrap();
        for _ in 0..2 {
            layer.forward_slots(&x, &cos, &cos, &slots, &batch).unwrap();
        }
    }
    // Each MoE GEMV variant at 8 and 32 rows, side by side.
    let moe = SparseMoe::new(&cfg, vb.pp("moe")).unwrap();
    for b in [8usize, 32] {
        let x = bf16_randn((b, cfg.hidden_size), &dev);
        for (rows, blocks) in kernels::GEMV_BUILT {
            kernels::GEMV_ROWS.set(Some(rows));
            kernels::GEMV_BLOCKS.set(Some(blocks));
            moe.routed_in_mode(&x, kernels::Mode::Gemv).unwrap();
        }
    }
    kernels::GEMV_ROWS.set(None);
    kernels::GEMV_BLOCKS.set(None);
    dev.synchronize().unwrap();
}

/// One prefill decoder layer at the released Thinker's shapes, 32 prompts of 100
/// tokens then one of 2,500, once each, for `ncu` (scripts/cuda/gpu_bench.sh's
/// `ncu-prefill` step): where a prefill's time goes, kernel by kernel.
#[test]
#[ignore]
fn profile_prefill_kernels() {
    use super::layers::{attention_mask, DecoderLayer, KvCache};
    let cfg = released("thinker");
    let dev = gpu();
    let layer = DecoderLayer::new(&cfg, 0, weights::random(DType::BF16, &dev).pp("layer")).unwrap();
    let hd = cfg.head_dim();
    for (rows, n) in [(32usize, 100usize), (1, 2500)] {
        let x = bf16_randn((rows, n, cfg.hidden_size), &dev);
        let cos = Tensor::ones((rows, n, hd / 2), DType::BF16, &dev).unwrap();
        let mask = attention_mask(None, rows, n, n, &dev).unwrap();
        let mut cache = KvCache::new();
        layer
            .forward(&x, &cos, &cos, mask.as_ref(), Some(&mut cache))
            .unwrap();
    }
    dev.synchronize().unwrap();
}

/// Times the pieces of one released-shape Thinker decode step (run by hand on the
/// GPU host with `--ignored`; docs/bench/gpu.md records what it printed): eagerly
/// (launch overhead included, synchronized), and as CUDA graphs of ten repeats
/// (the GPU's own time, as a graphed step runs them), with the engine's decode
/// kernels and with candle's ops side by side.
#[test]
#[ignore]
fn profile_released_thinker_layer() {
    use super::graphs::StepGraph;
    use super::kernels;
    use super::layers::{DecoderLayer, KvSlots, SlotBatch};
    use std::time::Instant;
    let cfg = released("thinker");
    let dev = gpu();
    let vb = weights::random(DType::BF16, &dev);
    let layer = DecoderLayer::new(&cfg, 0, vb.pp("layer")).unwrap();
    let moe = SparseMoe::new(&cfg, vb.pp("moe")).unwrap();
    let head = candle_nn::linear_no_bias(cfg.hidden_size, cfg.vocab_size, vb.pp("head")).unwrap();
    let eager = |what: &str, f: &mut dyn FnMut()| {
        for _ in 0..3 {
            f();
        }
        dev.synchronize().unwrap();
        let t = Instant::now();
        for _ in 0..20 {
            f();
        }
        dev.synchronize().unwrap();
        eprintln!(
            "{what}, eager: {:.1} us",
            t.elapsed().as_secs_f64() * 1e6 / 20.0
        );
    };
    let graphed = |what: &str, f: &mut dyn FnMut()| {
        const REPEATS: usize = 10;
        let g = StepGraph::capture(&dev, || {
            for _ in 0..REPEATS {
                f();
            }
            Ok(())
        })
        .unwrap();
        g.launch().unwrap();
        dev.synchronize().unwrap();
        let t = Instant::now();
        for _ in 0..20 {
            g.launch().unwrap();
        }
        dev.synchronize().unwrap();
        let us = t.elapsed().as_secs_f64() * 1e6 / (20 * REPEATS) as f64;
        eprintln!("{what}, graphed: {us:.1} us");
    };
    let hd = cfg.head_dim();
    for b in [1usize, 8, 32] {
        let x = bf16_randn((b, 1, cfg.hidden_size), &dev);
        for len in [200usize, 2000] {
            let slots =
                KvSlots::new(b, cfg.num_key_value_heads, 4096, hd, DType::BF16, &dev).unwrap();
            let rows: Vec<usize> = (0..b).collect();
            let batch = SlotBatch::new(&slots, &rows, &vec![len; b]).unwrap();
            let cos = Tensor::ones((b, 1, hd / 2), DType::BF16, &dev).unwrap();
            for on in [true, false] {
                kernels::set_enabled(on);
                let which = if on { "engine kernels" } else { "candle ops" };
                let mut f = || {
                    layer.forward_slots(&x, &cos, &cos, &slots, &batch).unwrap();
                };
                let what = format!("b={b} kv={len} decoder layer, {which}");
                eager(&what, &mut f);
                graphed(&what, &mut f);
            }
        }
        let xs = x.reshape((b, cfg.hidden_size)).unwrap();
        for on in [true, false] {
            kernels::set_enabled(on);
            let which = if on {
                "route + gate/up + down kernels"
            } else {
                "candle routing + grouped GEMV"
            };
            let mut f = || {
                moe.forward(&xs).unwrap();
            };
            eager(&format!("b={b} MoE, {which}"), &mut f);
            graphed(&format!("b={b} MoE, {which}"), &mut f);
        }
        kernels::set_enabled(true);
        for (rows, blocks) in kernels::GEMV_BUILT {
            kernels::GEMV_ROWS.set(Some(rows));
            kernels::GEMV_BLOCKS.set(Some(blocks));
            graphed(
                &format!(
                    "b={b} MoE, routed experts by GEMV, {rows} rows a warp, >= {blocks} blocks/SM"
                ),
                &mut || {
                    moe.routed_in_mode(&xs, kernels::Mode::Gemv).unwrap();
                },
            );
        }
        kernels::GEMV_ROWS.set(None);
        kernels::GEMV_BLOCKS.set(None);
        graphed(
            &format!("b={b} MoE, routed experts by tensor cores"),
            &mut || {
                moe.routed_in_mode(&xs, kernels::Mode::Tensor).unwrap();
            },
        );
        eager(&format!("b={b} MoE, candle's grouped GEMM"), &mut || {
            moe.forward_grouped(&xs, true).unwrap();
        });
        let mut f = || {
            head.forward(&xs).unwrap();
        };
        eager(&format!("b={b} lm_head"), &mut f);
        graphed(&format!("b={b} lm_head"), &mut f);
    }
    // Prefills: one prompt of `n` tokens (or 32 of 100), a whole decoder layer
    // (attention with its mask and KV cache), and the MoE's paths alone.
    use super::layers::{attention_mask, KvCache};
    for (rows, n) in [
        (1usize, 64usize),
        (1, 100),
        (1, 128),
        (1, 512),
        (1, 2500),
        (32, 100),
    ] {
        let x = bf16_randn((rows, n, cfg.hidden_size), &dev);
        let cos = Tensor::ones((rows, n, hd / 2), DType::BF16, &dev).unwrap();
        let mask = attention_mask(None, rows, n, n, &dev).unwrap();
        eager(&format!("prefill {rows}x{n} decoder layer"), &mut || {
            let mut cache = KvCache::new();
            layer
                .forward(&x, &cos, &cos, mask.as_ref(), Some(&mut cache))
                .unwrap();
        });
        let xs = x.reshape((rows * n, cfg.hidden_size)).unwrap();
        eager(
            &format!("prefill {rows}x{n} MoE, as the engine runs it"),
            &mut || {
                moe.forward(&xs).unwrap();
            },
        );
        eager(
            &format!("prefill {rows}x{n} MoE, candle's grouped GEMM"),
            &mut || {
                moe.forward_grouped(&xs, true).unwrap();
            },
        );
        eager(
            &format!("prefill {rows}x{n} MoE, gathered GEMMs"),
            &mut || {
                moe.forward_gathered_for_test(&xs).unwrap();
            },
        );
        // Routed on the device as the engine routes this many tokens.
        if rows * n <= 128 {
            eager(&format!("prefill {rows}x{n} MoE, GEMV"), &mut || {
                moe.routed_in_mode(&xs, kernels::Mode::Gemv).unwrap();
            });
        }
        for &stages in kernels::TC_STAGES.choices {
            kernels::TC_STAGES.set(Some(stages));
            eager(
                &format!("prefill {rows}x{n} MoE, tensor cores, {stages} stages"),
                &mut || {
                    moe.routed_in_mode(&xs, kernels::Mode::Tensor).unwrap();
                },
            );
        }
        kernels::TC_STAGES.set(None);
    }
}

/// Where a Talker step's time goes at the released shapes (random bf16), alone on
/// the GPU: at 1, 8, 16, 24 and 32 rows with about 300 cached positions, the code
/// predictor's graphed frame greedy and sampled (the H200 profile's config: their
/// difference is the device sampling), the graphed 20-layer decode step, and the
/// whole `step_slots` the stage runs (both graphs, the embeddings and the copies to
/// the host). Synchronised, mean of 10 after 3 warm-ups.
#[test]
#[ignore]
fn profile_talker_steps() {
    use super::sampling::SamplingConfig;
    use super::talker::{Talker, TalkerConfig};
    let cfg: TalkerConfig =
        serde_json::from_value(bench_config()["talker_config"].clone()).unwrap();
    let dev = gpu();
    let talker = Talker::new(&cfg, weights::random(DType::BF16, &dev).pp("talker")).unwrap();
    let sampled = SamplingConfig {
        temperature: 1.0,
        ..SamplingConfig::code_predictor()
    };
    profile_talker(&talker, &cfg, &sampled, &[1, 8, 16, 24, 32], 300);
}

/// Qwen3-TTS's Talker at a released variant's shapes (random bf16; the
/// variant's folder under deploy/qwen3_tts_released/bench from
/// `OMNISTREAM_TTS_VARIANT`, 1.7b-customvoice by default), as
/// [`profile_talker_steps`], at the rows in `OMNISTREAM_PROFILE_ROWS` (default
/// 1,8,16,32,48,64) with 200 cached positions, the code predictor sampling as
/// the released generation config does (temperature 0.9, top-k 50).
#[test]
#[ignore]
fn profile_tts_talker_steps() {
    use super::sampling::SamplingConfig;
    use crate::models::qwen3_tts::config::Qwen3TtsConfig;
    use crate::models::qwen3_tts::talker::Qwen3TtsTalker;
    let variant =
        std::env::var("OMNISTREAM_TTS_VARIANT").unwrap_or_else(|_| "1.7b-customvoice".into());
    let dir = tts_bench_dir(&variant);
    let rows: Vec<usize> = std::env::var("OMNISTREAM_PROFILE_ROWS")
        .unwrap_or_else(|_| "1,8,16,32,48,64".into())
        .split(',')
        .map(|r| r.trim().parse().unwrap())
        .collect();
    let cfg = Qwen3TtsConfig::load(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let dev = gpu();
    let talker = Qwen3TtsTalker::new(&cfg, weights::random(DType::BF16, &dev)).unwrap();
    let sampled = SamplingConfig {
        temperature: 0.9,
        top_k: 50,
        top_p: 1.0,
        ..SamplingConfig::code_predictor()
    };
    eprintln!("{variant}:");
    profile_talker(talker.talker(), &cfg.talker(), &sampled, &rows, 200);
}

/// A Talker's KV slots, `total` of 1,024 positions, the first `filled` holding
/// `cached` random positions each.
fn talker_slots(
    talker: &super::talker::Talker,
    tc: &DecoderConfig,
    total: usize,
    filled: usize,
    cached: usize,
) -> Vec<super::layers::KvSlots> {
    let dev = gpu();
    let slots = talker.new_slots(total, 1024).unwrap();
    for slot in 0..filled {
        for s in &slots {
            let kv = bf16_randn((1, tc.num_key_value_heads, cached, tc.head_dim()), &dev);
            let mut c = super::layers::KvCache::new();
            c.append(&kv, &kv).unwrap();
            s.load(slot, &c, 0, 0).unwrap();
        }
    }
    slots
}

/// Times a Talker's step parts at each row count in `batches` (see
/// [`profile_talker_steps`]), every row with `cached` positions in its slot.
fn profile_talker(
    talker: &super::talker::Talker,
    cfg: &super::talker::TalkerConfig,
    sampled: &super::sampling::SamplingConfig,
    batches: &[usize],
    cached: usize,
) {
    use super::sampling::{Sampler, SamplingConfig};
    use super::talker::{SlotRows, TalkerGraphs};
    use std::time::Instant;
    let dev = gpu();
    let tc = &cfg.text_config;
    const ITERS: usize = 10;
    let max_rows = batches.iter().copied().max().unwrap_or(1);
    let scratch = TalkerGraphs::scratch_slots(max_rows);
    let slots = talker_slots(talker, tc, max_rows + scratch, max_rows, cached);
    let mut graphs = TalkerGraphs::new(max_rows);
    let time = |f: &mut dyn FnMut()| {
        for _ in 0..3 {
            f();
        }
        dev.synchronize().unwrap();
        let t = Instant::now();
        for _ in 0..ITERS {
            f();
        }
        dev.synchronize().unwrap();
        t.elapsed().as_secs_f64() * 1e3 / ITERS as f64
    };
    for &b in batches {
        let ids: Vec<usize> = (0..b).collect();
        let lens = vec![cached; b];
        let pos = vec![cached as u32; b];
        let hidden = bf16_randn((b, 1, tc.hidden_size), &dev);
        let rows = SlotRows {
            slots: &ids,
            lens: &lens,
            pos: &pos,
            last_hidden: &hidden,
        };
        let cp = talker.code_predictor();
        let e0 = bf16_randn((b, 1, tc.hidden_size), &dev);
        let greedy = SamplingConfig::greedy();
        let cp_greedy = time(&mut || {
            cp.generate_graphed(&mut graphs.predictor, &hidden, &e0, &greedy)
                .unwrap();
        });
        let cp_sampled = time(&mut || {
            cp.generate_graphed(&mut graphs.predictor, &hidden, &e0, sampled)
                .unwrap();
        });
        let cp_eager = time(&mut || {
            cp.generate_on_device(&hidden, &e0, sampled).unwrap();
        });
        // The same positions every time: the KV rows at `cached` are rewritten.
        let decode = time(&mut || {
            talker
                .decode_slots(&slots, &rows, &hidden, Some(&mut graphs))
                .unwrap();
        });
        let decode_eager = time(&mut || {
            talker.decode_slots(&slots, &rows, &hidden, None).unwrap();
        });
        let code0: Vec<u32> = (0..b as u32).map(|i| i * 7 % 2048).collect();
        let text = bf16_randn((b, 1, tc.hidden_size), &dev);
        let mut samplers: Vec<Sampler> = (0..b).map(|_| Sampler::new(sampled.clone())).collect();
        let mut whole_step = || {
            let (s, _) = talker
                .step_slots(
                    &slots,
                    &rows,
                    &code0,
                    &text,
                    &mut samplers,
                    Some(&mut graphs),
                )
                .unwrap();
            s.logits.to_vec2::<f32>().unwrap();
        };
        let step = time(&mut whole_step);
        if std::env::var_os("OMNISTREAM_PROFILE_RANGE").is_some() {
            // One more whole step inside a profiler range: `ncu --profile-from-start
            // off` sees only these kernels (scripts/qwen3_tts/talker_profile.sh).
            dev.synchronize().unwrap();
            let range = candle_core::cuda::cudarc::driver::Profiler::new().unwrap();
            whole_step();
            dev.synchronize().unwrap();
            drop(range);
        }
        eprintln!(
            "talker {b:>2} rows: code predictor graphed {cp_greedy:.2} ms greedy, {cp_sampled:.2} sampled \
             (eager {cp_eager:.2}); decode graphed {decode:.2} (eager {decode_eager:.2}); \
             whole step {step:.2} ms ({:.0} frames/s)",
            b as f64 / (step / 1e3)
        );
    }
}
