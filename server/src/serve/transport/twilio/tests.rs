use super::*;
use std::time::{Duration, Instant};

#[test]
fn marks_say_what_was_heard() {
    let mut p = Played::default();
    let a = p.send("resp_1", 1600);
    let b = p.send("resp_1", 1600);
    assert_eq!((a.as_str(), b.as_str()), ("resp_1:1600", "resp_1:3200"));
    // No echo yet: taken to play as it receives.
    assert_eq!(p.queued(), 0);
    p.echo(&a);
    assert_eq!(p.queued(), 1600);
    // Echoes out of order, foreign names and marks past what was sent
    // change nothing they should not.
    p.echo("greeting");
    p.echo("resp_0:800");
    assert_eq!(p.queued(), 1600);
    p.echo("resp_9:99999");
    assert_eq!(p.queued(), 0);
    p.send("resp_2", 800);
    assert_eq!(p.queued(), 800);
    p.clear();
    assert_eq!(p.queued(), 0);
}

#[test]
fn g711_both_laws_and_their_names() {
    assert_eq!(law_of("audio/x-mulaw"), Some(Law::Ulaw));
    assert_eq!(law_of("PCMU"), Some(Law::Ulaw));
    assert_eq!(law_of("audio/x-alaw"), Some(Law::Alaw));
    assert_eq!(law_of("audio/l16"), None);
    let pcm: Vec<i16> = (0..160)
        .map(|i| ((i * 397) % 20_000 - 10_000) as i16)
        .collect();
    for law in [Law::Ulaw, Law::Alaw] {
        let back = law.decode(&law.encode(&pcm));
        for (x, y) in pcm.iter().zip(&back) {
            // G.711 keeps about 13 bits: within 3% of the sample, or 32.
            let tol = (i32::from(*x).abs() / 32).max(32);
            assert!(
                (i32::from(*x) - i32::from(*y)).abs() <= tol,
                "{law:?} {x} {y}"
            );
        }
    }
}

#[test]
fn close_reasons_fit_a_close_frame() {
    let short = ClientError::invalid("invalid_api_key", "no key");
    assert_eq!(close_reason(&short), "invalid_api_key: no key");
    let long = ClientError::invalid("unsupported_media_format", "é".repeat(200));
    let r = close_reason(&long);
    assert!(r.len() <= 123 && r.ends_with("..."), "{}", r.len());
}

#[test]
fn parameters_are_strings_of_numbers() {
    let p: HashMap<String, Value> = serde_json::from_value(json!({
        "silence_duration_ms": "400", "threshold": 0.6, "bad": "soon",
    }))
    .unwrap();
    assert_eq!(number::<u32>(&p, "silence_duration_ms").unwrap(), Some(400));
    assert_eq!(number::<f32>(&p, "threshold").unwrap(), Some(0.6));
    assert_eq!(number::<u32>(&p, "prefix_padding_ms").unwrap(), None);
    let e = number::<u32>(&p, "bad").unwrap_err();
    assert_eq!(e.param, Some("bad"));
}

#[test]
fn the_lead_holds_each_answer_then_lets_it_through() {
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    let mut l = PlayoutLead::new(Duration::from_millis(1000));
    assert!(l.push("a", &[1, 2], ms(0)).is_empty());
    assert_eq!(l.due(), Some(ms(1000)));
    assert!(l.push("a", &[3, 4], ms(500)).is_empty());
    assert_eq!(l.release(ms(999)), None);
    assert_eq!(l.release(ms(1000)), Some(("a".into(), vec![1, 2, 3, 4])));
    // Open now: its audio passes straight through.
    assert_eq!(l.push("a", &[5, 6], ms(1100)), vec![5, 6]);
    assert_eq!(l.due(), None);
    // A short answer ends inside its lead: all of it goes out at its end.
    assert!(l.push("b", &[7, 8], ms(2000)).is_empty());
    assert!(l.finish("a").is_empty());
    assert_eq!(l.finish("b"), vec![7, 8]);
    // Audio that arrives after the lead passed goes out with it.
    assert!(l.push("c", &[1, 1], ms(3000)).is_empty());
    assert_eq!(l.push("c", &[2, 2], ms(4200)), vec![1, 1, 2, 2]);
    // A barge-in drops what is held.
    assert!(l.push("d", &[9, 9], ms(5000)).is_empty());
    l.drop_held();
    assert_eq!(l.due(), None);
    assert!(l.finish("d").is_empty());
    // No lead: nothing is held.
    let mut l = PlayoutLead::new(Duration::ZERO);
    assert_eq!(l.push("e", &[1, 2], ms(0)), vec![1, 2]);
}
