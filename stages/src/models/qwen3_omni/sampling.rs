//! Token sampling with Hugging Face `generate` semantics (transformers 5.24), one
//! [`Sampler`] per request so a batch's rows keep their own history and RNG.
//!
//! Order, as `GenerationMixin._get_logits_processor` builds it: repetition penalty,
//! suppressed tokens, then (only when sampling) temperature, top-k, top-p; then argmax
//! (greedy) or a draw from the softmax (sampling).
//!
//! Public API:
//! - [`SamplingConfig`] (`greedy()`, `talker(vocab, eos)`, `code_predictor()`),
//!   [`Sampler::new(cfg)`](Sampler::new), `process(&mut logits)`, `sample(&logits) -> u32`,
//!   `sample_tensor(&logits) -> u32`, `push(id)`, `history()`, `reset()`.
//! - The single transforms: [`repetition_penalty`], [`suppress`], [`temperature`],
//!   [`top_k`], [`top_p`], and [`argmax`].

use candle_core::{DType, Result, Tensor};
use rand::distributions::{Distribution, WeightedIndex};
use rand::rngs::StdRng;
use rand::SeedableRng;

/// How one request's tokens are chosen.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingConfig {
    /// Draw from the distribution; `false` is greedy (temperature/top-k/top-p unused).
    pub do_sample: bool,
    /// 1.0 = unchanged.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1.0 = off.
    pub top_p: f32,
    /// 1.0 = off; applies to every id already produced (greedy too, as in HF).
    pub repetition_penalty: f32,
    /// Ids that can never be chosen.
    pub suppress_tokens: Vec<u32>,
    /// The RNG seed (sampling only).
    pub seed: u64,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingConfig {
    /// Plain argmax.
    pub fn greedy() -> Self {
        Self {
            do_sample: false,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            suppress_tokens: Vec::new(),
            seed: 0,
        }
    }

    /// The top-level `generate`'s Talker defaults for code 0: temperature 0.9, top_k 50,
    /// top_p 1.0, repetition penalty 1.05, and every id in `[vocab - 1024, vocab)` but the
    /// codec EOS suppressed (the codec's control ids and speakers live there).
    pub fn talker(vocab_size: usize, codec_eos: u32) -> Self {
        let suppress_tokens = (vocab_size.saturating_sub(1024)..vocab_size)
            .map(|i| i as u32)
            .filter(|&i| i != codec_eos)
            .collect();
        Self {
            do_sample: true,
            temperature: 0.9,
            top_k: 50,
            top_p: 1.0,
            repetition_penalty: 1.05,
            suppress_tokens,
            seed: 0,
        }
    }

    /// The code predictor's defaults when the Talker samples: top_k 50, top_p 0.8.
    pub fn code_predictor() -> Self {
        Self {
            do_sample: true,
            top_k: 50,
            top_p: 0.8,
            ..Self::greedy()
        }
    }

    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    pub fn with_do_sample(mut self, do_sample: bool) -> Self {
        self.do_sample = do_sample;
        self
    }
}

/// HF `RepetitionPenaltyLogitsProcessor`: every id in `ids` (once, however often it
/// occurs) has its logit divided by `penalty` when positive, multiplied when negative.
pub fn repetition_penalty(logits: &mut [f32], ids: &[u32], penalty: f32) {
    if penalty == 1.0 {
        return;
    }
    let mut seen = vec![false; logits.len()];
    for &id in ids {
        let i = id as usize;
        if i < logits.len() && !seen[i] {
            seen[i] = true;
            let x = logits[i];
            logits[i] = if x < 0.0 { x * penalty } else { x / penalty };
        }
    }
}

/// HF `SuppressTokensLogitsProcessor`: the ids get `-inf`.
pub fn suppress(logits: &mut [f32], ids: &[u32]) {
    for &id in ids {
        if let Some(x) = logits.get_mut(id as usize) {
            *x = f32::NEG_INFINITY;
        }
    }
}

/// HF `TemperatureLogitsWarper`.
pub fn temperature(logits: &mut [f32], t: f32) {
    if t != 1.0 {
        for x in logits.iter_mut() {
            *x /= t;
        }
    }
}

/// HF `TopKLogitsWarper` (min_tokens_to_keep 1): everything below the k-th largest
/// logit gets `-inf` (ties with it stay).
pub fn top_k(logits: &mut [f32], k: usize) {
    if k == 0 || k >= logits.len() {
        return;
    }
    // The k-th largest by selection, not a whole sort: the Talker draws every
    // row's code 0 on the host, between its GPU steps.
    let mut order: Vec<f32> = logits.to_vec();
    let (_, &mut kth, _) = order.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    for x in logits.iter_mut() {
        if *x < kth {
            *x = f32::NEG_INFINITY;
        }
    }
}

/// HF `TopPLogitsWarper` (min_tokens_to_keep 1): sorted ascending, the tokens whose
/// cumulative probability is `<= 1 - p` get `-inf`; the most likely token always stays.
pub fn top_p(logits: &mut [f32], p: f32) {
    if p >= 1.0 || logits.is_empty() {
        return;
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // Stable ascending sort, as torch.sort's order among equal logits does not matter for
    // the kept set except at a tie across the threshold.
    order.sort_by(|&a, &b| logits[a].total_cmp(&logits[b]));
    let probs = softmax(&order.iter().map(|&i| logits[i]).collect::<Vec<_>>());
    let threshold = 1.0 - p;
    let mut cum = 0.0f32;
    let last = order.len() - 1;
    for (rank, (&i, &q)) in order.iter().zip(probs.iter()).enumerate() {
        cum += q;
        if cum <= threshold && rank != last {
            logits[i] = f32::NEG_INFINITY;
        }
    }
}

/// Softmax in f32 (`-inf` entries give 0).
fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|&x| (x - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

/// The first index of the largest value (torch.argmax's choice among ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// One request's sampler: its config, the ids it produced (for the repetition penalty)
/// and its own seeded RNG.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplingConfig,
    history: Vec<u32>,
    rng: StdRng,
}

impl Sampler {
    pub fn new(cfg: SamplingConfig) -> Self {
        let rng = StdRng::seed_from_u64(cfg.seed);
        Self {
            cfg,
            history: Vec::new(),
            rng,
        }
    }

    pub fn config(&self) -> &SamplingConfig {
        &self.cfg
    }

    /// The ids produced so far (those the repetition penalty applies to).
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// Records an id produced elsewhere (e.g. forced), so the penalty sees it.
    pub fn push(&mut self, id: u32) {
        self.history.push(id);
    }

    /// Forgets the history and reseeds, for a new request.
    pub fn reset(&mut self) {
        self.history.clear();
        self.rng = StdRng::seed_from_u64(self.cfg.seed);
    }

    /// Applies every processor in HF order to `logits` in place (the warpers only when sampling).
    pub fn process(&self, logits: &mut [f32]) {
        repetition_penalty(logits, &self.history, self.cfg.repetition_penalty);
        suppress(logits, &self.cfg.suppress_tokens);
        if self.cfg.do_sample {
            temperature(logits, self.cfg.temperature);
            top_k(logits, self.cfg.top_k);
            top_p(logits, self.cfg.top_p);
        }
    }

    /// Chooses the next id from raw logits and records it.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        let mut l = logits.to_vec();
        self.process(&mut l);
        let id = if self.cfg.do_sample {
            let probs = softmax(&l);
            let dist = WeightedIndex::new(&probs)
                .map_err(|e| candle_core::Error::Msg(format!("sampling: {e}")))?;
            dist.sample(&mut self.rng) as u32
        } else {
            argmax(&l)
        };
        self.history.push(id);
        Ok(id)
    }

    /// [`Sampler::sample`] from a 1-D logits tensor (any float dtype).
    pub fn sample_tensor(&mut self, logits: &Tensor) -> Result<u32> {
        let l = logits.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        self.sample(&l)
    }
}

/// Whether [`sample_on_device`] draws as `cfg` says: it has no history, so no
/// repetition penalty, and suppresses nothing.
pub fn samples_on_device(cfg: &SamplingConfig) -> bool {
    cfg.repetition_penalty == 1.0 && cfg.suppress_tokens.is_empty()
}

/// Whether a request with `cfg` is served by [`argmax_rows`] on the device (greedy,
/// nothing the host's history changes), so its step copies an id, not its logits.
pub fn greedy_on_device(cfg: &SamplingConfig) -> bool {
    !cfg.do_sample && samples_on_device(cfg)
}

/// Whether a sampled request with `cfg` can draw where the logits are by
/// [`gumbel_max_rows`]: temperature only (no top-k or top-p cut, which need a sort
/// of the vocabulary, and nothing the host's history changes).
pub fn tempered_on_device(cfg: &SamplingConfig) -> bool {
    cfg.do_sample && cfg.top_k == 0 && cfg.top_p >= 1.0 && samples_on_device(cfg)
}

/// One draw per row of `logits` `(b, vocab)` f32 from `softmax(logits[r] /
/// temperatures[r])`, where the logits are: the Gumbel-max trick, `argmax(l / t -
/// log(-log u))` with u uniform, which is an exact draw from that distribution and
/// needs no sort. The noise comes from the device's generator. Returns `(b,)` u32.
pub fn gumbel_max_rows(logits: &Tensor, temperatures: &[f32]) -> Result<Tensor> {
    let (b, v) = logits.dims2()?;
    if temperatures.len() != b || temperatures.iter().any(|t| t.is_nan() || *t <= 0.0) {
        candle_core::bail!("gumbel_max_rows: {b} rows, temperatures {temperatures:?}")
    }
    let inv: Vec<f32> = temperatures.iter().map(|t| 1.0 / t).collect();
    let inv = Tensor::from_vec(inv, (b, 1), logits.device())?;
    let gumbel = gumbel_noise(&Tensor::rand(1e-20f32, 1.0, (b, v), logits.device())?)?;
    let scores = (logits.to_dtype(DType::F32)?.broadcast_mul(&inv)? + gumbel)?;
    argmax_rows(&scores)
}

/// `-log(-log u)` for uniform `u` f32. The u are kept below 1: curand's uniform
/// includes 1.0 (and f32 rounds its top 2^-25 to it), whose noise would be +inf: over
/// a 152k vocabulary and 32 rows, in about one step of seven a random token would
/// win outright.
fn gumbel_noise(u: &Tensor) -> Result<Tensor> {
    const BELOW_ONE: f64 = 1.0 - 1.0 / (1u32 << 24) as f64;
    u.clamp(1e-20, BELOW_ONE)?.log()?.neg()?.log()?.neg()
}

/// Each row's first largest logit of `(b, vocab)` f32, `(b,)` u32, where the logits
/// are: the engine's kernel on a GPU (torch's choice among ties, as [`argmax`]),
/// candle's argmax elsewhere (a first-index scan on the CPU).
pub fn argmax_rows(logits: &Tensor) -> Result<Tensor> {
    if logits.device().is_cuda() {
        super::kernels::argmax(logits)
    } else {
        logits.argmax(candle_core::D::Minus1)
    }
}

/// One id per row of `logits` `(b, vocab)`, drawn where the logits are (the GPU),
/// with no host round-trip: argmax, or temperature, top-k, top-p (the same
/// transforms as [`Sampler`]) and a Gumbel-max draw from what is kept. The noise
/// comes from the device's generator, not the request's seed. Returns `(b,)` u32.
pub fn sample_on_device(logits: &Tensor, cfg: &SamplingConfig) -> Result<Tensor> {
    sample_on_device_with(logits, cfg, None)
}

/// How many candidates [`sample_on_device`] draws among for logits `vocab` wide:
/// the width of the uniform noise it takes.
pub fn device_candidates(cfg: &SamplingConfig, vocab: usize) -> usize {
    if cfg.top_k == 0 {
        vocab
    } else {
        cfg.top_k.min(vocab)
    }
}

/// [`sample_on_device`] with the uniform noise `(b, device_candidates)` in
/// `[1e-20, 1)` given (a graphed step draws it before the replay), or drawn here.
pub fn sample_on_device_with(
    logits: &Tensor,
    cfg: &SamplingConfig,
    uniform: Option<&Tensor>,
) -> Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?;
    if !cfg.do_sample {
        return argmax_rows(&logits);
    }
    let (b, v) = logits.dims2()?;
    let k = device_candidates(cfg, v);
    let u = match uniform {
        Some(u) => u.clone(),
        None => Tensor::rand(1e-20f32, 1.0, (b, k), logits.device())?,
    };
    // One launch on a GPU where the row fits the kernel's sort; candle's ops (some
    // twenty launches, a sort and a matmul cumsum among them) elsewhere.
    if logits.device().is_cuda()
        && cfg.top_k > 0
        && super::kernels::top_k_supported(v, k)
        && super::kernels::enabled()
    {
        let inv_temp = 1.0 / cfg.temperature.max(1e-6);
        return super::kernels::sample_top_k(&logits, &u, inv_temp, cfg.top_p);
    }
    sample_with_ops(&logits, cfg, &u)
}

/// [`sample_on_device_with`]'s draw in candle's ops, from f32 `logits` `(b, v)`
/// and the uniforms `u` `(b, device_candidates)`.
pub(crate) fn sample_with_ops(logits: &Tensor, cfg: &SamplingConfig, u: &Tensor) -> Result<Tensor> {
    let (b, v) = logits.dims2()?;
    let k = device_candidates(cfg, v);
    let l = (logits / cfg.temperature.max(1e-6) as f64)?;
    let idx = l.arg_sort_last_dim(false)?.narrow(1, 0, k)?.contiguous()?;
    let probs = candle_nn::ops::softmax_last_dim(&l.gather(&idx, 1)?)?;
    let logp = probs.log()?;
    let logp = if cfg.top_p < 1.0 {
        // HF's top-p: a token stays while the mass above it is below top_p (so the
        // most likely one always stays).
        let above = (probs.cumsum(1)? - &probs)?;
        let keep = above.lt(cfg.top_p as f64)?;
        keep.where_cond(&logp, &Tensor::full(f32::NEG_INFINITY, (b, k), l.device())?)?
    } else {
        logp
    };
    let gumbel = gumbel_noise(u)?;
    let choice = (logp + gumbel)?.argmax_keepdim(1)?;
    idx.gather(&choice, 1)?.squeeze(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::qwen3_omni::fixtures;

    const NEG: f32 = f32::NEG_INFINITY;

    /// Gumbel-max draws follow softmax(l / t): 40,000 rows of four logits at two
    /// temperatures, frequencies within 0.01 of the probabilities (about 4 standard
    /// errors); u = 1 gives finite noise.
    #[test]
    fn gumbel_max_draws_follow_the_tempered_softmax() {
        let dev = candle_core::Device::Cpu;
        let l = [1.0f32, 0.0, -1.0, 2.0];
        for t in [1.0f32, 0.5] {
            let rows = 40_000;
            let logits = Tensor::from_vec(l.repeat(rows), (rows, 4), &dev).unwrap();
            let ids = gumbel_max_rows(&logits, &vec![t; rows])
                .unwrap()
                .to_vec1::<u32>()
                .unwrap();
            let z: f32 = l.iter().map(|x| (x / t).exp()).sum();
            for (k, x) in l.iter().enumerate() {
                let want = (x / t).exp() / z;
                let got = ids.iter().filter(|&&i| i == k as u32).count() as f32 / rows as f32;
                assert!((got - want).abs() < 0.01, "t {t}: id {k} {got} vs {want}");
            }
        }
        let one = Tensor::new(&[1f32, 1e-20], &dev).unwrap();
        let g = gumbel_noise(&one).unwrap().to_vec1::<f32>().unwrap();
        assert!(g.iter().all(|x| x.is_finite()), "{g:?}");
        let bad = gumbel_max_rows(
            &Tensor::zeros((2, 4), DType::F32, &dev).unwrap(),
            &[1.0, 0.0],
        );
        assert!(bad.is_err());
    }

    #[test]
    fn hand_computed_transforms() {
        let mut l = vec![2.0, -1.0, 0.5, 3.0];
        repetition_penalty(&mut l, &[0, 1, 1], 2.0);
        assert_eq!(l, vec![1.0, -2.0, 0.5, 3.0]);
        suppress(&mut l, &[2]);
        assert_eq!(l, vec![1.0, -2.0, NEG, 3.0]);
        temperature(&mut l, 0.5);
        assert_eq!(l, vec![2.0, -4.0, NEG, 6.0]);
        let mut k = vec![1.0, 4.0, 3.0, 3.0, 0.0];
        top_k(&mut k, 2);
        // Ties with the k-th value stay, as HF's `scores < kth` keeps them.
        assert_eq!(k, vec![NEG, 4.0, 3.0, 3.0, NEG]);
        // softmax of [ln 1, ln 2, ln 7] / 10 = [0.1, 0.2, 0.7]: ascending cumsum 0.1, 0.3, 1.0.
        let mut p = vec![1f32.ln(), 2f32.ln(), 7f32.ln()];
        top_p(&mut p, 0.75); // drop cum <= 0.25: only the 0.1 one
        assert!(p[0] == NEG && p[1].is_finite() && p[2].is_finite());
        let mut p = vec![1f32.ln(), 2f32.ln(), 7f32.ln()];
        top_p(&mut p, 0.5); // drop cum <= 0.5: 0.1 and 0.2
        assert!(p[0] == NEG && p[1] == NEG && p[2].is_finite());
        let mut p = vec![1f32.ln(), 2f32.ln(), 7f32.ln()];
        top_p(&mut p, 0.01); // the most likely one always stays
        assert!(p[0] == NEG && p[1] == NEG && p[2].is_finite());
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn greedy_and_penalty_history() {
        let mut s = Sampler::new(SamplingConfig {
            repetition_penalty: 2.0,
            suppress_tokens: vec![3],
            ..SamplingConfig::greedy()
        });
        // 3 is suppressed; 0 wins, then is penalised (1.5 / 2 < 1.0).
        assert_eq!(s.sample(&[1.5, 1.0, 0.0, 9.0]).unwrap(), 0);
        assert_eq!(s.sample(&[1.5, 1.0, 0.0, 9.0]).unwrap(), 1);
        assert_eq!(s.history(), &[0, 1]);
        s.reset();
        assert!(s.history().is_empty());
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_filters() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let cfg = SamplingConfig {
            top_k: 5,
            ..SamplingConfig::code_predictor()
        }
        .with_seed(42);
        let mut kept = logits.clone();
        Sampler::new(cfg.clone()).process(&mut kept);
        let draw = |seed: u64| {
            let mut s = Sampler::new(cfg.clone().with_seed(seed));
            (0..200)
                .map(|_| s.sample(&logits).unwrap())
                .collect::<Vec<_>>()
        };
        let a = draw(42);
        assert_eq!(a, draw(42));
        assert_ne!(a, draw(43));
        assert!(a.iter().all(|&i| kept[i as usize].is_finite()));
        // more than one token is drawn (it samples, not argmax)
        assert!(a.iter().any(|&i| i != a[0]));
    }

    fn rows(t: &Tensor) -> Vec<Vec<f32>> {
        t.to_vec2::<f32>().unwrap()
    }

    fn assert_same(ours: &[f32], hf: &[f32], what: &str) {
        assert_eq!(ours.len(), hf.len());
        let mut finite = 0;
        for (i, (a, b)) in ours.iter().zip(hf).enumerate() {
            if b.is_infinite() {
                assert_eq!(a, b, "{what}: id {i}");
            } else {
                assert!((a - b).abs() <= 1e-5, "{what}: id {i}: {a} vs {b}");
                finite += 1;
            }
        }
        assert!(finite > 0, "{what}: everything filtered");
    }

    /// The HF processors' outputs recorded by scripts/qwen3_omni/talker.py.
    #[test]
    fn matches_hf_logits_processors() {
        let io = fixtures::io("talker");
        let scores = rows(&io["sampling.scores"]);
        let ids: Vec<Vec<u32>> = io["sampling.ids"]
            .to_dtype(DType::U32)
            .unwrap()
            .to_vec2()
            .unwrap();
        let vocab = scores[0].len();
        let cfg = fixtures::config();
        let eos = cfg["talker_config"]["codec_eos_token_id"].as_u64().unwrap() as u32;
        let talker = SamplingConfig {
            top_p: 0.8,
            ..SamplingConfig::talker(vocab, eos)
        };
        let stages = [
            "sampling.repetition",
            "sampling.suppress",
            "sampling.temperature",
            "sampling.top_k",
            "sampling.top_p",
        ];
        let hf: Vec<Vec<Vec<f32>>> = stages.iter().map(|k| rows(&io[*k])).collect();
        for r in 0..scores.len() {
            let mut l = scores[r].clone();
            repetition_penalty(&mut l, &ids[r], talker.repetition_penalty);
            assert_same(&l, &hf[0][r], stages[0]);
            suppress(&mut l, &talker.suppress_tokens);
            assert_same(&l, &hf[1][r], stages[1]);
            temperature(&mut l, talker.temperature);
            assert_same(&l, &hf[2][r], stages[2]);
            top_k(&mut l, talker.top_k);
            assert_same(&l, &hf[3][r], stages[3]);
            top_p(&mut l, talker.top_p);
            assert_same(&l, &hf[4][r], stages[4]);
            let kept = l.iter().filter(|x| x.is_finite()).count();
            assert!(kept > 1 && kept < 50, "top-p cut inside top-k: {kept}");

            // The whole chain through a sampler with that history.
            let mut s = Sampler::new(talker.clone());
            for &id in &ids[r] {
                s.push(id);
            }
            let mut all = scores[r].clone();
            s.process(&mut all);
            assert_same(&all, &hf[4][r], "sampler chain");

            // The code predictor's defaults on a codebook-wide slice.
            let mut cp = scores[r][..64].to_vec();
            Sampler::new(SamplingConfig::code_predictor()).process(&mut cp);
            assert_same(&cp, &rows(&io["sampling.cp_top_p"])[r], "code predictor");
        }
    }
}

#[cfg(test)]
mod device_tests {
    use super::*;
    use candle_core::Device;

    /// Draws on the device keep to HF's transforms: greedy is the argmax, top-k and
    /// top-p bound what can come out, and the frequencies follow the kept softmax.
    #[test]
    fn device_draws_follow_the_transforms() {
        let row = [2.0f32, 1.5, 1.0, 0.2, -1.0, 0.0];
        let n = 20_000;
        let logits = Tensor::from_vec(row.repeat(n), (n, row.len()), &Device::Cpu).unwrap();
        let draw = |cfg: &SamplingConfig| -> Vec<u32> {
            sample_on_device(&logits, cfg).unwrap().to_vec1().unwrap()
        };
        assert!(draw(&SamplingConfig::greedy()).iter().all(|&i| i == 0));
        let top1 = SamplingConfig {
            do_sample: true,
            top_k: 1,
            ..SamplingConfig::greedy()
        };
        assert!(draw(&top1).iter().all(|&i| i == 0));
        // top-k 3 at temperature 1: the softmax over the three largest.
        let cfg = SamplingConfig {
            do_sample: true,
            top_k: 3,
            ..SamplingConfig::greedy()
        };
        let ids = draw(&cfg);
        let z: f32 = row[..3].iter().map(|x| x.exp()).sum();
        for (id, &x) in row.iter().enumerate().take(3) {
            let freq = ids.iter().filter(|&&i| i == id as u32).count() as f32 / n as f32;
            assert!((freq - x.exp() / z).abs() < 0.02, "id {id}: {freq}");
        }
        assert!(ids.iter().all(|&i| i < 3));
        // top-p 0.5: the first token holds ~0.45 of the mass, so the second stays too.
        let cfg = SamplingConfig {
            do_sample: true,
            top_p: 0.5,
            ..SamplingConfig::greedy()
        };
        let ids = draw(&cfg);
        assert!(ids.iter().all(|&i| i < 2));
        assert!(ids.contains(&0) && ids.contains(&1));
        assert!(samples_on_device(&SamplingConfig::code_predictor()));
        assert!(!samples_on_device(&SamplingConfig::talker(3072, 2150)));
    }
}
