//! The wire protocols: each a thin codec between its connection's messages
//! and the conversation core (`serve::conversation`), driven by
//! `serve::driver`. The connection plumbing they share is `serve::conn`.
//! Stateless HTTP has no conversation: each request is one
//! `serve::answer::Answer`, its steps coded into the response body.

pub mod http;
pub mod realtime;
pub mod stream;
pub mod twilio;
pub mod webrtc;
