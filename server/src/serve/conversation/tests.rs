//! The conversation's decisions, without sockets, models or clocks.

use super::*;
use omnistream_stages::vad::VadConfig;

const ECHO: Duration = Duration::from_millis(300);

fn caps(listener: bool, thinker_hears: bool) -> Caps {
    Caps {
        listener,
        thinker_hears,
        echo_guard: ECHO,
        chars_per_second: 10.0,
    }
}

fn vad() -> TurnSettings {
    TurnSettings {
        vad: VadConfig::default(),
        create_response: true,
        interrupt_response: true,
        idle_timeout: None,
    }
}

fn busy(id: &str) -> ClientError {
    ClientError::invalid("busy", id.to_string())
}

/// A conversation with a Listener, 16 kHz input, server VAD on.
fn spoken() -> Conversation {
    let mut s = Settings::new(16_000, OutputFormat::Pcm16 { rate: 16_000 });
    s.turns = Some(vad());
    Conversation::new(caps(true, false), s)
}

fn typed() -> Conversation {
    Conversation::new(
        caps(true, false),
        Settings::new(24_000, OutputFormat::Pcm16 { rate: 24_000 }),
    )
}

fn outputs(c: &mut Conversation) -> Vec<Output> {
    std::iter::from_fn(|| c.poll_output()).collect()
}

fn work(c: &mut Conversation) -> Vec<Work> {
    std::iter::from_fn(|| c.poll_work()).collect()
}

fn text_turn(t: &str) -> Input {
    let mut r = Respond::auto(busy);
    r.user_text = Some(t.into());
    Input::Respond(r)
}

/// The words of transcription `work`.
fn heard(work: u64, text: &str) -> Input {
    Input::Transcribed {
        work,
        result: Ok(text.into()),
    }
}

/// The turn detector's end of an utterance.
fn stopped(audio_end_ms: u64, audio: Vec<f32>) -> Input {
    speech(Speech::Stopped {
        audio_end_ms,
        audio,
    })
}

fn speech(s: Speech) -> Input {
    Input::Speech {
        speech: s,
        queued_s: 0.0,
    }
}

/// The one `Submit` in `w`: its response id and prompt.
fn submitted(w: &[Work]) -> (String, Vec<ChatMessage>) {
    let subs: Vec<_> = w
        .iter()
        .filter_map(|w| match w {
            Work::Submit {
                response_id, spec, ..
            } => Some((response_id.clone(), spec)),
            _ => None,
        })
        .collect();
    assert_eq!(subs.len(), 1, "one answer submitted: {w:?}");
    let (id, spec) = &subs[0];
    let messages = match &spec.input {
        RequestInput::Chat { messages } | RequestInput::Heard { messages, .. } => messages.clone(),
        other => panic!("not a chat: {other:?}"),
    };
    (id.clone(), messages)
}

/// Accepts the answer and streams `text` with `seconds` of audio at `t`.
fn play(c: &mut Conversation, id: &str, text: &str, seconds: f64, t: Instant) {
    c.handle(
        Input::AnswerAccepted {
            response_id: id.into(),
        },
        t,
    );
    c.handle(
        Input::AnswerText {
            response_id: id.into(),
            delta: text.into(),
        },
        t,
    );
    c.handle(
        Input::AnswerAudio {
            response_id: id.into(),
            bytes: vec![0; 4],
            until_s: seconds,
        },
        t,
    );
}

fn end(c: &mut Conversation, id: &str, end: End, t: Instant) {
    c.handle(
        Input::AnswerEnded {
            response_id: id.into(),
            end,
            audio_seconds: 3.0,
        },
        t,
    );
}

fn transcribe_ids(w: &[Work]) -> Vec<u64> {
    w.iter()
        .filter_map(|w| match w {
            Work::Transcribe { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

#[test]
fn typed_turn_is_answered_and_both_sides_remembered() {
    let t0 = Instant::now();
    let mut c = typed();
    c.handle(text_turn("Hello there"), t0);
    let (id, prompt) = submitted(&work(&mut c));
    assert_eq!(prompt.last().unwrap().content, "Hello there");
    assert_eq!(c.answering(), Some(id.as_str()));
    assert!(
        c.history().is_empty(),
        "the user's words join once accepted"
    );
    play(&mut c, &id, "Hi!", 1.0, t0);
    let o = outputs(&mut c);
    assert!(matches!(&o[0], Output::AnswerStarted(a) if a.response_id == id && a.audio));
    assert!(matches!(&o[1], Output::AnswerText { delta, .. } if delta == "Hi!"));
    assert!(matches!(&o[2], Output::AnswerAudio { .. }));
    end(&mut c, &id, End::Completed(Usage::default()), t0);
    let o = outputs(&mut c);
    assert!(
        matches!(&o[..], [Output::AnswerDone { text, end: End::Completed(_), .. }] if text == "Hi!")
    );
    assert_eq!(c.answering(), None);
    let history = c.history();
    let h: Vec<_> = history
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect();
    assert_eq!(h, [("user", "Hello there"), ("assistant", "Hi!")]);
}

#[test]
fn a_second_answer_while_one_runs_gets_the_transports_busy_error() {
    let t0 = Instant::now();
    let mut c = typed();
    c.handle(text_turn("one"), t0);
    let (id, _) = submitted(&work(&mut c));
    c.handle_from(Some("evt_7".into()), text_turn("two"), t0);
    let o = outputs(&mut c);
    assert!(
        matches!(&o[..], [Output::Error { error, event_id: Some(e) }] if error.code == "busy" && error.message == id && e == "evt_7"),
        "{o:?}"
    );
    assert!(work(&mut c).is_empty());
}

#[test]
fn a_refused_answer_is_an_error_for_the_event_that_asked_and_keeps_no_words() {
    let t0 = Instant::now();
    let mut c = typed();
    c.handle_from(Some("evt_1".into()), text_turn("hi"), t0);
    let (id, _) = submitted(&work(&mut c));
    c.handle(
        Input::AnswerRejected {
            response_id: id,
            error: ClientError::invalid("overloaded", "busy"),
        },
        t0,
    );
    let o = outputs(&mut c);
    assert!(
        matches!(&o[..], [Output::Error { error, event_id: Some(e) }] if error.code == "overloaded" && e == "evt_1")
    );
    assert_eq!(c.answering(), None);
    assert!(c.history().is_empty());
}

#[test]
fn spoken_turn_with_server_vad_is_transcribed_then_answered() {
    let t0 = Instant::now();
    let mut c = spoken();
    c.handle(
        speech(Speech::Started {
            audio_start_ms: 100,
        }),
        t0,
    );
    c.handle(stopped(1600, vec![0.1; 16_000]), t0);
    let o = outputs(&mut c);
    let started_item = match &o[0] {
        Output::SpeechStarted {
            item_id,
            audio_start_ms: 100,
        } => item_id.clone(),
        other => panic!("{other:?}"),
    };
    assert!(
        matches!(&o[1], Output::SpeechStopped { item_id, seconds, .. } if *item_id == started_item && (*seconds - 1.0).abs() < 1e-9)
    );
    assert!(matches!(&o[2], Output::Committed { item_id, .. } if *item_id == started_item));
    let w = work(&mut c);
    let ids = transcribe_ids(&w);
    assert_eq!(ids.len(), 1);
    assert_eq!(c.answering(), None, "no answer before the words");
    c.handle(heard(ids[0], "What is a bee?"), t0);
    let o = outputs(&mut c);
    assert!(
        matches!(&o[..], [Output::Transcribed { item_id, result: Ok(t) }] if *item_id == started_item && t == "What is a bee?")
    );
    let (_, prompt) = submitted(&work(&mut c));
    assert_eq!(prompt.last().unwrap().content, "What is a bee?");
}

#[test]
fn a_blank_transcript_adds_no_turn_and_no_answer() {
    let t0 = Instant::now();
    let mut c = spoken();
    c.handle(speech(Speech::Started { audio_start_ms: 0 }), t0);
    c.handle(stopped(900, vec![0.0; 8000]), t0);
    let ids = transcribe_ids(&work(&mut c));
    c.handle(heard(ids[0], ""), t0);
    assert!(work(&mut c).is_empty());
    assert!(c.history().is_empty());
}

#[test]
fn barge_in_cancels_clears_and_keeps_what_was_heard() {
    let t0 = Instant::now();
    let mut c = spoken();
    c.handle(text_turn("Tell me about bees"), t0);
    let (id, _) = submitted(&work(&mut c));
    // 20 characters at 10 chars/s: 2 s of words; 3 s of audio sent at once.
    play(&mut c, &id, "Bees make honey from nectar.", 3.0, t0);
    outputs(&mut c);
    // The user cuts in 1.6 s after the first audio (past the echo guard).
    let t1 = t0 + Duration::from_millis(1600);
    c.handle(
        speech(Speech::Started {
            audio_start_ms: 1400,
        }),
        t1,
    );
    let o = outputs(&mut c);
    assert!(matches!(&o[0], Output::SpeechStarted { .. }));
    assert!(matches!(&o[1], Output::PlaybackCleared { response_id } if *response_id == id));
    let w = work(&mut c);
    assert!(
        matches!(&w[..], [Work::ClearPlayer, Work::Cancel { response_id }] if *response_id == id),
        "{w:?}"
    );
    // Audio its stages made before the cancel reached them is not played
    // after the clear (it would start the answer over).
    c.handle(
        Input::AnswerAudio {
            response_id: id.clone(),
            bytes: vec![0; 4],
            until_s: 3.2,
        },
        t1,
    );
    let o = outputs(&mut c);
    assert!(o.is_empty(), "{o:?}");
    // The answer ends, cancelled: 1.6 s heard = 16 chars, cut at a word.
    end(&mut c, &id, End::Cancelled, t1);
    let o = outputs(&mut c);
    assert!(
        matches!(&o[0], Output::Truncated { audio_end_ms: 1600, text, .. } if text == "Bees make honey"),
        "{o:?}"
    );
    assert!(
        matches!(&o[1], Output::AnswerDone { end: End::Cancelled, text, generated_chars: 28, .. } if text == "Bees make honey")
    );
    assert_eq!(c.history().last().unwrap().content, "Bees make honey");
}

#[test]
fn barge_in_on_a_whole_answer_still_playing_cuts_the_history() {
    let t0 = Instant::now();
    let mut c = spoken();
    c.handle(text_turn("Tell me about bees"), t0);
    let (id, _) = submitted(&work(&mut c));
    play(&mut c, &id, "Bees make honey from nectar.", 5.0, t0);
    end(&mut c, &id, End::Completed(Usage::default()), t0);
    outputs(&mut c);
    let t1 = t0 + Duration::from_secs(1);
    c.handle(speech(Speech::Started { audio_start_ms: 0 }), t1);
    let o = outputs(&mut c);
    assert!(
        matches!(&o[1], Output::Truncated { text, audio_end_ms: 1000, .. } if text == "Bees make"),
        "{o:?}"
    );
    assert!(matches!(&o[2], Output::PlaybackCleared { .. }));
    assert!(matches!(&work(&mut c)[..], [Work::ClearPlayer]));
    assert_eq!(c.history().last().unwrap().content, "Bees make");
    // Once it has played out, speech interrupts nothing.
    c.handle(stopped(1, vec![]), t1);
    let ids = transcribe_ids(&work(&mut c));
    c.handle(heard(ids[0], ""), t1);
    outputs(&mut c);
    c.handle(
        speech(Speech::Started { audio_start_ms: 0 }),
        t0 + Duration::from_secs(9),
    );
    assert!(matches!(
        &outputs(&mut c)[..],
        [Output::SpeechStarted { .. }]
    ));
}

#[test]
fn a_media_track_queue_is_not_heard() {
    let t0 = Instant::now();
    let mut c = spoken();
    c.handle(text_turn("Tell me about bees"), t0);
    let (id, _) = submitted(&work(&mut c));
    play(&mut c, &id, "Bees make honey from nectar.", 3.0, t0);
    outputs(&mut c);
    // 2 s in, the track still holds 2.5 s: 0.5 s was heard.
    let t1 = t0 + Duration::from_secs(2);
    c.handle(
        Input::Speech {
            speech: Speech::Started { audio_start_ms: 0 },
            queued_s: 2.5,
        },
        t1,
    );
    end(&mut c, &id, End::Cancelled, t1);
    let o = outputs(&mut c);
    assert!(
        o.iter().any(|o| matches!(
            o,
            Output::Truncated {
                audio_end_ms: 500,
                ..
            }
        )),
        "{o:?}"
    );
}

#[test]
fn the_echo_guard_drops_speech_that_starts_as_the_answer_does() {
    let t0 = Instant::now();
    let mut c = spoken();
    c.handle(text_turn("hi"), t0);
    let (id, _) = submitted(&work(&mut c));
    play(&mut c, &id, "Hello.", 2.0, t0);
    outputs(&mut c);
    let t1 = t0 + ECHO / 2;
    c.handle(speech(Speech::Started { audio_start_ms: 0 }), t1);
    c.handle(
        speech(Speech::Paused {
            audio: vec![0.0; 100],
        }),
        t1,
    );
    c.handle(stopped(500, vec![0.0; 100]), t1);
    assert!(outputs(&mut c).is_empty(), "the answer's own echo");
    assert!(work(&mut c).is_empty(), "not interrupted, not transcribed");
    assert_eq!(c.answering(), Some(id.as_str()));
    // After the guard, the same speech is the user's.
    c.handle(speech(Speech::Started { audio_start_ms: 0 }), t0 + ECHO * 2);
    assert!(matches!(&outputs(&mut c)[0], Output::SpeechStarted { .. }));
}

#[test]
fn early_transcription_starts_at_a_pause_and_is_abandoned_when_speech_resumes() {
    let t0 = Instant::now();
    let mut c = spoken();
    c.handle(speech(Speech::Started { audio_start_ms: 0 }), t0);
    c.handle(
        speech(Speech::Paused {
            audio: vec![0.1; 8000],
        }),
        t0,
    );
    let first = transcribe_ids(&work(&mut c));
    assert_eq!(first.len(), 1);
    c.handle(speech(Speech::Resumed), t0);
    assert!(matches!(&work(&mut c)[..], [Work::Abandon { id }] if *id == first[0]));
    // A late result of the abandoned one is ignored.
    c.handle(heard(first[0], "half"), t0);
    assert!(outputs(&mut c)
        .iter()
        .all(|o| !matches!(o, Output::Transcribed { .. })));
    // Paused again: its words are ready before the turn is confirmed.
    c.handle(
        speech(Speech::Paused {
            audio: vec![0.1; 12_000],
        }),
        t0,
    );
    let second = transcribe_ids(&work(&mut c));
    c.handle(heard(second[0], "the whole question"), t0);
    c.handle(stopped(1000, vec![0.1; 12_000]), t0);
    let w = work(&mut c);
    assert!(
        transcribe_ids(&w).is_empty(),
        "no second transcription: {w:?}"
    );
    let (_, prompt) = submitted(&w);
    assert_eq!(prompt.last().unwrap().content, "the whole question");
    // A turn that ended elsewhere than the pause is transcribed afresh.
    let mut c = spoken();
    c.handle(speech(Speech::Started { audio_start_ms: 0 }), t0);
    c.handle(
        speech(Speech::Paused {
            audio: vec![0.1; 8000],
        }),
        t0,
    );
    let early = transcribe_ids(&work(&mut c));
    c.handle(stopped(1000, vec![0.1; 9000]), t0);
    let w = work(&mut c);
    assert!(matches!(&w[0], Work::Abandon { id } if *id == early[0]));
    assert_eq!(transcribe_ids(&w).len(), 1);
}

#[test]
fn turns_are_answered_in_order_and_only_the_last() {
    let t0 = Instant::now();
    let mut c = spoken();
    for n in [8000, 9000] {
        c.handle(speech(Speech::Started { audio_start_ms: 0 }), t0);
        c.handle(stopped(1, vec![0.1; n]), t0);
    }
    // The second turn waits for the first one's words.
    let first = transcribe_ids(&work(&mut c));
    assert_eq!(first.len(), 1);
    c.handle(heard(first[0], "first"), t0);
    let w = work(&mut c);
    assert!(
        w.iter().all(|w| !matches!(w, Work::Submit { .. })),
        "not answered alone: {w:?}"
    );
    let second = transcribe_ids(&w);
    assert_eq!(second.len(), 1);
    c.handle(heard(second[0], "second"), t0);
    let words: Vec<_> = outputs(&mut c)
        .into_iter()
        .filter_map(|o| match o {
            Output::Transcribed { result: Ok(t), .. } => Some(t),
            _ => None,
        })
        .collect();
    assert_eq!(words, ["first", "second"]);
    let (_, prompt) = submitted(&work(&mut c));
    let tail: Vec<_> = prompt.iter().map(|m| m.content.as_str()).collect();
    assert_eq!(tail, ["first", "second"]);
}

#[test]
fn a_thinker_that_hears_gets_the_audio_not_words() {
    let t0 = Instant::now();
    let mut s = Settings::new(16_000, OutputFormat::Pcm16 { rate: 16_000 });
    s.turns = Some(vad());
    let mut c = Conversation::new(caps(false, true), s);
    c.handle(speech(Speech::Started { audio_start_ms: 0 }), t0);
    c.handle(stopped(500, vec![0.2; 8000]), t0);
    let w = work(&mut c);
    let audio = w.iter().find_map(|w| match w {
        Work::Submit { spec, .. } => match &spec.input {
            RequestInput::Heard { audio, .. } => Some(audio.len()),
            _ => None,
        },
        _ => None,
    });
    assert_eq!(audio, Some(8000));
}

#[test]
fn cancel_needs_a_running_answer_and_errors_mid_answer_end_it() {
    let t0 = Instant::now();
    let mut c = typed();
    c.handle(Input::Cancel { response_id: None }, t0);
    assert!(
        matches!(&outputs(&mut c)[..], [Output::Error { error, .. }] if error.code == "response_cancel_not_active")
    );
    c.handle(text_turn("hi"), t0);
    let (id, _) = submitted(&work(&mut c));
    c.handle(
        Input::Cancel {
            response_id: Some("resp_other".into()),
        },
        t0,
    );
    assert!(matches!(&outputs(&mut c)[..], [Output::Error { .. }]));
    c.handle(
        Input::Cancel {
            response_id: Some(id.clone()),
        },
        t0,
    );
    assert!(matches!(&work(&mut c)[..], [Work::Cancel { response_id }] if *response_id == id));
    // The engine fails it mid-way: it ends, the conversation keeps its words.
    play(&mut c, &id, "Partial", 0.5, t0);
    end(
        &mut c,
        &id,
        End::Failed("generation_failed: boom".into()),
        t0,
    );
    let o = outputs(&mut c);
    assert!(o.iter().any(|o| matches!(
        o,
        Output::AnswerDone {
            end: End::Failed(_),
            ..
        }
    )));
    assert_eq!(c.answering(), None);
    assert_eq!(c.history().last().unwrap().content, "Partial");
    // And the next turn is answered.
    c.handle(text_turn("again"), t0);
    submitted(&work(&mut c));
}

#[test]
fn the_input_buffer_is_capped_unless_it_is_a_microphone() {
    let t0 = Instant::now();
    let mut c = typed();
    let second = vec![0u8; 48_000];
    for _ in 0..MAX_INPUT_AUDIO_SECONDS {
        c.handle(Input::Audio(second.clone()), t0);
    }
    assert!(outputs(&mut c).is_empty());
    c.handle(Input::Audio(second.clone()), t0);
    assert!(
        matches!(&outputs(&mut c)[..], [Output::Error { error, .. }] if error.code == "input_audio_buffer_full")
    );
    c.handle(Input::Audio(vec![0; 3]), t0);
    assert!(
        matches!(&outputs(&mut c)[..], [Output::Error { error, .. }] if error.code == "invalid_audio")
    );
    let mut s = Settings::new(24_000, OutputFormat::Pcm16 { rate: 24_000 });
    s.mic = true;
    let mut c = Conversation::new(caps(true, false), s);
    for _ in 0..MAX_INPUT_AUDIO_SECONDS + 5 {
        c.handle(Input::Audio(second.clone()), t0);
    }
    assert!(outputs(&mut c).is_empty());
    assert_eq!(c.input_room(), 0);
    // Committed, it is transcribed (at 16 kHz) and the buffer starts afresh.
    c.handle(Input::Commit { respond: false }, t0);
    let w = work(&mut c);
    assert!(w.iter().any(|w| matches!(w, Work::Transcribe { audio, .. } if audio.len() == 16_000 * MAX_INPUT_AUDIO_SECONDS)), "{w:?}");
    assert_eq!(c.input_room(), 24_000 * 2 * MAX_INPUT_AUDIO_SECONDS);
    c.handle(Input::Commit { respond: false }, t0);
    assert!(
        matches!(&outputs(&mut c).last(), Some(Output::Error { error, .. }) if error.code == "input_audio_buffer_commit_empty")
    );
}

#[test]
fn end_of_audio_answers_the_buffer_once_idle_and_refuses_while_busy() {
    let t0 = Instant::now();
    let mut c = Conversation::new(
        caps(true, false),
        Settings::new(16_000, OutputFormat::Pcm16 { rate: 16_000 }),
    );
    c.handle(text_turn("hi"), t0);
    let (id, _) = submitted(&work(&mut c));
    c.handle(Input::Audio(vec![0; 32_000]), t0);
    c.handle(Input::EndOfAudio { ended: None }, t0);
    let o = outputs(&mut c);
    assert!(matches!(&o[0], Output::AudioReceived { seconds } if (*seconds - 1.0).abs() < 1e-9));
    assert!(matches!(&o[1], Output::Error { error, .. } if error.code == "response_in_progress"));
    end(&mut c, &id, End::Completed(Usage::default()), t0);
    c.handle(Input::Audio(vec![0; 32_000]), t0);
    c.handle(Input::EndOfAudio { ended: None }, t0);
    let ids = transcribe_ids(&work(&mut c));
    c.handle(heard(ids[0], "and now?"), t0);
    submitted(&work(&mut c));
    // A pipeline that cannot hear says so.
    let mut c = Conversation::new(
        caps(false, false),
        Settings::new(16_000, OutputFormat::Pcm16 { rate: 16_000 }),
    );
    c.handle(Input::Audio(vec![0; 320]), t0);
    c.handle(Input::EndOfAudio { ended: None }, t0);
    let o = outputs(&mut c);
    assert!(
        matches!(&o[1], Output::Error { error, .. } if error.code == "transcription_unavailable")
    );
}

#[test]
fn clearing_input_abandons_an_early_transcription() {
    let t0 = Instant::now();
    let mut c = spoken();
    c.handle(speech(Speech::Started { audio_start_ms: 0 }), t0);
    c.handle(
        speech(Speech::Paused {
            audio: vec![0.1; 800],
        }),
        t0,
    );
    let ids = transcribe_ids(&work(&mut c));
    c.handle(Input::Clear, t0);
    let w = work(&mut c);
    assert!(
        matches!(&w[..], [Work::Abandon { id }, Work::ClearDetector] if *id == ids[0]),
        "{w:?}"
    );
    assert!(matches!(outputs(&mut c).last(), Some(Output::InputCleared)));
}

#[test]
fn speech_during_a_transcription_barges_in_at_once_and_reports_in_turn_order() {
    let t0 = Instant::now();
    let mut c = spoken();
    c.handle(speech(Speech::Started { audio_start_ms: 0 }), t0);
    c.handle(stopped(700, vec![0.1; 8000]), t0);
    let ids = transcribe_ids(&work(&mut c));
    outputs(&mut c);
    // While turn 1 is transcribed, the client asks for an answer...
    c.handle(
        Input::AddMessage {
            item_id: None,
            role: Role::User,
            text: "Tell me a story".into(),
            content: Value::Null,
        },
        t0,
    );
    c.handle(Input::Respond(Respond::auto(busy)), t0);
    let (id, _) = submitted(&work(&mut c));
    play(&mut c, &id, "Once upon a time there was a bee.", 3.0, t0);
    outputs(&mut c);
    // ...and the user talks over it before turn 1's words are in.
    let t1 = t0 + Duration::from_secs(1);
    c.handle(
        speech(Speech::Started {
            audio_start_ms: 1500,
        }),
        t1,
    );
    let w = work(&mut c);
    assert!(
        matches!(&w[..], [Work::ClearPlayer, Work::Cancel { response_id }] if *response_id == id),
        "{w:?}"
    );
    let o = outputs(&mut c);
    assert!(
        matches!(&o[..], [Output::PlaybackCleared { .. }]),
        "the cut at once, its turn later: {o:?}"
    );
    end(&mut c, &id, End::Cancelled, t1);
    outputs(&mut c);
    c.handle(stopped(2500, vec![0.1; 9000]), t1);
    assert!(outputs(&mut c).is_empty());
    // Turn 1's words come: then turn 2's events, in order.
    c.handle(heard(ids[0], "first"), t1);
    let o = outputs(&mut c);
    assert!(
        matches!(&o[0], Output::Transcribed { result: Ok(t), .. } if t == "first"),
        "{o:?}"
    );
    assert!(
        matches!(
            &o[1],
            Output::SpeechStarted {
                audio_start_ms: 1500,
                ..
            }
        ),
        "{o:?}"
    );
    assert!(
        matches!(
            &o[2],
            Output::SpeechStopped {
                audio_end_ms: 2500,
                ..
            }
        ),
        "{o:?}"
    );
    assert!(matches!(&o[3], Output::Committed { .. }), "{o:?}");
    // Turn 1 was not answered on its own: turn 2 is under way.
    let w = work(&mut c);
    assert!(w.iter().all(|w| !matches!(w, Work::Submit { .. })), "{w:?}");
    assert_eq!(transcribe_ids(&w).len(), 1);
}

/// The answer's item id, from its `AnswerStarted`... or `AnswerDone`.
fn answer_item(o: &[Output]) -> String {
    o.iter()
        .find_map(|o| match o {
            Output::AnswerDone { answer, .. } => Some(answer.item_id.clone()),
            _ => None,
        })
        .expect("an answer ended")
}

fn add_user(c: &mut Conversation, id: &str, text: &str, t: Instant) {
    c.handle(
        Input::AddMessage {
            item_id: Some(id.into()),
            role: Role::User,
            text: text.into(),
            content: serde_json::json!([{"type": "input_text", "text": text}]),
        },
        t,
    );
}

fn error_code(o: &[Output]) -> Option<(&'static str, Option<&'static str>)> {
    o.iter().find_map(|o| match o {
        Output::Error { error, .. } => Some((error.code, error.param)),
        _ => None,
    })
}

#[test]
fn items_are_retrieved_deleted_and_truncated_by_id() {
    let t0 = Instant::now();
    let mut c = typed();
    add_user(&mut c, "item_q", "Tell me about bees", t0);
    let mut r = Respond::auto(busy);
    r.record = true;
    c.handle(Input::Respond(r), t0);
    let (id, _) = submitted(&work(&mut c));
    play(&mut c, &id, "Bees make honey from nectar", 3.0, t0);
    end(&mut c, &id, End::Completed(Usage::default()), t0);
    let answer = answer_item(&outputs(&mut c));

    // Retrieved as the conversation has it.
    c.handle(
        Input::RetrieveItem {
            item_id: answer.clone(),
        },
        t0,
    );
    let o = outputs(&mut c);
    let [Output::ItemRetrieved(item)] = &o[..] else {
        panic!("{o:?}");
    };
    assert_eq!(item.message.content, "Bees make honey from nectar");
    assert_eq!(
        item.origin,
        Origin::Answer {
            audio_ms: Some(3000),
            generated: Some(Generated {
                text: "Bees make honey from nectar".into(),
                audio_ms: 3000
            }),
        }
    );

    // The client played one second of it: the words of that second stay.
    // A later cut is taken from the whole answer (the server's own cut at a
    // barge-in may come first, by a few ms).
    for (ms, kept) in [
        (1000, "Bees make"),
        (3000, "Bees make honey from nectar"),
        (1000, "Bees make"),
    ] {
        c.handle(
            Input::TruncateItem {
                item_id: answer.clone(),
                content_index: 0,
                audio_end_ms: ms,
            },
            t0,
        );
        let o = outputs(&mut c);
        assert!(
            matches!(&o[..], [Output::Truncated { audio_end_ms, text, .. }] if *audio_end_ms == ms && text == kept),
            "{o:?}"
        );
    }
    // Past its audio, another content part, not an answer, unknown: refused.
    for (input, code) in [
        (
            Input::TruncateItem {
                item_id: answer.clone(),
                content_index: 0,
                audio_end_ms: 5000,
            },
            ("invalid_value", Some("audio_end_ms")),
        ),
        (
            Input::TruncateItem {
                item_id: answer.clone(),
                content_index: 1,
                audio_end_ms: 10,
            },
            ("invalid_value", Some("content_index")),
        ),
        (
            Input::TruncateItem {
                item_id: "item_q".into(),
                content_index: 0,
                audio_end_ms: 10,
            },
            ("invalid_value", Some("item_id")),
        ),
        (
            Input::RetrieveItem {
                item_id: "item_nope".into(),
            },
            ("item_not_found", Some("item_id")),
        ),
        (
            Input::DeleteItem {
                item_id: "item_nope".into(),
            },
            ("item_not_found", Some("item_id")),
        ),
    ] {
        c.handle(input, t0);
        assert_eq!(error_code(&outputs(&mut c)), Some(code));
    }

    // Deleted: the next answer's prompt no longer has it.
    c.handle(
        Input::DeleteItem {
            item_id: "item_q".into(),
        },
        t0,
    );
    let o = outputs(&mut c);
    assert!(
        matches!(&o[..], [Output::ItemDeleted { item_id }] if item_id == "item_q"),
        "{o:?}"
    );
    add_user(&mut c, "item_q2", "And wasps?", t0);
    c.handle(text_turn("Go on"), t0);
    let (_, prompt) = submitted(&work(&mut c));
    let texts: Vec<_> = prompt.iter().map(|m| m.content.as_str()).collect();
    assert_eq!(texts, ["Bees make", "And wasps?", "Go on"]);
}

#[test]
fn an_answer_of_its_own_context_leaves_the_conversation_alone() {
    let t0 = Instant::now();
    let mut c = typed();
    add_user(&mut c, "item_a", "My name is Ada", t0);
    add_user(&mut c, "item_b", "I like tea", t0);
    let mut r = Respond::auto(busy);
    r.record = false;
    r.instructions = Some("Classify".into());
    r.input = Some(vec![
        Context::Reference("item_b".into()),
        Context::Message(ChatMessage::user("Is this about drinks?")),
    ]);
    c.handle(Input::Respond(r), t0);
    let (id, prompt) = submitted(&work(&mut c));
    let texts: Vec<_> = prompt.iter().map(|m| m.content.as_str()).collect();
    assert_eq!(texts, ["Classify", "I like tea", "Is this about drinks?"]);
    play(&mut c, &id, "Yes", 0.5, t0);
    end(&mut c, &id, End::Completed(Usage::default()), t0);
    outputs(&mut c);
    assert_eq!(
        c.history().len(),
        2,
        "an out-of-band answer is not remembered"
    );
    // A reference to nothing is the request's error.
    let mut r = Respond::auto(busy);
    r.input = Some(vec![Context::Reference("item_zz".into())]);
    c.handle(Input::Respond(r), t0);
    assert_eq!(
        error_code(&outputs(&mut c)),
        Some(("item_not_found", Some("response.input")))
    );
    assert!(work(&mut c).is_empty());
}

#[test]
fn the_running_answer_is_cut_where_the_client_stopped_playing_it() {
    let t0 = Instant::now();
    let mut c = typed();
    c.handle(text_turn("Tell me about bees"), t0);
    let (id, _) = submitted(&work(&mut c));
    play(&mut c, &id, "Bees make honey from nectar", 3.0, t0);
    let item = outputs(&mut c)
        .iter()
        .find_map(|o| match o {
            Output::AnswerStarted(a) => Some(a.item_id.clone()),
            _ => None,
        })
        .expect("started");
    // Deleting it while it runs is refused.
    c.handle(
        Input::DeleteItem {
            item_id: item.clone(),
        },
        t0,
    );
    assert_eq!(
        error_code(&outputs(&mut c)),
        Some(("item_in_progress", Some("item_id")))
    );
    c.handle(
        Input::TruncateItem {
            item_id: item,
            content_index: 0,
            audio_end_ms: 1000,
        },
        t0,
    );
    c.handle(Input::Cancel { response_id: None }, t0);
    end(&mut c, &id, End::Cancelled, t0);
    let o = outputs(&mut c);
    assert!(
        o.iter().any(|o| matches!(o, Output::Truncated { audio_end_ms: 1000, text, .. } if text == "Bees make")),
        "{o:?}"
    );
    assert_eq!(c.history().last().unwrap().content, "Bees make");
}

#[test]
fn silence_past_the_idle_timeout_makes_the_model_speak_again() {
    let t0 = Instant::now();
    let s = |n: u64| t0 + Duration::from_secs(n);
    let mut c = spoken();
    let mut turns = vad();
    turns.idle_timeout = Some(Duration::from_secs(5));
    let mut settings = c.settings().clone();
    settings.turns = Some(turns);
    c.handle(Input::Configure(settings), t0);
    c.handle(text_turn("Hello there"), t0);
    let (id, _) = submitted(&work(&mut c));
    // Three seconds of answer, played from t0: the silence counts from 3 s.
    play(&mut c, &id, "Hi!", 3.0, t0);
    end(&mut c, &id, End::Completed(Usage::default()), s(1));
    outputs(&mut c);
    assert_eq!(c.deadline(), Some(s(8)));
    c.handle(Input::Tick, s(7));
    assert!(outputs(&mut c).is_empty() && work(&mut c).is_empty());
    c.handle(Input::Tick, s(8));
    let o = outputs(&mut c);
    assert!(matches!(&o[..], [Output::TimeoutTriggered { .. }]), "{o:?}");
    let (id, prompt) = submitted(&work(&mut c));
    assert_eq!(
        prompt.last().unwrap().content,
        "Hi!",
        "on the conversation so far"
    );
    assert_eq!(c.deadline(), None, "not again until this answer has played");
    // (`end` reports three seconds of audio.)
    play(&mut c, &id, "Still there?", 3.0, s(9));
    end(&mut c, &id, End::Completed(Usage::default()), s(9));
    outputs(&mut c);
    assert_eq!(c.deadline(), Some(s(17)));
    // The user speaks first: no prompt.
    c.handle(speech(Speech::Started { audio_start_ms: 0 }), s(12));
    assert_eq!(c.deadline(), None);
    // Turned off: none.
    let mut settings = c.settings().clone();
    settings.turns = Some(vad());
    c.handle(Input::Configure(settings), s(13));
    assert_eq!(c.deadline(), None);
}

#[test]
fn an_answer_asked_for_while_the_committed_turn_is_transcribed_answers_it() {
    let t0 = Instant::now();
    let mut c = typed();
    c.handle(Input::Audio(vec![0u8; 24_000 * 2]), t0);
    c.handle(Input::Commit { respond: false }, t0);
    c.handle_from(Some("ev_1".into()), Input::Respond(Respond::auto(busy)), t0);
    let ids = transcribe_ids(&work(&mut c));
    assert_eq!(ids.len(), 1);
    assert!(
        !outputs(&mut c)
            .iter()
            .any(|o| matches!(o, Output::Error { .. })),
        "the answer waits for the words, it is not refused"
    );
    c.handle(heard(ids[0], "What do bees make?"), t0);
    let (_, prompt) = submitted(&work(&mut c));
    assert_eq!(prompt.last().unwrap().content, "What do bees make?");
    // Changing the input's rate drops what the buffer holds at the old one.
    c.handle(Input::Audio(vec![0u8; 4800]), t0);
    let mut s = c.settings().clone();
    s.input_rate = 8_000;
    c.handle(Input::Configure(s), t0);
    assert_eq!(c.input_room(), 8_000 * 2 * MAX_INPUT_AUDIO_SECONDS);
}
