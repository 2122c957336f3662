//! Qwen3-Omni through the engine: the tiny reference checkpoint under
//! tests/fixtures/qwen3_omni/ served by its three stages (Thinker, Talker,
//! Code2Wav), streamed, and compared with the reference's whole-request
//! `generate` (scripts/qwen3_omni/generate.py): the same text and, sample for
//! sample, the same audio.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use omnistream_stages::engine::ChatMessage;
use omnistream_stages::engine::{
    Event, Modalities, Pipeline, RequestHandle, RequestInput, RequestSpec, SamplingOverrides,
};
use omnistream_stages::profile::Profile;
use omnistream_stages::roles::build_pipeline;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_omni")
}

/// The fixture checkpoint with the reference's settings: greedy Thinker (32
/// tokens), greedy Talker with its repetition penalty (33 code-0 tokens),
/// greedy code predictor; Code2Wav chunks of `first` then `chunk` frames.
fn profile(first: usize, chunk: usize, talker_extra: &str) -> Profile {
    profile_with(first, chunk, "", talker_extra)
}

/// [`profile`] with more of the Thinker's settings.
fn profile_with(first: usize, chunk: usize, thinker_extra: &str, talker_extra: &str) -> Profile {
    let dir = fixtures();
    let yaml = format!(
        r#"
name: qwen3-omni-tiny-test
async_chunk: true
stages:
  - stage_id: 0
    name: thinker
    kind: ar
    model: {{ type: qwen3-omni-thinker, path: {m}, tokenizer: {t} }}
    max_num_seqs: 4
    sampling: {{ temperature: 0.0, max_tokens: 32 }}
    {thinker_extra}
  - stage_id: 1
    name: talker
    kind: ar
    model: {{ type: qwen3-omni-talker, path: {m} }}
    max_num_seqs: 4
    sampling: {{ temperature: 0.0, repetition_penalty: 1.05, max_tokens: 33 }}
    code_predictor_sampling: {{ temperature: 0.0 }}
    {talker_extra}
  - stage_id: 2
    name: code2wav
    kind: generation
    model: {{ type: qwen3-omni-code2wav, path: {m} }}
    max_num_seqs: 4
connectors:
  - {{ from: 0, to: 1 }}
  - {{ from: 1, to: 2, initial_codec_chunk_frames: {first}, codec_chunk_frames: {chunk} }}
"#,
        m = dir.join("model").display(),
        t = dir.join("tokenizer").display(),
    );
    Profile::parse(&yaml, &dir.join("test.yaml")).expect("profile")
}

#[derive(Clone)]
struct Case {
    speaker: String,
    messages: Vec<ChatMessage>,
    audio: Option<Vec<f32>>,
    /// The reference's prompt length (one `<|audio_pad|>` per audio embedding).
    prompt_len: usize,
    tokens: Vec<u32>,
    wav: Vec<f32>,
}

fn cases() -> Vec<Case> {
    let io =
        candle_core::safetensors::load(fixtures().join("generate/io.safetensors"), &Device::Cpu)
            .unwrap();
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("generate/io.json")).unwrap(),
    )
    .unwrap();
    let ids = |t: &Tensor| -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::U32)
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    meta["cases"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let p = format!("c{i}_");
            let prompt = io[&format!("{p}input_ids")].dim(1).unwrap();
            let audio = io
                .get(&format!("{p}pcm"))
                .map(|t| t.to_vec1::<f32>().unwrap());
            let mut messages: Vec<ChatMessage> =
                serde_json::from_value(c["messages"].clone()).unwrap();
            if audio.is_some() {
                // The spoken turn is the audio itself (the placeholder message).
                messages.pop();
            }
            Case {
                speaker: c["speaker"].as_str().unwrap().to_string(),
                messages,
                audio,
                prompt_len: prompt,
                tokens: ids(&io[&format!("{p}sequences")])[prompt..].to_vec(),
                wav: io[&format!("{p}wav")].to_vec1::<f32>().unwrap(),
            }
        })
        .collect()
}

fn submit(p: &Pipeline, c: &Case, modalities: Modalities) -> RequestHandle {
    let input = match &c.audio {
        Some(a) => RequestInput::Heard {
            messages: c.messages.clone(),
            audio: Arc::from(a.as_slice()),
        },
        None => RequestInput::Chat {
            messages: c.messages.clone(),
        },
    };
    p.submit(RequestSpec {
        input,
        modalities,
        sampling: SamplingOverrides::default(),
        voice: Some(c.speaker.clone()),
        tools: None,
        style: Default::default(),
    })
    .unwrap()
}

#[derive(Default)]
struct Got {
    text: String,
    audio: Vec<f32>,
    chunks: Vec<usize>,
    rate: Option<u32>,
    done: bool,
}

fn collect(h: &RequestHandle) -> Got {
    let mut g = Got::default();
    while let Some(e) = h.next_event() {
        match e {
            Event::TextDelta(t) => g.text.push_str(&t),
            Event::Audio {
                samples,
                sample_rate,
                ..
            } => {
                g.chunks.push(samples.len());
                g.audio.extend(samples);
                g.rate = Some(sample_rate);
            }
            Event::Done { .. } => {
                g.done = true;
                break;
            }
            Event::Error(e) => panic!("request failed: {e}"),
            Event::ToolCall(c) => panic!("no tools were offered: {c:?}"),
        }
    }
    g
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Four requests at once (two voices typed, the spoken one twice: prefilled
/// together, both turns heard in one pass), streamed in small chunks: each
/// one's text and audio equal the reference's `generate` for that request
/// alone.
#[test]
fn streamed_pipeline_equals_the_reference_generate() {
    let pipeline = build_pipeline(&profile(2, 5, "")).unwrap();
    assert_eq!(pipeline.sample_rate(), Some(24_000));
    assert!(pipeline.thinker_hears());
    assert_eq!(pipeline.voices()[0], "ethan");
    let mut cases = cases();
    let spoken = cases.iter().position(|c| c.audio.is_some()).unwrap();
    cases.push(cases[spoken].clone());
    let tok = omnistream_stages::models::tokenizer::ChatTokenizer::from_hf_dir(
        &fixtures().join("tokenizer"),
    )
    .unwrap();
    let handles: Vec<RequestHandle> = cases
        .iter()
        .map(|c| submit(&pipeline, c, Modalities::TEXT_AUDIO))
        .collect();
    for (i, (c, h)) in cases.iter().zip(&handles).enumerate() {
        let got = collect(h);
        assert!(got.done);
        assert_eq!(got.rate, Some(24_000));
        assert_eq!(got.text, tok.decode(&c.tokens).unwrap(), "case {i} text");
        // 32 frames of 1920 samples: 2 + 5 + 5 + 5 + 5 + 5 + 5.
        assert_eq!(got.audio.len(), 32 * 1920, "case {i}");
        assert_eq!(got.chunks[..2], [2 * 1920, 5 * 1920]);
        let lead = 555;
        assert!(got.audio[..lead].iter().all(|&x| x == 0.0));
        let e = max_abs_diff(&got.audio[lead..], &c.wav);
        println!(
            "case {i} ({}): streamed audio vs reference max abs {e:.2e}",
            c.speaker
        );
        assert!(e <= 1e-4, "case {i}: {e}");
    }
}

/// Chunked prefill: prompts prefilled 7 tokens a step (the spoken turn's
/// `<|audio_pad|>` tokens split across chunks), the running batch decoding between
/// the chunks: every answer's text and audio still equal the reference's.
#[test]
fn prompts_prefilled_in_chunks_equal_the_reference() {
    let pipeline = build_pipeline(&profile_with(2, 5, "prefill_chunk_tokens: 7", "")).unwrap();
    let cases = cases();
    let tok = omnistream_stages::models::tokenizer::ChatTokenizer::from_hf_dir(
        &fixtures().join("tokenizer"),
    )
    .unwrap();
    // One first, so the others' chunks run between its decode steps.
    let first = submit(&pipeline, &cases[0], Modalities::TEXT_AUDIO);
    let mut handles = vec![first];
    handles.extend(
        cases[1..]
            .iter()
            .map(|c| submit(&pipeline, c, Modalities::TEXT_AUDIO)),
    );
    let text_only = submit(&pipeline, &cases[0], Modalities::TEXT);
    for (i, (c, h)) in cases.iter().zip(&handles).enumerate() {
        let got = collect(h);
        assert!(got.done);
        assert_eq!(got.text, tok.decode(&c.tokens).unwrap(), "case {i} text");
        assert_eq!(got.audio.len(), 32 * 1920, "case {i}");
        let lead = 555;
        let e = max_abs_diff(&got.audio[lead..], &c.wav);
        println!("case {i} chunked: audio vs reference max abs {e:.2e}");
        assert!(e <= 1e-4, "case {i}: {e}");
    }
    let got = collect(&text_only);
    assert_eq!(got.text, tok.decode(&cases[0].tokens).unwrap());
    assert!(got.audio.is_empty());
    // The chunks were real: each prompt takes three or more (the spoken
    // turn's 17 `<|audio_pad|>` tokens span several).
    for c in &cases {
        assert!(c.prompt_len > 14, "a prompt of {} tokens", c.prompt_len);
    }
}

/// Text-only requests stop at the Thinker; unknown voices and a Thinker-less
/// route are refused with clear errors; the pipeline keeps serving.
#[test]
fn modalities_voices_and_bad_requests() {
    let pipeline = build_pipeline(&profile(4, 25, "")).unwrap();
    let cases = cases();
    let c = &cases[1];
    let h = submit(&pipeline, c, Modalities::TEXT);
    let got = collect(&h);
    assert!(got.done && got.audio.is_empty());
    assert!(!got.text.is_empty());

    // An unknown voice fails the request at the Talker, naming the voices.
    let mut bad = submit_voice(&pipeline, c, "joe");
    let err = loop {
        match bad.next_event() {
            Some(Event::Error(e)) => break e,
            Some(_) => continue,
            None => panic!("no error for an unknown voice"),
        }
    };
    assert!(
        err.contains("unknown voice") && err.contains("chelsie"),
        "{err}"
    );
    bad = submit(&pipeline, c, Modalities::TEXT_AUDIO);
    let got = collect(&bad);
    assert_eq!(got.audio.len(), 32 * 1920);

    // Empty audio is refused before it reaches a stage.
    let err = pipeline
        .submit(RequestSpec {
            input: RequestInput::Heard {
                messages: vec![],
                audio: Arc::from(Vec::<f32>::new()),
            },
            modalities: Modalities::TEXT_AUDIO,
            sampling: SamplingOverrides::default(),
            voice: None,
            tools: None,
            style: Default::default(),
        })
        .err()
        .unwrap();
    assert!(err.to_string().contains("no audio"), "{err}");
    // Speech too short for the encoder is a clear error.
    let short = pipeline
        .submit(RequestSpec {
            input: RequestInput::Heard {
                messages: vec![],
                audio: Arc::from(vec![0.1f32; 100]),
            },
            modalities: Modalities::TEXT_AUDIO,
            sampling: SamplingOverrides::default(),
            voice: None,
            tools: None,
            style: Default::default(),
        })
        .unwrap();
    let err = loop {
        match short.next_event() {
            Some(Event::Error(e)) => break e,
            Some(Event::Done { .. }) | None => panic!("no error for 100 samples of speech"),
            Some(_) => continue,
        }
    };
    assert!(
        err.contains("thinker") && err.contains("too short"),
        "{err}"
    );
}

fn submit_voice(p: &Pipeline, c: &Case, voice: &str) -> RequestHandle {
    p.submit(RequestSpec {
        input: RequestInput::Chat {
            messages: c.messages.clone(),
        },
        modalities: Modalities::TEXT_AUDIO,
        sampling: SamplingOverrides::default(),
        voice: Some(voice.to_string()),
        tools: None,
        style: Default::default(),
    })
    .unwrap()
}

/// Broken profiles name the key at fault.
#[test]
fn broken_qwen3_profiles_are_clear_errors() {
    let dir = fixtures();
    let bad = |yaml: String| {
        Profile::parse(&yaml, &dir.join("bad.yaml"))
            .unwrap_err()
            .to_string()
    };
    let stage = |model: &str, extra: &str| {
        format!(
            "name: x\nasync_chunk: true\nstages:\n  - stage_id: 0\n    name: thinker\n    kind: ar\n    model: {model}\n    max_num_seqs: 1\n{extra}"
        )
    };
    let e = bad(stage(
        "{ type: qwen3-omni-thinker, path: /nonexistent }",
        "",
    ));
    assert!(
        e.contains("stages[0].model.path") && e.contains("config.json"),
        "{e}"
    );
    let e = bad(stage(
        &format!(
            "{{ type: qwen3-omni-thinker, path: {} }}",
            dir.join("model").display()
        ),
        "",
    ));
    assert!(
        e.contains("model.tokenizer") && e.contains("tokenizer.json"),
        "{e}"
    );
    let e = bad(stage(
        &format!(
            "{{ type: qwen3-omni-thinker, path: {}, tokenizer: {} }}",
            dir.join("model").display(),
            dir.join("tokenizer").display()
        ),
        "    voice: ethan\n",
    ));
    assert!(e.contains("stages[0].voice"), "{e}");
    let e = bad(stage(
        &format!(
            "{{ type: qwen3-omni-thinker, path: {}, dtype: f16 }}",
            dir.join("model").display()
        ),
        "",
    ));
    assert!(e.contains("dtype") || e.contains("f16"), "{e}");
    let thinker = format!(
        "{{ type: qwen3-omni-thinker, path: {}, tokenizer: {} }}",
        dir.join("model").display(),
        dir.join("tokenizer").display()
    );
    let e = bad(stage(&thinker, "    prefill_chunk_tokens: 0\n"));
    assert!(
        e.contains("stages[0].prefill_chunk_tokens") && e.contains("at least 1"),
        "{e}"
    );
    let e = bad(stage(
        &format!(
            "{{ type: qwen3-omni-talker, path: {} }}",
            dir.join("model").display()
        ),
        "    prefill_chunk_tokens: 64\n",
    ));
    assert!(
        e.contains("prefill_chunk_tokens") && e.contains("Qwen3-Omni Thinker only"),
        "{e}"
    );
}

/// Fixed-length answers (`ignore_eos`) speak one frame per text vector, or
/// exactly `audio_frames`: past the text on `tts_pad`, or cut before its end,
/// and then the request still ends only with the whole text (its `Done` waits
/// for the Thinker, not only for the last stage).
#[test]
fn fixed_length_answers_speak_the_frames_asked_for() {
    let pipeline = build_pipeline(&profile(1, 4, "")).unwrap();
    let c = &cases()[0];
    let run = |tokens: usize, frames: Option<usize>| {
        let h = pipeline
            .submit(RequestSpec {
                input: RequestInput::Chat {
                    messages: c.messages.clone(),
                },
                modalities: Modalities::TEXT_AUDIO,
                sampling: SamplingOverrides {
                    max_tokens: Some(tokens),
                    ignore_eos: true,
                    audio_frames: frames,
                    ..Default::default()
                },
                voice: Some(c.speaker.clone()),
                tools: None,
                style: Default::default(),
            })
            .unwrap();
        let mut tokens = None;
        let mut audio = 0;
        while let Some(e) = h.next_event() {
            match e {
                Event::Audio { samples, .. } => audio += samples.len(),
                Event::Done {
                    completion_tokens, ..
                } => {
                    tokens = Some(completion_tokens);
                    break;
                }
                Event::Error(e) => panic!("request failed: {e}"),
                Event::TextDelta(_) | Event::ToolCall(_) => {}
            }
        }
        (tokens, audio)
    };
    // One frame per text vector the Talker got: the Thinker sends a token's
    // embedding as it reads the token, and the last of six is never read.
    assert_eq!(run(6, None), (Some(6), 5 * 1920));
    assert_eq!(run(6, Some(20)), (Some(6), 20 * 1920));
    // Speech over after two frames, long before the Thinker's 30th token.
    assert_eq!(run(30, Some(2)), (Some(30), 2 * 1920));
}
