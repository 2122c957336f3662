//! Agent frameworks nobody here wrote, pointed at `omnistream serve` as at
//! OpenAI (tests/python/test_agents.py): the OpenAI Agents SDK's voice
//! pipeline calling a function tool, Pipecat's OpenAI Realtime service in a
//! spoken conversation with a barge-in, and Pipecat's Twilio serializer on a
//! Media Streams call. Then the server is healthy and holds nothing.

use omnistream_e2e::{eventually, metric, run_pytest, spawn_server};

#[test]
fn agent_frameworks_talk_to_the_server() {
    let mut server = spawn_server(&[]);
    let report = run_pytest(&server, "test_agents.py");
    assert!(report.contains("3 passed"), "{report}");
    // Each framework's turns were answered, and the barge-ins cut answers.
    let answers = |endpoint, outcome| {
        metric(
            &server,
            "omnistream_requests_total",
            &[("endpoint", endpoint), ("outcome", outcome)],
        )
    };
    assert!(
        answers("chat_completions", "ok") >= 2.0,
        "{}",
        server.metrics()
    );
    assert!(answers("realtime", "ok") >= 1.0, "{}", server.metrics());
    assert!(
        answers("realtime", "cancelled") >= 1.0,
        "{}",
        server.metrics()
    );
    assert!(answers("twilio", "ok") >= 1.0, "{}", server.metrics());
    assert!(
        answers("twilio", "cancelled") >= 1.0,
        "{}",
        server.metrics()
    );
    // Every session and connection is gone once the clients hung up.
    let idle = eventually(10, || {
        metric(&server, "omnistream_sessions_open", &[]) == 0.0
            && metric(&server, "omnistream_requests_in_flight", &[]) == 0.0
    });
    assert!(idle, "state left behind:\n{}", server.metrics());
    assert!(server.alive(), "the server died");
}
