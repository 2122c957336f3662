//! The servers one bench run drives: one, or several (whole pipelines
//! replicated, a server a GPU, with no load balancer in front). Each request
//! goes to the server with the fewest of the bench's requests in flight, as
//! HAProxy's `leastconn` would send it; ties go round in turn.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::client::{Client, RequestShape};
use super::metrics::{parse_gauge, parse_stage_counters, StageCounters, Timeline};

#[derive(Clone)]
pub struct Servers {
    clients: Arc<Vec<Client>>,
    in_flight: Arc<Vec<AtomicUsize>>,
    turn: Arc<AtomicUsize>,
}

/// One request in flight on a server, for as long as it lives.
struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Servers {
    pub fn new(urls: &[String], api_key: Option<String>) -> anyhow::Result<Self> {
        if urls.is_empty() {
            anyhow::bail!("--url names no server");
        }
        let clients = urls
            .iter()
            .map(|u| Client::new(u, api_key.clone()))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Self {
            in_flight: Arc::new(clients.iter().map(|_| AtomicUsize::new(0)).collect()),
            clients: Arc::new(clients),
            turn: Arc::new(AtomicUsize::new(0)),
        })
    }

    pub fn clients(&self) -> &[Client] {
        &self.clients
    }

    /// The servers' URLs, comma-separated (as `--url` takes them).
    pub fn urls(&self) -> String {
        let urls: Vec<&str> = self.clients.iter().map(Client::base).collect();
        urls.join(",")
    }

    /// The server for the next request: the fewest in flight, ties in turn.
    fn pick(&self) -> usize {
        let n = self.clients.len();
        let start = self.turn.fetch_add(1, Ordering::Relaxed) % n;
        (0..n)
            .map(|k| (start + k) % n)
            .min_by_key(|&i| self.in_flight[i].load(Ordering::Relaxed))
            .unwrap_or(0)
    }

    /// One request, on the server [`Self::pick`] chooses.
    pub async fn run(
        &self,
        shape: &RequestShape,
        prompt: &str,
        seed: u64,
    ) -> Result<Timeline, String> {
        let i = self.pick();
        self.in_flight[i].fetch_add(1, Ordering::Relaxed);
        let _held = InFlight(&self.in_flight[i]);
        self.clients[i].run(shape, prompt, seed).await
    }

    /// Every server's stage counters; with several, a stage is named
    /// `N:stage`, N the server's place in `--url` (from 0).
    pub async fn scrape(&self) -> Vec<(String, StageCounters)> {
        let mut out = Vec::new();
        for (i, text) in self.metrics().await.into_iter().enumerate() {
            let Some(text) = text else { continue };
            for (name, c) in parse_stage_counters(&text) {
                let name = match self.clients.len() {
                    1 => name,
                    _ => format!("{i}:{name}"),
                };
                out.push((name, c));
            }
        }
        out
    }

    /// The servers' resident and peak resident memory in MiB, summed (none
    /// where no server reports it).
    pub async fn memory(&self) -> (Option<f64>, Option<f64>) {
        let texts: Vec<String> = self.metrics().await.into_iter().flatten().collect();
        let sum = |name: &str| -> Option<f64> {
            let v: Vec<f64> = texts.iter().filter_map(|t| parse_gauge(t, name)).collect();
            (!v.is_empty()).then(|| v.iter().sum::<f64>() / 1048576.0)
        };
        (
            sum("omnistream_process_resident_bytes"),
            sum("omnistream_process_peak_resident_bytes"),
        )
    }

    /// Each server's `/metrics` (none where it did not answer), concurrently.
    async fn metrics(&self) -> Vec<Option<String>> {
        futures_util::future::join_all(
            self.clients
                .iter()
                .map(|c| async move { c.get_text("/metrics").await.ok() }),
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn servers(n: usize) -> Servers {
        let urls: Vec<String> = (0..n)
            .map(|i| format!("http://127.0.0.1:{}", 9000 + i))
            .collect();
        Servers::new(&urls, None).unwrap()
    }

    #[test]
    fn requests_go_to_the_least_loaded_server_and_ties_take_turns() {
        let s = servers(3);
        // Idle: each in turn.
        let picks: Vec<usize> = (0..6).map(|_| s.pick()).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        // Loaded: the one with the fewest in flight, whatever the turn.
        s.in_flight[0].store(2, Ordering::Relaxed);
        s.in_flight[1].store(0, Ordering::Relaxed);
        s.in_flight[2].store(1, Ordering::Relaxed);
        assert!((0..5).all(|_| s.pick() == 1));
        // A tie between two: they alternate; the busier one is skipped.
        s.in_flight[2].store(0, Ordering::Relaxed);
        let picks: Vec<usize> = (0..4).map(|_| s.pick()).collect();
        assert!(picks.iter().all(|&p| p != 0), "{picks:?}");
        assert!(picks.contains(&1) && picks.contains(&2), "{picks:?}");
        // One server: always it.
        let one = servers(1);
        assert!((0..3).all(|_| one.pick() == 0));
    }

    #[test]
    fn no_server_is_an_error() {
        assert!(Servers::new(&[], None).is_err());
        assert!(Servers::new(&["https://x".into()], None).is_err());
    }
}
