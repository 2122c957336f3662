//! The real tiny pipeline (SmolLM2 + Piper), end to end through the engine.
//! Needs the models (`omnistream fetch-models`) and espeak-ng.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use omnistream_stages::engine::{ChatMessage, ToolCall, ToolChoice, Tools};
use omnistream_stages::engine::{
    Event, Modalities, Pipeline, RequestHandle, RequestInput, RequestSpec, SamplingOverrides,
    StageDef, StageRole,
};
use omnistream_stages::models::piper::PiperVoice;
use omnistream_stages::profile::Profile;
use omnistream_stages::roles::{
    build_pipeline, ChunkPolicy, PiperCode2Wav, PiperTalker, SpanPolicy,
};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The profile's Thinker stage (after the Listener in the default profile).
fn thinker(pr: &mut Profile) -> &mut omnistream_stages::profile::StageSpec {
    pr.stages
        .iter_mut()
        .find(|s| s.name == "thinker")
        .expect("a thinker stage")
}

fn profile() -> Profile {
    Profile::load(&root().join("deploy/tiny-cpu.yaml"))
        .expect("deploy/tiny-cpu.yaml (run `omnistream fetch-models` first)")
}

fn voice() -> Arc<PiperVoice> {
    let dir = root().join("models/piper-joe");
    Arc::new(
        PiperVoice::load(
            &dir.join("en_US-joe-medium.onnx"),
            &dir.join("en_US-joe-medium.onnx.json"),
            &Device::Cpu,
        )
        .expect("Piper voice (run `omnistream fetch-models` first)"),
    )
}

#[derive(Debug, Default)]
struct Got {
    text: String,
    audio: Vec<f32>,
    /// Order of arrival: 't' text delta, 'a' audio chunk.
    order: String,
    error: Option<String>,
    cached_tokens: usize,
    calls: Vec<ToolCall>,
}

fn collect(h: &RequestHandle) -> Got {
    let mut g = Got::default();
    loop {
        match h.events().recv_timeout(Duration::from_secs(120)) {
            Ok(Event::TextDelta(t)) => {
                g.text.push_str(&t);
                g.order.push('t');
            }
            Ok(Event::Audio { samples, .. }) => {
                g.audio.extend(samples);
                g.order.push('a');
            }
            Ok(Event::ToolCall(c)) => {
                g.calls.push(c);
                g.order.push('c');
            }
            Ok(Event::Done { cached_tokens, .. }) => {
                g.cached_tokens = cached_tokens;
                return g;
            }
            Ok(Event::Error(e)) => {
                g.error = Some(e);
                return g;
            }
            Err(e) => panic!("no event for 120 s: {e}"),
        }
    }
}

fn chat(prompt: &str, max_tokens: usize) -> RequestSpec {
    RequestSpec {
        input: RequestInput::Chat {
            messages: vec![ChatMessage::user(prompt)],
        },
        modalities: Modalities::TEXT_AUDIO,
        sampling: SamplingOverrides {
            max_tokens: Some(max_tokens),
            ..Default::default()
        },
        voice: None,
        tools: None,
        style: Default::default(),
    }
}

fn speech(text: &str) -> RequestSpec {
    RequestSpec {
        input: RequestInput::Speech { text: text.into() },
        modalities: Modalities::TEXT_AUDIO,
        sampling: SamplingOverrides {
            seed: Some(7),
            ..Default::default()
        },
        voice: None,
        tools: None,
        style: Default::default(),
    }
}

fn wait_idle(p: &Pipeline) {
    let t0 = Instant::now();
    while p.stats().stages.iter().any(|s| s.active > 0) {
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", p.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Talker + Code2Wav only, with the given decoder policy.
fn tts(voice: &Arc<PiperVoice>, policy: ChunkPolicy) -> Pipeline {
    let scales = voice.config().default_scales.clone();
    let talker = PiperTalker::new(
        voice.clone(),
        "joe".into(),
        scales,
        Some(1),
        SpanPolicy {
            async_chunk: true,
            min_span_chars: 12,
            max_span_tokens: 24,
            initial_span_tokens: 24,
        },
        2,
    )
    .unwrap();
    Pipeline::start(
        vec![
            StageDef::local("talker", StageRole::Talker, Box::new(talker), 16),
            StageDef::local(
                "code2wav",
                StageRole::Code2Wav,
                Box::new(PiperCode2Wav::new(voice.clone(), policy, 2)),
                16,
            ),
        ],
        Some(voice.sample_rate()),
    )
    .unwrap()
}

const TEXT: &str =
    "Streaming must not change a single sample. The decoder keeps its state, chunk after chunk!";

#[test]
fn streamed_audio_equals_one_shot_for_every_chunk_policy() {
    let v = voice();
    let one_shot = {
        let p = tts(
            &v,
            ChunkPolicy {
                async_chunk: false,
                initial_frames: 1,
                chunk_frames: 1,
                left_context_frames: 0,
                ramp: false,
            },
        );
        collect(&p.submit(speech(TEXT)).unwrap()).audio
    };
    assert!(
        one_shot.len() > v.sample_rate() as usize,
        "too little audio"
    );
    assert_eq!(
        one_shot.len() % v.hop_length(),
        0,
        "not a whole number of frames"
    );
    for (initial, chunk, ramp) in [
        (1, 25, false),
        (1, 1, false),
        (4, 25, false),
        (7, 3, false),
        (100_000, 100_000, false),
        (1, 8, true),
        (3, 25, true),
    ] {
        let p = tts(
            &v,
            ChunkPolicy {
                async_chunk: true,
                initial_frames: initial,
                chunk_frames: chunk,
                left_context_frames: 0,
                ramp,
            },
        );
        let g = collect(&p.submit(speech(TEXT)).unwrap());
        assert_eq!(g.error, None);
        assert_eq!(
            g.audio.len(),
            one_shot.len(),
            "policy ({initial}, {chunk}): sample count"
        );
        let max = g
            .audio
            .iter()
            .zip(&one_shot)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(max <= 1e-4, "policy ({initial}, {chunk}): max |diff| {max}");
        let chunks = g.order.matches('a').count();
        if initial == 1 && chunk == 1 {
            assert!(chunks > 50, "chunk size 1 gave only {chunks} chunks");
        }
        wait_idle(&p);
    }
}

#[test]
fn left_context_redecode_is_what_state_avoids() {
    // The reference-style decoder (re-decode with left context, no state) keeps the
    // length but not the samples: the knob changes behaviour, and shows why.
    let v = voice();
    let policy = |left| ChunkPolicy {
        async_chunk: true,
        initial_frames: 4,
        chunk_frames: 10,
        left_context_frames: left,
        ramp: false,
    };
    let exact = collect(&tts(&v, policy(0)).submit(speech(TEXT)).unwrap()).audio;
    let windowed = collect(&tts(&v, policy(4)).submit(speech(TEXT)).unwrap()).audio;
    assert_eq!(exact.len(), windowed.len());
    let max = exact
        .iter()
        .zip(&windowed)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        max > 1e-3,
        "re-decoding with 4 frames of context was exact ({max})?"
    );
}

#[test]
fn chat_answers_in_text_and_speech() {
    let p = build_pipeline(&profile()).unwrap();
    let g = collect(
        &p.submit(chat("What is the capital of France?", 40))
            .unwrap(),
    );
    assert_eq!(g.error, None);
    assert!(g.text.contains("Paris"), "answer: {}", g.text);
    // Roughly 60 ms of audio per character at least: real speech, not a blip.
    assert!(
        g.audio.len() as f64 / 22050.0 > 0.04 * g.text.len() as f64,
        "{} samples for {:?}",
        g.audio.len(),
        g.text
    );
    let peak = g.audio.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    assert!(peak > 0.05 && peak <= 1.0, "peak {peak}");
    wait_idle(&p);
}

#[test]
fn a_tool_call_reaches_the_client_and_is_never_spoken() {
    let p = build_pipeline(&profile()).unwrap();
    let tools = Arc::new(Tools {
        functions: vec![serde_json::json!({"type": "function", "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }})],
        choice: ToolChoice::Function("get_weather".into()),
    });
    let mut spec = chat("What is the weather in Paris?", 60);
    spec.sampling.temperature = Some(0.0);
    spec.tools = Some(tools);
    let g = collect(&p.submit(spec).unwrap());
    assert_eq!(g.error, None);
    assert_eq!(g.calls.len(), 1, "{:?}", g.order);
    assert_eq!(g.calls[0].function.name, "get_weather");
    let args: serde_json::Value = serde_json::from_str(&g.calls[0].function.arguments).unwrap();
    assert!(args.is_object(), "{args}");
    // The answer was the call: no words, and nothing for the voice to say.
    assert_eq!((g.text.as_str(), g.audio.len()), ("", 0), "{:?}", g.order);
    wait_idle(&p);
}

#[test]
fn async_chunk_speaks_before_the_thinker_is_done_and_sync_does_not() {
    let prompt = "Tell me a short story about a cat, in three sentences.";
    let mut pr = profile();
    pr.async_chunk = true;
    let on = build_pipeline(&pr).unwrap();
    let g = collect(&on.submit(chat(prompt, 80)).unwrap());
    assert_eq!(g.error, None);
    let first_audio = g.order.find('a').expect("no audio");
    let last_text = g.order.rfind('t').unwrap();
    assert!(
        first_audio < last_text,
        "async_chunk on: audio only after all text ({})",
        g.order
    );
    drop(on);
    pr.async_chunk = false;
    let off = build_pipeline(&pr).unwrap();
    let g = collect(&off.submit(chat(prompt, 80)).unwrap());
    assert_eq!(g.error, None);
    let first_audio = g.order.find('a').expect("no audio");
    assert!(
        !g.order[first_audio..].contains('t'),
        "async_chunk off: text after audio ({})",
        g.order
    );
    assert_eq!(g.order.matches('a').count(), 1, "sync decode is one chunk");
}

#[test]
fn max_num_seqs_and_span_knobs_change_behaviour() {
    let mut pr = profile();
    // Batching: 4 concurrent text requests share Thinker steps unless max_num_seqs is 1.
    let mean_batch = |pr: &Profile| {
        let p = build_pipeline(pr).unwrap();
        let hs: Vec<_> = (0..4)
            .map(|i| {
                let mut s = chat(&format!("Count from {i} to {}.", i + 5), 16);
                s.modalities = Modalities::TEXT;
                p.submit(s).unwrap()
            })
            .collect();
        for h in &hs {
            assert_eq!(collect(h).error, None);
        }
        let stats = p.stats();
        let t = stats
            .stages
            .iter()
            .find(|s| s.name == "thinker")
            .expect("a thinker stage");
        t.batch_items_total as f64 / t.steps as f64
    };
    thinker(&mut pr).max_num_seqs = 1;
    assert_eq!(mean_batch(&pr), 1.0);
    thinker(&mut pr).max_num_seqs = 8;
    assert!(mean_batch(&pr) > 1.5);

    // Span policy: a huge min_span_chars leaves one span per sentence-final flush.
    let talker_steps = |min_span: usize| {
        let mut pr = profile();
        pr.connectors[0].min_span_chars = Some(min_span);
        pr.connectors[0].max_span_tokens = Some(10_000);
        let p = build_pipeline(&pr).unwrap();
        let mut s = chat("Say: one, two, three, four, five, six.", 40);
        s.sampling.seed = Some(1);
        assert_eq!(collect(&p.submit(s).unwrap()).error, None);
        p.stats()
            .stages
            .iter()
            .find(|s| s.name == "talker")
            .expect("a talker stage")
            .steps
    };
    assert!(talker_steps(2) > talker_steps(100_000));
}

#[test]
fn cancelling_mid_answer_frees_every_stage() {
    let p = build_pipeline(&profile()).unwrap();
    let h = p
        .submit(chat(
            "Write a long story about the sea, with many details.",
            200,
        ))
        .unwrap();
    // Wait until audio flows: the request is in every stage.
    loop {
        match h.events().recv_timeout(Duration::from_secs(60)).unwrap() {
            Event::Audio { .. } => break,
            Event::Done { .. } | Event::Error(_) => panic!("ended before cancel"),
            _ => {}
        }
    }
    drop(h);
    wait_idle(&p);
    let s = p.stats();
    assert!(s.stages.iter().any(|st| st.cancelled > 0), "{s:?}");
    assert_eq!(s.requests_in_flight, 0);
    // Still healthy.
    assert_eq!(
        collect(&p.submit(speech("Still here.")).unwrap()).error,
        None
    );
}

#[test]
fn bad_input_gets_a_clear_error_or_sensible_audio() {
    let p = build_pipeline(&profile()).unwrap();
    let e = p.submit(speech("")).err().expect("empty text accepted");
    assert!(e.to_string().contains("empty"), "{e}");
    let e = p
        .submit(speech(&"a".repeat(10_000)))
        .err()
        .expect("10k chars accepted");
    assert!(e.to_string().contains("limit"), "{e}");
    for odd in ["?!...", "🙂🙂🙂", "—", "\u{0}\u{1}"] {
        let g = collect(&p.submit(speech(odd)).unwrap());
        assert_eq!(g.error, None, "{odd:?}");
        assert!(g.audio.iter().all(|x| x.is_finite() && x.abs() <= 1.0));
    }
    let mut s = speech("hello");
    s.voice = Some("nobody".into());
    let g = collect(&p.submit(s).unwrap());
    assert!(g.error.unwrap_or_default().contains("unknown voice"));
    let mut s = speech("hello");
    s.sampling.speed = Some(100.0);
    assert!(collect(&p.submit(s).unwrap()).error.is_some());
    // A long chat prompt is prefilled in chunks and still answered.
    let g = collect(
        &p.submit(chat(&"Tell me about the weather. ".repeat(300), 8))
            .unwrap(),
    );
    assert_eq!(g.error, None);
    wait_idle(&p);
}

#[test]
fn prefix_cache_reuses_kv_without_changing_the_answer() {
    let question = "What is the capital of France?";
    let run = |entries: usize| {
        let mut pr = profile();
        thinker(&mut pr).prefix_cache_entries = Some(entries);
        let p = build_pipeline(&pr).unwrap();
        let mut s = chat(question, 12);
        s.modalities = Modalities::TEXT;
        let a = collect(&p.submit(s.clone()).unwrap());
        let b = collect(&p.submit(s).unwrap());
        assert_eq!(a.error, None);
        assert_eq!(b.error, None);
        (a, b)
    };
    let (a, b) = run(4);
    assert_eq!(a.cached_tokens, 0);
    assert!(b.cached_tokens > 10, "cached {}", b.cached_tokens);
    assert_eq!(a.text, b.text, "prefix caching changed the answer");
    let (c, d) = run(0);
    assert_eq!(c.cached_tokens + d.cached_tokens, 0);
    assert_eq!(c.text, a.text);
}

#[test]
fn initial_span_tokens_starts_speech_earlier() {
    // Text deltas that arrive before the first audio chunk.
    let deltas_before_audio = |initial: usize| {
        let mut pr = profile();
        pr.connectors[0].min_span_chars = Some(10_000);
        pr.connectors[0].max_span_tokens = Some(10_000);
        pr.connectors[0].initial_span_tokens = Some(initial);
        let p = build_pipeline(&pr).unwrap();
        let g = collect(
            &p.submit(chat("Describe the ocean in two sentences.", 40))
                .unwrap(),
        );
        assert_eq!(g.error, None);
        g.order.find('a').expect("no audio")
    };
    let early = deltas_before_audio(3);
    let late = deltas_before_audio(10_000);
    assert!(early < late, "first audio after {early} deltas vs {late}");
}
