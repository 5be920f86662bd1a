//! The server's Prometheus metrics (`GET /metrics`, text format): requests by endpoint and
//! status, tokens, time to first token, inter-token latency and request latency histograms, and
//! the engine's queue, batch and KV pages.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub endpoint: String,
    pub status: String,
}

/// Every metric, registered under `stoke_`.
pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub request_latency: Histogram,
    pub client_disconnects: Counter,
    pub deadline_exceeded: Counter,
    pub engine_restarts: Counter,
    pub requests_waiting: Gauge,
    pub requests_running: Gauge,
    pub kv_pages_used: Gauge,
    pub kv_pages_total: Gauge,
    pub kv_pages_cached: Gauge,
    pub preemptions: Gauge,
    pub prefix_cache_hits: Gauge,
    pub engine_steps: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("stoke");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "http_requests",
            "HTTP requests answered, by endpoint and status",
            requests.clone(),
        );
        let counter = |r: &mut Registry, name: &str, help: &str| {
            let c = Counter::default();
            r.register(name, help, c.clone());
            c
        };
        let gauge = |r: &mut Registry, name: &str, help: &str| {
            let g = Gauge::default();
            r.register(name, help, g.clone());
            g
        };
        let hist = |r: &mut Registry, name: &str, help: &str, first: f64, n: u16| {
            let h = Histogram::new(exponential_buckets(first, 2.0, n));
            r.register(name, help, h.clone());
            h
        };
        let r = &mut registry;
        Self {
            requests,
            prompt_tokens: counter(
                r,
                "prompt_tokens",
                "Prompt tokens of requests the engine took",
            ),
            generation_tokens: counter(r, "generation_tokens", "Tokens generated"),
            time_to_first_token: hist(
                r,
                "time_to_first_token_seconds",
                "From a request's arrival at the engine to its first token",
                0.001,
                18,
            ),
            inter_token_latency: hist(
                r,
                "inter_token_latency_seconds",
                "Between consecutive tokens of a request",
                0.0001,
                18,
            ),
            request_latency: hist(
                r,
                "request_latency_seconds",
                "From a request's arrival at the engine to its end",
                0.01,
                16,
            ),
            client_disconnects: counter(
                r,
                "client_disconnects",
                "Requests aborted because their client went away",
            ),
            deadline_exceeded: counter(
                r,
                "deadline_exceeded",
                "Requests aborted at their deadline",
            ),
            engine_restarts: counter(
                r,
                "engine_restarts",
                "Times the engine failed and was made again (its requests got a 500)",
            ),
            requests_waiting: gauge(r, "requests_waiting", "Requests waiting for a lane"),
            requests_running: gauge(r, "requests_running", "Requests holding a lane"),
            kv_pages_used: gauge(r, "kv_pages_used", "KV pages held by requests"),
            kv_pages_total: gauge(r, "kv_pages_total", "KV pages in the pool"),
            kv_pages_cached: gauge(
                r,
                "kv_pages_cached",
                "KV pages holding a registered prompt prefix (held or idle)",
            ),
            preemptions: gauge(
                r,
                "preemptions",
                "Requests preempted since the engine was made",
            ),
            prefix_cache_hits: gauge(
                r,
                "prefix_cache_hits",
                "KV pages shared from the prefix cache since the engine was made",
            ),
            engine_steps: gauge(r, "engine_steps", "Engine steps since the engine was made"),
            registry,
        }
    }

    /// Counts one answered request.
    pub fn request(&self, endpoint: &str, status: u16) {
        self.requests
            .get_or_create(&RequestLabels {
                endpoint: endpoint.into(),
                status: status.to_string(),
            })
            .inc();
    }

    /// The engine's counters.
    pub fn engine(&self, s: &stoke_engine::EngineStats) {
        let g = |g: &Gauge, v: u64| {
            g.set(v.min(i64::MAX as u64) as i64);
        };
        g(&self.requests_waiting, s.waiting as u64);
        g(&self.requests_running, s.running as u64);
        g(&self.kv_pages_used, s.pages_used as u64);
        g(&self.kv_pages_total, s.pages_total as u64);
        g(&self.kv_pages_cached, s.pages_cached as u64);
        g(&self.preemptions, s.preemptions);
        g(&self.prefix_cache_hits, s.prefix_hits);
        g(&self.engine_steps, s.steps);
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        encode(&mut s, &self.registry).expect("writing to a String does not fail");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_render_as_prometheus_text() {
        let m = Metrics::new();
        m.request("/v1/completions", 200);
        m.time_to_first_token.observe(0.004);
        m.engine(&stoke_engine::EngineStats {
            pages_used: 3,
            pages_total: 10,
            ..Default::default()
        });
        let t = m.encode();
        assert!(
            t.contains(r#"stoke_http_requests_total{endpoint="/v1/completions",status="200"} 1"#),
            "{t}"
        );
        assert!(t.contains("stoke_kv_pages_used 3"), "{t}");
        assert!(
            t.contains("stoke_time_to_first_token_seconds_count 1"),
            "{t}"
        );
    }
}
