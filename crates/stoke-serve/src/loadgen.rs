//! An open-loop load generator for an OpenAI-compatible server: seeded workloads (Poisson
//! arrivals, log-uniform prompt and output lengths, prompts as token ids), each request streamed
//! (`/v1/completions`, `ignore_eos` so that it produces exactly its `max_tokens`), and what
//! vLLM's `benchmark_serving` reports: requests/s, output tokens/s, time to first token and
//! inter-token latency percentiles, errors; over time too, for soak runs.

use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// One request of a schedule.
#[derive(Clone, Debug)]
pub struct Arrival {
    /// Seconds from the schedule's start.
    pub at: f64,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
}

/// A seeded workload: `n` requests, exponential gaps at `rate` per second (`f64::INFINITY`:
/// all at once), prompt lengths log-uniform in `prompt` and outputs in `output`, token ids
/// below `vocab`.
pub fn schedule(
    n: usize,
    rate: f64,
    prompt: (usize, usize),
    output: (usize, usize),
    vocab: usize,
    seed: u64,
) -> Vec<Arrival> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let log_uniform = |rng: &mut rand::rngs::StdRng, (lo, hi): (usize, usize)| {
        let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
        (rng.random_range(a..=b).exp().round() as usize).clamp(lo, hi)
    };
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            if rate.is_finite() {
                t += -(1.0 - rng.random::<f64>()).ln() / rate;
            }
            let len = log_uniform(&mut rng, prompt);
            Arrival {
                at: t,
                prompt: (0..len)
                    .map(|_| rng.random_range(1..vocab as u32))
                    .collect(),
                max_tokens: log_uniform(&mut rng, output),
            }
        })
        .collect()
}

/// A schedule as JSON (`{"name", "rate", "seed", "requests": [{"arrival_s", "prompt",
/// "max_tokens"}]}`), as the transformers peer (`scripts/peers/engine_torch.py`) replays it.
pub fn schedule_json(name: &str, rate: f64, seed: u64, s: &[Arrival]) -> Value {
    json!({"name": name, "rate": if rate.is_finite() { json!(rate) } else { json!("inf") },
        "seed": seed,
        "requests": s.iter().map(|a| json!({"arrival_s": a.at, "prompt": a.prompt,
            "max_tokens": a.max_tokens})).collect::<Vec<_>>()})
}

/// Percentiles p50, p90, p99 of `v` (nearest rank) and the mean, in the values' unit.
pub fn percentiles(mut v: Vec<f64>) -> Value {
    if v.is_empty() {
        return json!(null);
    }
    v.sort_by(f64::total_cmp);
    let at = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    json!({"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": v.iter().sum::<f64>() / v.len() as f64})
}

/// What happened to one request.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// Seconds from the run's start: sent, first token, end.
    pub sent: f64,
    pub first: Option<f64>,
    pub end: f64,
    /// Gaps between consecutive tokens (s).
    pub gaps: Vec<f64>,
    pub output_tokens: usize,
    /// Why it failed (an HTTP status, an error event, a broken stream).
    pub error: Option<String>,
}

/// Where requests go.
#[derive(Clone, Debug)]
pub struct Target {
    /// The server's base URL (`http://127.0.0.1:8000`).
    pub url: String,
    /// The `model` field, if any.
    pub model: Option<String>,
    pub timeout: Duration,
}

/// Sends `s` open-loop (each request at its arrival time, whatever is still running) and
/// returns each request's outcome, in schedule order, and the run's wall time.
pub async fn replay(client: &reqwest::Client, t: &Target, s: &[Arrival]) -> (Vec<Outcome>, f64) {
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(s.len());
    for a in s {
        let at = start + Duration::from_secs_f64(a.at);
        tokio::time::sleep_until(at.into()).await;
        let (client, t, a) = (client.clone(), t.clone(), a.clone());
        tasks.push(tokio::spawn(
            async move { one(&client, &t, &a, start).await },
        ));
    }
    let mut out = Vec::with_capacity(tasks.len());
    for task in tasks {
        out.push(task.await.unwrap_or_else(|e| Outcome {
            error: Some(format!("the request's task failed: {e}")),
            ..Default::default()
        }));
    }
    (out, start.elapsed().as_secs_f64())
}

/// One streamed request.
async fn one(client: &reqwest::Client, t: &Target, a: &Arrival, start: Instant) -> Outcome {
    use futures_util::StreamExt;
    let secs = |i: Instant| i.duration_since(start).as_secs_f64();
    let sent = Instant::now();
    let mut o = Outcome {
        sent: secs(sent),
        ..Default::default()
    };
    let mut body = json!({"prompt": a.prompt, "max_tokens": a.max_tokens, "temperature": 0.0,
        "stream": true, "stream_options": {"include_usage": true}, "ignore_eos": true});
    if let Some(m) = &t.model {
        body["model"] = json!(m);
    }
    let res = client
        .post(format!("{}/v1/completions", t.url))
        .timeout(t.timeout)
        .json(&body)
        .send()
        .await;
    let res = match res {
        Ok(r) if r.status().is_success() => r,
        Ok(r) => {
            let status = r.status();
            let text = r.text().await.unwrap_or_default();
            o.error = Some(format!("HTTP {status}: {text}"));
            o.end = secs(Instant::now());
            return o;
        }
        Err(e) => {
            o.error = Some(format!("sending: {e}"));
            o.end = secs(Instant::now());
            return o;
        }
    };
    let mut stream = res.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut last: Option<Instant> = None;
    let mut tokens = 0;
    let mut usage = None;
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                o.error = Some(format!("reading the stream: {e}"));
                break;
            }
        };
        let now = Instant::now();
        buf.extend_from_slice(&chunk);
        while let Some(i) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..i + 2).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                let Some(data) = line.strip_prefix("data: ") else {
                    continue;
                };
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    o.error = Some(format!("an event that is not JSON: {data}"));
                    continue;
                };
                if let Some(e) = v.get("error") {
                    o.error = Some(format!("error event: {e}"));
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    usage = u["completion_tokens"].as_u64();
                }
                let is_token = v["choices"]
                    .as_array()
                    .and_then(|c| c.first())
                    .is_some_and(|c| c["finish_reason"].is_null());
                if is_token {
                    tokens += 1;
                    match last {
                        None => o.first = Some(secs(now)),
                        Some(l) => o.gaps.push(now.duration_since(l).as_secs_f64()),
                    }
                    last = Some(now);
                }
            }
        }
    }
    if !done && o.error.is_none() {
        o.error = Some("the stream ended without [DONE]".into());
    }
    o.output_tokens = usage.map_or(tokens, |u| u as usize);
    o.end = secs(Instant::now());
    o
}

/// A run's summary: requests/s and output tokens/s over the wall time, latencies in ms.
pub fn summarize(outcomes: &[Outcome], wall: f64) -> Value {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
    let tokens: usize = ok.iter().map(|o| o.output_tokens).sum();
    let ms = |v: Vec<f64>| percentiles(v.into_iter().map(|x| x * 1e3).collect());
    let errors: Vec<&String> = outcomes.iter().filter_map(|o| o.error.as_ref()).collect();
    json!({
        "requests": outcomes.len(),
        "errors": errors.len(),
        "first_errors": errors.iter().take(3).collect::<Vec<_>>(),
        "wall_s": wall,
        "requests_per_s": ok.len() as f64 / wall.max(1e-9),
        "output_tokens": tokens,
        "output_tokens_per_s": tokens as f64 / wall.max(1e-9),
        "ttft_ms": ms(ok.iter().filter_map(|o| o.first.map(|f| f - o.sent)).collect()),
        "itl_ms": ms(ok.iter().flat_map(|o| o.gaps.iter().copied()).collect()),
        "e2e_ms": ms(ok.iter().map(|o| o.end - o.sent).collect()),
    })
}

/// The run cut into windows of `window` seconds by each request's end: per window its
/// requests, errors, and time to first token and inter-token p99 (ms).
pub fn over_time(outcomes: &[Outcome], window: f64) -> Value {
    let last = outcomes.iter().map(|o| o.end).fold(0.0, f64::max);
    let n = (last / window).ceil().max(1.0) as usize;
    let windows: Vec<Value> = (0..n)
        .map(|w| {
            let (lo, hi) = (w as f64 * window, (w + 1) as f64 * window);
            let here: Vec<&Outcome> = outcomes
                .iter()
                .filter(|o| o.end >= lo && o.end < hi)
                .collect();
            let ok: Vec<&&Outcome> = here.iter().filter(|o| o.error.is_none()).collect();
            let p99 = |v: Vec<f64>| percentiles(v)["p99"].as_f64().map(|x| x * 1e3);
            json!({
                "from_s": lo,
                "requests": here.len(),
                "errors": here.len() - ok.len(),
                "ttft_p99_ms": p99(ok.iter().filter_map(|o| o.first.map(|f| f - o.sent)).collect()),
                "itl_p99_ms": p99(ok.iter().flat_map(|o| o.gaps.iter().copied()).collect()),
            })
        })
        .collect();
    json!(windows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_are_seeded_and_in_range() {
        let a = schedule(500, 10.0, (32, 2048), (16, 512), 1000, 7);
        let b = schedule(500, 10.0, (32, 2048), (16, 512), 1000, 7);
        assert_eq!(a.len(), 500);
        assert!(
            a.iter()
                .zip(&b)
                .all(|(x, y)| x.at == y.at && x.prompt == y.prompt)
        );
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at));
        assert!(a.iter().all(|r| (32..=2048).contains(&r.prompt.len())
            && (16..=512).contains(&r.max_tokens)
            && r.prompt.iter().all(|&t| (1..1000).contains(&t))));
        // About `rate` arrivals per second.
        let rate = a.len() as f64 / a.last().unwrap().at;
        assert!((7.0..14.0).contains(&rate), "{rate}");
        assert!(
            schedule(4, f64::INFINITY, (1, 2), (1, 2), 9, 1)
                .iter()
                .all(|r| r.at == 0.0)
        );
        let p = percentiles((1..=100).map(f64::from).collect());
        assert_eq!(
            (p["p50"].as_f64(), p["p99"].as_f64()),
            (Some(50.0), Some(99.0))
        );
    }

    #[test]
    fn summaries_count_errors_and_windows() {
        let ok = |sent: f64, end: f64| Outcome {
            sent,
            first: Some(sent + 0.01),
            end,
            gaps: vec![0.002, 0.003],
            output_tokens: 3,
            error: None,
        };
        let bad = Outcome {
            error: Some("HTTP 429".into()),
            end: 1.5,
            ..Default::default()
        };
        let v = vec![ok(0.0, 0.5), ok(0.2, 1.2), bad];
        let s = summarize(&v, 2.0);
        assert_eq!(s["errors"], 1);
        assert_eq!(s["output_tokens"], 6);
        assert_eq!(s["requests_per_s"], 1.0);
        let w = over_time(&v, 1.0);
        assert_eq!(w.as_array().unwrap().len(), 2);
        assert_eq!(w[1]["errors"], 1);
        assert_eq!(w[0]["requests"], 1);
    }
}
