//! The engine's thread. It owns the model and the engine; handlers send it requests over a
//! channel ([`Worker::submit`]) and get each request's tokens back on the request's own channel.
//! Between steps it takes new requests, aborts those whose client went away (their channel is
//! closed) or whose deadline passed, and publishes the engine's counters. A step that fails or
//! panics fails the requests in flight (each gets [`Update::Failed`]); the engine is then made
//! again and serving goes on.

use crate::metrics::Metrics;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Instant;
use stoke::{FusedOps, TokenLogprobs};
use stoke_engine::{
    Detokenize, Engine, EngineConfig, EngineError, EngineModel, Event, FinishReason, Params,
    RequestId,
};
use tokio::sync::mpsc::UnboundedSender;

/// Why a request ended, as the server sees it.
#[derive(Clone, Debug, PartialEq)]
pub enum Finish {
    Engine(FinishReason),
    /// Its deadline passed.
    Deadline,
    /// The server is shutting down and its grace period is over.
    Shutdown,
}

impl Finish {
    /// The API's `finish_reason`.
    pub fn openai(&self) -> &'static str {
        match self {
            Self::Engine(r) => r.openai(),
            Self::Deadline | Self::Shutdown => "abort",
        }
    }
}

/// What a request hears from the engine, in order: [`Update::Accepted`] or
/// [`Update::Rejected`], then its tokens and one [`Update::Finished`] (or [`Update::Failed`]).
#[derive(Debug)]
pub enum Update {
    Accepted,
    Rejected(EngineError),
    Token {
        token: u32,
        text: String,
        logprobs: Option<TokenLogprobs>,
    },
    Finished {
        text: String,
        reason: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    /// The engine failed while running it.
    Failed(String),
}

/// One choice of a request: its prompt and parameters, its deadline, and where its updates go
/// (tagged with `choice`; the choices of one HTTP request share the channel).
pub struct Submit {
    pub prompt: Vec<u32>,
    pub params: Params,
    pub choice: usize,
    pub deadline: Instant,
    pub updates: UnboundedSender<(usize, Update)>,
}

enum Command {
    Submit(Submit),
    /// Ends every request in flight ([`Finish::Shutdown`]).
    AbortAll,
}

/// The handlers' side of the engine's thread.
#[derive(Clone)]
pub struct Worker {
    tx: mpsc::Sender<Command>,
    alive: Arc<AtomicBool>,
}

impl Worker {
    /// Queues `s` for the engine; `false` when the engine's thread has stopped.
    pub fn submit(&self, s: Submit) -> bool {
        self.tx.send(Command::Submit(s)).is_ok()
    }

    /// Ends every request in flight.
    pub fn abort_all(&self) {
        let _ = self.tx.send(Command::AbortAll);
    }

    /// Whether the engine's thread is running.
    pub fn alive(&self) -> bool {
        self.alive.load(Ordering::Relaxed)
    }
}

/// The receiving end, for the engine's thread ([`run`]).
pub struct Inbox {
    rx: mpsc::Receiver<Command>,
    alive: Arc<AtomicBool>,
}

/// A connected pair: handlers submit on the [`Worker`], the engine's thread [`run`]s the
/// [`Inbox`]. The thread stops once every `Worker` is dropped.
pub fn channel() -> (Worker, Inbox) {
    let (tx, rx) = mpsc::channel();
    let alive = Arc::new(AtomicBool::new(true));
    (
        Worker {
            tx,
            alive: alive.clone(),
        },
        Inbox { rx, alive },
    )
}

struct Active {
    choice: usize,
    updates: UnboundedSender<(usize, Update)>,
    deadline: Instant,
    arrived: Instant,
    last_token: Option<Instant>,
}

impl Active {
    fn send(&self, u: Update) {
        let _ = self.updates.send((self.choice, u));
    }
}

/// Serves `inbox` on engines over `model` until every [`Worker`] is dropped; `started` is
/// called once the first engine is made (with its configuration: the context clipped to the
/// model's). An engine that cannot be made ends the thread with the error (requests then get
/// 503s).
pub fn run<B: FusedOps, M: EngineModel<B>>(
    model: M,
    cfg: EngineConfig,
    detok: Arc<dyn Detokenize>,
    metrics: Arc<Metrics>,
    inbox: Inbox,
    started: impl FnOnce(&EngineConfig),
) -> Result<(), EngineError> {
    let _alive = AliveGuard(inbox.alive.clone());
    let mut active: HashMap<RequestId, Active> = HashMap::new();
    let mut started = Some(started);
    loop {
        let mut engine = Engine::new(&model, cfg.clone(), Some(detok.clone()))?;
        if let Some(f) = started.take() {
            f(engine.config());
        }
        metrics.engine(&engine.stats());
        match serve(&mut engine, &inbox.rx, &mut active, &metrics) {
            Ok(()) => return Ok(()),
            Err(why) => {
                tracing::error!(
                    "stoke serve: the engine failed ({why}); its {} requests fail with it, and a \
                     new engine is made",
                    active.len()
                );
                metrics.engine_restarts.inc();
                for (_, a) in active.drain() {
                    a.send(Update::Failed(why.clone()));
                }
            }
        }
    }
}

/// Marks the thread stopped when it ends, however it ends.
struct AliveGuard(Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Relaxed);
    }
}

/// Runs one engine; `Ok` once the channel closes, `Err` with why a step failed.
fn serve<B: FusedOps, M: EngineModel<B>>(
    engine: &mut Engine<B, M>,
    rx: &mpsc::Receiver<Command>,
    active: &mut HashMap<RequestId, Active>,
    metrics: &Metrics,
) -> Result<(), String> {
    loop {
        // New requests: wait for one when idle, else take what has come.
        if !engine.has_work() {
            match rx.recv() {
                Ok(c) => command(engine, c, active, metrics),
                Err(_) => return Ok(()),
            }
        }
        loop {
            match rx.try_recv() {
                Ok(c) => command(engine, c, active, metrics),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    if !engine.has_work() {
                        return Ok(());
                    }
                    break;
                }
            }
        }
        // Clients gone and deadlines passed.
        let now = Instant::now();
        let ended: Vec<(RequestId, Option<Finish>)> = active
            .iter()
            .filter_map(|(&id, a)| {
                if a.updates.is_closed() {
                    Some((id, None))
                } else if now >= a.deadline {
                    Some((id, Some(Finish::Deadline)))
                } else {
                    None
                }
            })
            .collect();
        for (id, why) in ended {
            let a = active.remove(&id).expect("listed");
            engine.abort(id).map_err(|e| e.to_string())?;
            match why {
                None => {
                    metrics.client_disconnects.inc();
                }
                Some(reason) => {
                    metrics.deadline_exceeded.inc();
                    a.send(Update::Finished {
                        text: String::new(),
                        reason,
                        prompt_tokens: 0,
                        completion_tokens: 0,
                    });
                }
            }
        }
        if engine.has_work() {
            let events = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.step()))
                .map_err(|p| {
                    format!(
                        "the engine panicked: {}",
                        stoke_llama::panic_message(p.as_ref())
                    )
                })?
                .map_err(|e| e.to_string())?;
            let now = Instant::now();
            for e in events {
                deliver(e, now, active, metrics);
            }
        }
        metrics.engine(&engine.stats());
    }
}

fn command<B: FusedOps, M: EngineModel<B>>(
    engine: &mut Engine<B, M>,
    c: Command,
    active: &mut HashMap<RequestId, Active>,
    metrics: &Metrics,
) {
    match c {
        Command::Submit(s) => {
            let prompt_tokens = s.prompt.len();
            let a = Active {
                choice: s.choice,
                updates: s.updates,
                deadline: s.deadline,
                arrived: Instant::now(),
                last_token: None,
            };
            if a.updates.is_closed() {
                return; // its client left while it was on its way
            }
            match engine.add(s.prompt, s.params) {
                Ok(id) => {
                    metrics.prompt_tokens.inc_by(prompt_tokens as u64);
                    a.send(Update::Accepted);
                    active.insert(id, a);
                }
                Err(e) => a.send(Update::Rejected(e)),
            }
        }
        Command::AbortAll => {
            for (id, a) in active.drain() {
                let _ = engine.abort(id);
                a.send(Update::Finished {
                    text: String::new(),
                    reason: Finish::Shutdown,
                    prompt_tokens: 0,
                    completion_tokens: 0,
                });
            }
        }
    }
}

fn deliver(e: Event, now: Instant, active: &mut HashMap<RequestId, Active>, metrics: &Metrics) {
    match e {
        Event::Token {
            id,
            token,
            text,
            logprobs,
        } => {
            let Some(a) = active.get_mut(&id) else {
                return; // aborted since
            };
            match a.last_token {
                None => metrics
                    .time_to_first_token
                    .observe(now.duration_since(a.arrived).as_secs_f64()),
                Some(t) => metrics
                    .inter_token_latency
                    .observe(now.duration_since(t).as_secs_f64()),
            }
            a.last_token = Some(now);
            metrics.generation_tokens.inc();
            a.send(Update::Token {
                token,
                text,
                logprobs,
            });
        }
        Event::Finished {
            id,
            text,
            reason,
            prompt_tokens,
            completion_tokens,
        } => {
            let Some(a) = active.remove(&id) else {
                return;
            };
            metrics
                .request_latency
                .observe(now.duration_since(a.arrived).as_secs_f64());
            a.send(Update::Finished {
                text,
                reason: Finish::Engine(reason),
                prompt_tokens,
                completion_tokens,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::DType;
    use stoke::DecodeError;
    use stoke_engine::DecoderSizes;

    type B = burn_ndarray::NdArray<f32>;

    /// A model whose prefill panics on a prompt holding token 7 (a kernel failing, say).
    struct Panicky(stoke_llama::model::Llama<B>);

    impl EngineModel<B> for Panicky {
        fn decode_spec(&self, sizes: DecoderSizes) -> stoke::DecodeSpec {
            EngineModel::<B>::decode_spec(&self.0, sizes)
        }
        fn max_positions(&self) -> usize {
            EngineModel::<B>::max_positions(&self.0)
        }
        fn vocab(&self) -> usize {
            EngineModel::<B>::vocab(&self.0)
        }
        fn plan(&self) -> stoke::Plan {
            EngineModel::<B>::plan(&self.0)
        }
        fn dtype(&self) -> DType {
            EngineModel::<B>::dtype(&self.0)
        }
        fn device(&self) -> <B as burn::tensor::backend::BackendTypes>::Device {
            EngineModel::<B>::device(&self.0)
        }
        fn prefill(
            &self,
            dec: &mut <B as FusedOps>::Decoder,
            ids: &[u32],
            seqs: &[stoke::PackedSeq],
            sample: &[usize],
        ) -> Result<(), DecodeError> {
            assert!(!ids.contains(&7), "token 7 breaks this model");
            EngineModel::<B>::prefill(&self.0, dec, ids, seqs, sample)
        }
        fn decode_forward(&self, dec: &mut <B as FusedOps>::Decoder) {
            EngineModel::<B>::decode_forward(&self.0, dec)
        }
    }

    struct Bytes;
    impl Detokenize for Bytes {
        fn decode(&self, ids: &[u32]) -> String {
            ids.iter()
                .map(|&i| char::from(b'a' + (i % 26) as u8))
                .collect()
        }
    }

    fn model() -> Panicky {
        use stoke_llama::synthetic::{PACKABLE, gguf, weights};
        let path =
            std::env::temp_dir().join(format!("stoke-serve-worker-{}.gguf", std::process::id()));
        std::fs::write(&path, gguf(&PACKABLE, &weights(&PACKABLE, true, 5))).unwrap();
        let l =
            stoke_llama::load::load_gguf::<B>(&path, &Default::default(), DType::F32, 128).unwrap();
        let _ = std::fs::remove_file(&path);
        Panicky(l.model.pinned())
    }

    /// Submits `prompt` and collects its updates until it ends.
    fn ask(w: &Worker, prompt: Vec<u32>, max_tokens: usize) -> Vec<Update> {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        assert!(w.submit(Submit {
            prompt,
            params: Params::greedy(max_tokens),
            choice: 0,
            deadline: Instant::now() + std::time::Duration::from_secs(60),
            updates: tx,
        }));
        let mut out = Vec::new();
        while let Some((_, u)) = rx.blocking_recv() {
            let end = matches!(
                u,
                Update::Finished { .. } | Update::Failed(_) | Update::Rejected(_)
            );
            out.push(u);
            if end {
                break;
            }
        }
        out
    }

    #[test]
    fn a_failing_step_fails_its_requests_and_serving_goes_on() {
        let (worker, inbox) = channel();
        let metrics = Arc::new(Metrics::new());
        let m = metrics.clone();
        let thread = std::thread::spawn(move || {
            let cfg = EngineConfig {
                max_running: 2,
                context: 96,
                page_size: 16,
                kv_pages: Some(20),
                ..Default::default()
            };
            run::<B, _>(model(), cfg, Arc::new(Bytes), m, inbox, |_| {})
        });
        let good = ask(&worker, vec![1, 2, 3], 4);
        assert!(matches!(good[0], Update::Accepted), "{good:?}");
        assert_eq!(
            good.iter()
                .filter(|u| matches!(u, Update::Token { .. }))
                .count(),
            4
        );
        let bad = ask(&worker, vec![1, 7, 3], 4);
        assert!(
            matches!(bad.last(), Some(Update::Failed(why)) if why.contains("token 7")),
            "{bad:?}"
        );
        assert_eq!(metrics.engine_restarts.get(), 1);
        // The engine was made again: the same request as before gets the same tokens.
        let again = ask(&worker, vec![1, 2, 3], 4);
        let tokens = |v: &[Update]| {
            v.iter()
                .filter_map(|u| match u {
                    Update::Token { token, .. } => Some(*token),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(tokens(&again), tokens(&good));
        assert!(worker.alive());
        drop(worker);
        thread.join().unwrap().unwrap();
    }
}
