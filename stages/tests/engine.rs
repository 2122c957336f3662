//! The engine with small deterministic stages: routing, interleaving, batching,
//! cancellation, slow clients. (The real models are tested in their own files.)

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use omnistream_stages::engine::ChatMessage;
use omnistream_stages::engine::{
    CancelReason, Event, FrameChunk, Modalities, Payload, Pipeline, RequestCtx, RequestId,
    RequestInput, RequestSpec, SamplingOverrides, StageDef, StageModel, StagePlacement, StageRole,
    StepOutput, TextChunk,
};
use omnistream_stages::models::{ModelError, Result};

/// Thinker: answers with the words of the last message, one per step.
struct WordThinker {
    max: usize,
    reqs: HashMap<RequestId, (Arc<RequestCtx>, Vec<String>)>,
}

impl StageModel for WordThinker {
    fn admit(&mut self, ctx: Arc<RequestCtx>) -> Result<()> {
        let RequestInput::Chat { messages } = &ctx.spec.input else {
            return Err(ModelError::Invalid("chat only".into()));
        };
        let words: Vec<String> = messages
            .last()
            .map(|m| {
                m.content
                    .split_whitespace()
                    .rev()
                    .map(|w| format!("{w} "))
                    .collect()
            })
            .unwrap_or_default();
        if words.is_empty() {
            return Err(ModelError::Invalid("empty".into()));
        }
        self.reqs.insert(ctx.id, (ctx, words));
        Ok(())
    }
    fn push(&mut self, _: RequestId, _: Payload) -> Result<()> {
        Err(ModelError::Invalid("no input".into()))
    }
    fn step(&mut self, out: &mut StepOutput) {
        // A real decode step takes time; cancellation must land mid-answer.
        std::thread::sleep(Duration::from_millis(1));
        let ids: Vec<RequestId> = self.reqs.keys().copied().take(self.max).collect();
        out.batch = ids.len();
        for id in ids {
            let (ctx, words) = self.reqs.get_mut(&id).unwrap();
            let w = words.pop().unwrap();
            ctx.emit(Event::TextDelta(w.clone()));
            ctx.add_completion_tokens(1);
            let finished = words.is_empty();
            out.downstream
                .push((id, Payload::Text(TextChunk::text(w, vec![], finished))));
            if finished {
                self.reqs.remove(&id);
                out.finished.push(id);
            }
        }
    }
    fn remove(&mut self, id: RequestId) {
        self.reqs.remove(&id);
    }
    fn has_ready_work(&self) -> bool {
        !self.reqs.is_empty()
    }
    fn active(&self) -> usize {
        self.reqs.len()
    }
}

/// Talker: one frame per character of text, sent when the text is finished.
#[derive(Default)]
struct CharTalker {
    reqs: HashMap<RequestId, (String, bool)>,
}

impl StageModel for CharTalker {
    fn admit(&mut self, ctx: Arc<RequestCtx>) -> Result<()> {
        self.reqs.insert(ctx.id, (String::new(), false));
        Ok(())
    }
    fn push(&mut self, id: RequestId, p: Payload) -> Result<()> {
        let Payload::Text(t) = p else {
            return Err(ModelError::Invalid("text only".into()));
        };
        if let Some(r) = self.reqs.get_mut(&id) {
            r.0.push_str(&t.text);
            r.1 |= t.finished;
        }
        Ok(())
    }
    fn step(&mut self, out: &mut StepOutput) {
        let ready: Vec<RequestId> = self.reqs.iter().filter(|r| r.1 .1).map(|r| *r.0).collect();
        out.batch = ready.len();
        for id in ready {
            let (text, _) = self.reqs.remove(&id).unwrap();
            let n = text.chars().count();
            let frames = Tensor::ones((1, 2, n), candle_core::DType::F32, &Device::Cpu).ok();
            out.downstream.push((
                id,
                Payload::Frames(FrameChunk {
                    frames,
                    finished: true,
                }),
            ));
            out.finished.push(id);
        }
    }
    fn remove(&mut self, id: RequestId) {
        self.reqs.remove(&id);
    }
    fn has_ready_work(&self) -> bool {
        self.reqs.values().any(|r| r.1)
    }
    fn active(&self) -> usize {
        self.reqs.len()
    }
}

/// Code2Wav: 10 samples per frame, 3 frames per step.
#[derive(Default)]
struct SlowDecoder {
    reqs: HashMap<RequestId, (Arc<RequestCtx>, usize, bool, u64)>,
    /// Where set: each admitted request's route.
    routes: Option<Arc<std::sync::Mutex<Vec<Vec<u64>>>>>,
}

impl StageModel for SlowDecoder {
    fn admit(&mut self, ctx: Arc<RequestCtx>) -> Result<()> {
        if let Some(r) = &self.routes {
            r.lock().unwrap().push(ctx.route.clone());
        }
        self.reqs.insert(ctx.id, (ctx, 0, false, 0));
        Ok(())
    }
    fn push(&mut self, id: RequestId, p: Payload) -> Result<()> {
        let Payload::Frames(f) = p else {
            return Err(ModelError::Invalid("frames only".into()));
        };
        if let Some(r) = self.reqs.get_mut(&id) {
            r.1 += f.len();
            r.2 |= f.finished;
        }
        Ok(())
    }
    fn step(&mut self, out: &mut StepOutput) {
        let ids: Vec<RequestId> = self.reqs.keys().copied().collect();
        for id in ids {
            let r = self.reqs.get_mut(&id).unwrap();
            if r.1 == 0 && !r.2 {
                continue;
            }
            out.batch += 1;
            let n = r.1.min(3);
            r.1 -= n;
            if n > 0 {
                r.0.emit(Event::Audio {
                    samples: vec![0.1; n * 10],
                    sample_rate: 100,
                    seq: r.3,
                });
                r.3 += 1;
            }
            std::thread::sleep(Duration::from_millis(2));
            if r.1 == 0 && r.2 {
                self.reqs.remove(&id);
                out.finished.push(id);
            }
        }
    }
    fn remove(&mut self, id: RequestId) {
        self.reqs.remove(&id);
    }
    fn has_ready_work(&self) -> bool {
        self.reqs.values().any(|r| r.1 > 0 || r.2)
    }
    fn active(&self) -> usize {
        self.reqs.len()
    }
}

fn pipeline(max_seqs: usize) -> Pipeline {
    Pipeline::start(
        vec![
            StageDef::local(
                "thinker",
                StageRole::Thinker,
                Box::new(WordThinker {
                    max: max_seqs,
                    reqs: HashMap::new(),
                }),
                64,
            ),
            StageDef::local("talker", StageRole::Talker, Box::<CharTalker>::default(), 4),
            StageDef::local(
                "code2wav",
                StageRole::Code2Wav,
                Box::<SlowDecoder>::default(),
                4,
            ),
        ],
        Some(100),
    )
    .unwrap()
}

fn chat(text: &str, modalities: Modalities) -> RequestSpec {
    RequestSpec {
        input: RequestInput::Chat {
            messages: vec![ChatMessage::user(text)],
        },
        modalities,
        sampling: SamplingOverrides::default(),
        voice: None,
        tools: None,
        style: Default::default(),
    }
}

/// Reads events until Done or Error.
fn collect(h: &omnistream_stages::engine::RequestHandle) -> (String, usize, Option<String>) {
    let mut text = String::new();
    let mut samples = 0;
    loop {
        match h.events().recv_timeout(Duration::from_secs(10)) {
            Ok(Event::TextDelta(t)) => text.push_str(&t),
            Ok(Event::Audio { samples: s, .. }) => samples += s.len(),
            Ok(Event::Done { .. }) => return (text, samples, None),
            Ok(Event::Error(e)) => return (text, samples, Some(e)),
            Ok(Event::ToolCall(c)) => panic!("no tools were offered: {c:?}"),
            Err(e) => panic!("no event for 10 s: {e}"),
        }
    }
}

/// Submits every prompt at once (text and audio), then checks that each
/// answer is its own: its words, and audio for exactly its characters.
fn submit_all_and_check(
    p: &Pipeline,
    prompts: &[String],
) -> Vec<omnistream_stages::engine::RequestHandle> {
    let handles: Vec<_> = prompts
        .iter()
        .map(|t| p.submit(chat(t, Modalities::TEXT_AUDIO)).unwrap())
        .collect();
    for (h, prompt) in handles.iter().zip(prompts) {
        let (text, samples, err) = collect(h);
        assert_eq!(err, None);
        assert_eq!(text.trim_end(), prompt);
        assert_eq!(samples, (prompt.len() + 1) * 10, "{prompt}");
    }
    handles
}

fn wait_idle(p: &Pipeline) {
    let t0 = Instant::now();
    while p.stats().stages.iter().any(|s| s.active > 0) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "stages still hold requests: {:?}",
            p.stats()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn text_route_stops_at_the_thinker() {
    let p = pipeline(4);
    let h = p.submit(chat("one two three", Modalities::TEXT)).unwrap();
    let (text, samples, err) = collect(&h);
    assert_eq!(err, None);
    assert_eq!(text, "one two three ");
    assert_eq!(samples, 0);
    drop(h);
    wait_idle(&p);
    let s = p.stats();
    assert_eq!(s.stages[1].finished + s.stages[2].finished, 0, "{s:?}");
}

#[test]
fn audio_route_runs_every_stage_and_frees_state() {
    let p = pipeline(4);
    let h = p
        .submit(chat("hello there", Modalities::TEXT_AUDIO))
        .unwrap();
    let (text, samples, err) = collect(&h);
    assert_eq!(err, None);
    assert_eq!(text, "hello there ");
    assert_eq!(samples, "hello there ".len() * 10);
    drop(h);
    wait_idle(&p);
    assert_eq!(p.stats().requests_in_flight, 0);
}

#[test]
fn concurrent_requests_interleave_batch_and_do_not_mix() {
    let p = pipeline(8);
    let prompts: Vec<String> = (0..12)
        .map(|i| {
            (0..5)
                .map(|j| format!("r{i}w{j}"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    let handles = submit_all_and_check(&p, &prompts);
    let s = p.stats();
    let thinker = &s.stages[0];
    assert!(
        thinker.batch_items_total as f64 / thinker.steps as f64 > 2.0,
        "requests did not share steps: {thinker:?}"
    );
    drop(handles);
    wait_idle(&p);
}

#[test]
fn dropping_a_handle_cancels_in_every_stage() {
    let p = pipeline(4);
    // Long answers so the request is mid-flight in several stages.
    let long: String = (0..400).map(|i| format!("w{i} ")).collect();
    let h = p.submit(chat(&long, Modalities::TEXT_AUDIO)).unwrap();
    let first = h.events().recv_timeout(Duration::from_secs(5)).unwrap();
    assert!(matches!(first, Event::TextDelta(_)));
    drop(h);
    wait_idle(&p);
    let s = p.stats();
    assert!(s.stages[0].cancelled >= 1, "{s:?}");
    assert_eq!(s.stages[0].finished, 0, "thinker ran to the end: {s:?}");
    // The pipeline still serves others.
    let h2 = p
        .submit(chat("still alive", Modalities::TEXT_AUDIO))
        .unwrap();
    assert_eq!(collect(&h2).2, None);
}

#[test]
fn a_client_that_stops_reading_is_dropped_and_others_go_on() {
    let mut p = pipeline(4);
    p.set_event_capacity(16);
    let long: String = (0..300).map(|i| format!("w{i} ")).collect();
    let stuck = p.submit(chat(&long, Modalities::TEXT_AUDIO)).unwrap();
    let ok = p
        .submit(chat("short answer", Modalities::TEXT_AUDIO))
        .unwrap();
    assert_eq!(collect(&ok).2, None);
    let t0 = Instant::now();
    while stuck.cancel_reason() != CancelReason::SlowClient {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "slow client never dropped"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The stuck client finds the reason at the end of its queue.
    let mut last = None;
    while let Ok(e) = stuck.events().try_recv() {
        last = Some(e);
    }
    assert!(
        matches!(last, Some(Event::Error(ref m)) if m.contains("too slow")),
        "{last:?}"
    );
    wait_idle(&p);
}

#[test]
fn bad_requests_are_refused_or_fail_cleanly() {
    let p = pipeline(4);
    let empty = RequestSpec {
        input: RequestInput::Chat { messages: vec![] },
        ..chat("x", Modalities::TEXT)
    };
    assert!(p.submit(empty).is_err());
    // Admission error in the stage: the client gets an error event.
    let h = p.submit(chat("   ", Modalities::TEXT_AUDIO)).unwrap();
    let (_, _, err) = collect(&h);
    assert!(err.unwrap().contains("empty"));
    let speech_text_only = RequestSpec {
        input: RequestInput::Speech { text: "hi".into() },
        ..chat("x", Modalities::TEXT)
    };
    assert!(p.submit(speech_text_only).is_err());
    assert!(Modalities::from_names(&["video"]).is_err());
    assert!(Modalities::from_names::<&str>(&[]).is_err());
    assert_eq!(
        Modalities::from_names(&["audio"]).unwrap(),
        Modalities::TEXT_AUDIO
    );
}

/// Two replicas of the Talker and of Code2Wav: concurrent requests spread
/// over both (least loaded), each request's payloads stay on its replica (a
/// payload sent to the other would be dropped there, and its request would
/// never finish), and every answer is its own.
#[test]
fn replicas_share_requests_and_keep_each_on_its_own() {
    let two = |m: fn() -> Box<dyn StageModel>| StagePlacement::Local {
        replicas: vec![m(), m()],
        input_capacity: 4,
        devices: Vec::new(),
    };
    let p = Pipeline::start(
        vec![
            StageDef::local(
                "thinker",
                StageRole::Thinker,
                Box::new(WordThinker {
                    max: 8,
                    reqs: HashMap::new(),
                }),
                64,
            ),
            StageDef {
                name: "talker".into(),
                role: StageRole::Talker,
                placement: two(|| Box::<CharTalker>::default()),
            },
            StageDef {
                name: "code2wav".into(),
                role: StageRole::Code2Wav,
                placement: two(|| Box::<SlowDecoder>::default()),
            },
        ],
        Some(100),
    )
    .unwrap();
    let prompts: Vec<String> = (0..12)
        .map(|i| vec![format!("q{i}"); 1 + i % 5].join(" "))
        .collect();
    let handles = submit_all_and_check(&p, &prompts);
    drop(handles);
    wait_idle(&p);
    let s = p.stats();
    for stage in ["talker", "code2wav"] {
        let reps: Vec<_> = s.replicas.iter().filter(|r| r.name == stage).collect();
        assert_eq!(reps.len(), 2, "{s:?}");
        assert!(
            reps.iter().all(|r| r.finished >= 3),
            "{stage} not spread: {reps:?}"
        );
        assert_eq!(reps.iter().map(|r| r.finished).sum::<u64>(), 12);
        let total = s.stages.iter().find(|t| t.name == stage).unwrap();
        assert_eq!(total.finished, 12, "the stage's sum over its replicas");
    }
}

/// Whole pipelines replicated, a GPU each, in one process: a request's
/// Talker and Code2Wav are the replicas on its Thinker's device (listed in
/// another order on each stage), and the Thinkers share the load.
#[test]
fn each_request_stays_on_its_thinkers_device() {
    let devices = |d: &[&str]| d.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let routes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let decoder = || -> Box<dyn StageModel> {
        Box::new(SlowDecoder {
            reqs: HashMap::new(),
            routes: Some(routes.clone()),
        })
    };
    let thinker = || -> Box<dyn StageModel> {
        Box::new(WordThinker {
            max: 8,
            reqs: HashMap::new(),
        })
    };
    let p = Pipeline::start(
        vec![
            StageDef {
                name: "thinker".into(),
                role: StageRole::Thinker,
                placement: StagePlacement::Local {
                    replicas: vec![thinker(), thinker()],
                    input_capacity: 64,
                    devices: devices(&["cuda:0", "cuda:1"]),
                },
            },
            StageDef {
                name: "talker".into(),
                role: StageRole::Talker,
                placement: StagePlacement::Local {
                    replicas: vec![Box::<CharTalker>::default(), Box::<CharTalker>::default()],
                    input_capacity: 4,
                    devices: devices(&["cuda:1", "cuda:0"]),
                },
            },
            StageDef {
                name: "code2wav".into(),
                role: StageRole::Code2Wav,
                placement: StagePlacement::Local {
                    replicas: vec![decoder(), decoder()],
                    input_capacity: 4,
                    devices: devices(&["cuda:0", "cuda:1"]),
                },
            },
        ],
        Some(100),
    )
    .unwrap();
    let prompts: Vec<String> = (0..12)
        .map(|i| vec![format!("q{i}"); 1 + i % 5].join(" "))
        .collect();
    let handles = submit_all_and_check(&p, &prompts);
    drop(handles);
    wait_idle(&p);
    let routes = routes.lock().unwrap().clone();
    assert_eq!(routes.len(), 12);
    for r in &routes {
        // Thinker replica i is on cuda:i; the Talker's on cuda:i is 1 - i.
        assert_eq!(r[1], 1 - r[0], "route {r:?}");
        assert_eq!(r[2], r[0], "route {r:?}");
    }
    let on_gpu0 = routes.iter().filter(|r| r[0] == 0).count();
    assert!((3..=9).contains(&on_gpu0), "{on_gpu0} of 12 on cuda:0");
}
