//! Stages beyond one process: the NATS connector.
//!
//! A stage replica runs as its own process (`omnistream stage`) and a gateway
//! (`omnistream serve --nats URL`) reaches it through a NATS server:
//!
//! | subject | what |
//! |---|---|
//! | `NS.in.PROCESS` | one replica's input: `Start`, text and frame payloads |
//! | `NS.ack.PROCESS` | credits back to a sender, one per payload its peer took |
//! | `NS.ev.PROCESS` | a gateway's requests' events (text, audio, failures, stage finished) |
//! | `NS.cancel` | a request cancelled by its gateway (every stage process listens) |
//! | `NS.hb` | announcements every [`HEARTBEAT`]: gateways, and replicas with their load |
//!
//! `NS` is `omnistream.` + the profile's name; `PROCESS` a random id per process.
//! The gateway picks every stage's replica when a request is submitted (the
//! least loaded by the announcements, plus what it sent since), and the route
//! travels with the request: each later payload goes to the same replica.
//! A sender holds at most the connector's `capacity` payloads unacknowledged
//! per replica, so a slow replica slows its upstream and nothing queues without
//! bound, in NATS or on either side.

mod mesh;
pub mod wire;

pub use mesh::{HostedStage, Mesh, MeshError, RemoteStage, DEAD_AFTER, HEARTBEAT};
pub use wire::StageMeta;
