//! The HTTP side: the routes, the handlers that turn OpenAI requests into engine requests and
//! the engine's updates into responses (whole, or streamed as server-sent events), and the
//! middleware that gives every request an id, turns a panic into a 500 naming it and counts
//! responses.

use crate::api::{
    self, ApiError, ChatRequest, Common, CompletionRequest, Generation, MAX_PROMPTS, Prompt,
    TokenizeRequest,
};
use crate::chat::{ChatTemplate, TemplateMessage};
use crate::metrics::Metrics;
use crate::worker::{Finish, Submit, Update, Worker};
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Extension, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::{FutureExt, StreamExt};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use stoke::TokenLogprobs;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

/// What the handlers know of the model.
pub struct ModelInfo {
    /// The name `/v1/models` lists and requests may give as `model`.
    pub name: String,
    pub tokenizer: tokenizers::Tokenizer,
    /// `None`: chat requests are refused (the model has no template).
    pub chat: Option<ChatTemplate>,
    /// Tokens per request at most (prompt and output).
    pub context: usize,
    pub vocab: usize,
    /// Unix time the server started (`created`).
    pub created: u64,
}

/// The server's limits.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Each request ends after this long (its response says so).
    pub request_timeout: Duration,
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
}

/// Shared by every handler.
pub struct AppState {
    pub worker: Worker,
    pub model: ModelInfo,
    pub metrics: Arc<Metrics>,
    pub cfg: ServerConfig,
    /// Set at shutdown: new generation requests get 503.
    pub draining: AtomicBool,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(worker: Worker, model: ModelInfo, metrics: Arc<Metrics>, cfg: ServerConfig) -> Self {
        Self {
            worker,
            model,
            metrics,
            cfg,
            draining: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
        }
    }
}

/// A request's id (the `x-request-id` header, and the response's `id`).
#[derive(Clone, Debug)]
pub struct RequestId(pub String);

/// Every route, with the body limit and the id/panic/metrics middleware.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(state.cfg.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(state.clone(), frame))
        .with_state(state)
}

const ENDPOINTS: [&str; 7] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
];

/// Gives the request an id, answers a panic below with a 500 naming it, and counts the
/// response.
async fn frame(State(s): State<Arc<AppState>>, mut req: Request, next: Next) -> Response {
    let id = format!("{:016x}", s.next_id.fetch_add(1, Ordering::Relaxed));
    req.extensions_mut().insert(RequestId(id.clone()));
    let path = req.uri().path();
    let endpoint = ENDPOINTS
        .iter()
        .find(|e| **e == path)
        .copied()
        .unwrap_or("other");
    let mut res = match std::panic::AssertUnwindSafe(next.run(req))
        .catch_unwind()
        .await
    {
        Ok(r) => r,
        Err(p) => {
            let msg = stoke_llama::panic_message(p.as_ref());
            tracing::error!("stoke serve: request {id} panicked: {msg}");
            ApiError::internal(&id, "an internal error (the server logged it)").into_response()
        }
    };
    if let Ok(v) = HeaderValue::from_str(&id) {
        res.headers_mut().insert("x-request-id", v);
    }
    s.metrics.request(endpoint, res.status().as_u16());
    res
}

async fn not_found() -> ApiError {
    ApiError::status(
        StatusCode::NOT_FOUND,
        "not_found_error",
        "no such endpoint (POST /v1/completions, POST /v1/chat/completions, GET /v1/models, \
         POST /tokenize, POST /detokenize, GET /health, GET /metrics)",
    )
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    if !s.worker.alive() {
        ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the engine has stopped",
        )
        .into_response()
    } else if s.draining.load(Ordering::Relaxed) {
        ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the server is shutting down",
        )
        .into_response()
    } else {
        axum::Json(json!({"status": "ok"})).into_response()
    }
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    (
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
        .into_response()
}

async fn models(State(s): State<Arc<AppState>>) -> Response {
    axum::Json(
        json!({"object": "list", "data": [{"id": s.model.name, "object": "model",
        "created": s.model.created, "owned_by": "stoke", "max_model_len": s.model.context}]}),
    )
    .into_response()
}

/// The body, or the error its reading gave (413 over the limit).
fn body(b: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    b.map_err(|r| {
        let status = r.status();
        let msg = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "the request body is over the server's limit".to_string()
        } else {
            format!("reading the request body: {}", r.body_text())
        };
        ApiError {
            param: Some("body".into()),
            ..ApiError::status(status, "invalid_request_error", msg)
        }
    })
}

/// A generation request's fields, once the server is taking requests, the body is read and
/// parsed and its `model` is this server's.
fn request<T: serde::de::DeserializeOwned>(
    s: &AppState,
    b: Result<Bytes, BytesRejection>,
) -> Result<(Common, T), ApiError> {
    check_open(s)?;
    let b = body(b)?;
    let (c, r): (Common, T) = api::parse(&b)?;
    check_model(s, &c.model)?;
    Ok((c, r))
}

fn check_model(s: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if *m != s.model.name => Err(ApiError {
            code: Some("model_not_found"),
            param: Some("model".into()),
            ..ApiError::status(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!(
                    "the model `{m}` does not exist; this server serves `{}`",
                    s.model.name
                ),
            )
        }),
        _ => Ok(()),
    }
}

fn check_open(s: &AppState) -> Result<(), ApiError> {
    if s.draining.load(Ordering::Relaxed) {
        return Err(ApiError {
            retry_after: Some(5),
            ..ApiError::status(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "the server is shutting down",
            )
        });
    }
    Ok(())
}

fn encode(s: &AppState, text: &str, special: bool, field: &str) -> Result<Vec<u32>, ApiError> {
    let e = s
        .model
        .tokenizer
        .encode(text, special)
        .map_err(|e| ApiError::invalid(field, format!("{field}: tokenizing: {e}")))?;
    Ok(e.get_ids().to_vec())
}

/// The prompt the template makes of `messages`.
fn chat_prompt(s: &AppState, messages: &[api::Message]) -> Result<String, ApiError> {
    let Some(t) = &s.model.chat else {
        return Err(ApiError::invalid(
            "messages",
            "this model has no chat template; use /v1/completions",
        ));
    };
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages is empty"));
    }
    let msgs = messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            Ok(TemplateMessage {
                role: m.role.clone(),
                content: m.text(i)?,
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    t.render(&msgs)
        .map_err(|e| ApiError::invalid("messages", format!("the chat template refused them: {e}")))
}

async fn tokenize(
    State(s): State<Arc<AppState>>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let b = body(b)?;
    let v = api::parse_body(&b)?;
    let r: TokenizeRequest = api::fields(&v)?;
    let tokens = match (&r.prompt, &r.messages) {
        (Some(p), None) => encode(&s, p, r.add_special_tokens.unwrap_or(true), "prompt")?,
        (None, Some(m)) => encode(
            &s,
            &chat_prompt(&s, m)?,
            r.add_special_tokens.unwrap_or(false),
            "messages",
        )?,
        _ => {
            return Err(ApiError::invalid(
                "body",
                "give either `prompt` or `messages`",
            ));
        }
    };
    Ok(axum::Json(json!({"count": tokens.len(), "tokens": tokens,
        "max_model_len": s.model.context}))
    .into_response())
}

async fn detokenize(
    State(s): State<Arc<AppState>>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    struct Detok {
        tokens: Vec<u32>,
    }
    let b = body(b)?;
    let v = api::parse_body(&b)?;
    let r: Detok = api::fields(&v)?;
    if let Some(t) = r.tokens.iter().find(|&&t| t as usize >= s.model.vocab) {
        return Err(ApiError::invalid(
            "tokens",
            format!("token {t} is past the vocabulary of {}", s.model.vocab),
        ));
    }
    let text = s
        .model
        .tokenizer
        .decode(&r.tokens, false)
        .map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
    Ok(axum::Json(json!({"prompt": text})).into_response())
}

/// Which endpoint a generation came in on: the shape of its responses.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Completion,
    Chat { logprobs: bool },
}

impl Kind {
    fn prompt_field(self) -> &'static str {
        match self {
            Kind::Completion => "prompt",
            Kind::Chat { .. } => "messages",
        }
    }
}

async fn completions(
    State(s): State<Arc<AppState>>,
    Extension(id): Extension<RequestId>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (c, r): (Common, CompletionRequest) = request(&s, b)?;
    if r.echo {
        return Err(ApiError::invalid("echo", "echo is not supported"));
    }
    if r.suffix.as_ref().is_some_and(|x| !x.is_empty()) {
        return Err(ApiError::invalid("suffix", "suffix is not supported"));
    }
    if r.best_of.is_some_and(|b| Some(b) != c.n && b != 1) {
        return Err(ApiError::invalid(
            "best_of",
            "best_of other than n is not supported",
        ));
    }
    let prompts = match r.prompt {
        Prompt::Text(t) => vec![encode(&s, &t, true, "prompt")?],
        Prompt::Texts(ts) => ts
            .iter()
            .map(|t| encode(&s, t, true, "prompt"))
            .collect::<Result<_, _>>()?,
        Prompt::Tokens(t) => vec![t],
        Prompt::TokenLists(l) => l,
    };
    if prompts.is_empty() || prompts.len() > MAX_PROMPTS {
        return Err(ApiError::invalid(
            "prompt",
            format!("give 1 to {MAX_PROMPTS} prompts (got {})", prompts.len()),
        ));
    }
    for p in &prompts {
        check_prompt(&s, p, "prompt")?;
    }
    // The legacy endpoint's default is 16 tokens.
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let g = api::generation(
        "prompt",
        &c,
        Some(c.max_tokens.unwrap_or(16)),
        r.logprobs,
        s.model.context,
        longest,
        s.model.vocab,
    )?;
    generate(s, id, Kind::Completion, prompts, g).await
}

async fn chat_completions(
    State(s): State<Arc<AppState>>,
    Extension(id): Extension<RequestId>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (c, r): (Common, ChatRequest) = request(&s, b)?;
    if r.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::invalid("tools", "tools are not supported"));
    }
    if r.tool_choice
        .as_ref()
        .is_some_and(|t| t != "none" && t != "auto")
    {
        return Err(ApiError::invalid(
            "tool_choice",
            "tool_choice is not supported",
        ));
    }
    if let Some(f) = &r.response_format
        && f.get("type").and_then(Value::as_str) != Some("text")
    {
        return Err(ApiError::invalid(
            "response_format",
            "only response_format {\"type\": \"text\"} is supported",
        ));
    }
    if r.top_logprobs.is_some() && !r.logprobs {
        return Err(ApiError::invalid(
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        ));
    }
    let prompt = encode(&s, &chat_prompt(&s, &r.messages)?, false, "messages")?;
    check_prompt(&s, &prompt, "messages")?;
    let logprobs = r.logprobs.then(|| r.top_logprobs.unwrap_or(0));
    let max_tokens = r.max_completion_tokens.or(c.max_tokens);
    let g = api::generation(
        "messages",
        &c,
        max_tokens,
        logprobs,
        s.model.context,
        prompt.len(),
        s.model.vocab,
    )?;
    generate(
        s,
        id,
        Kind::Chat {
            logprobs: r.logprobs,
        },
        vec![prompt],
        g,
    )
    .await
}

fn check_prompt(s: &AppState, p: &[u32], field: &str) -> Result<(), ApiError> {
    if p.is_empty() {
        return Err(ApiError::invalid(
            field,
            format!("{field}: the prompt is empty"),
        ));
    }
    if let Some(t) = p.iter().find(|&&t| t as usize >= s.model.vocab) {
        return Err(ApiError::invalid(
            field,
            format!(
                "{field}: token {t} is past the vocabulary of {}",
                s.model.vocab
            ),
        ));
    }
    Ok(())
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One choice as it accumulates.
#[derive(Default)]
struct ChoiceState {
    text: String,
    tokens: usize,
    logprobs: Vec<(u32, TokenLogprobs)>,
    finish: Option<String>,
}

/// Submits every choice and waits until the engine took or refused them all; updates that
/// come early are kept.
async fn submit(
    s: &AppState,
    id: &RequestId,
    kind: Kind,
    prompts: Vec<Vec<u32>>,
    g: &Generation,
) -> Result<(UnboundedReceiver<(usize, Update)>, Vec<(usize, Update)>), ApiError> {
    let (tx, mut rx) = unbounded_channel();
    let deadline = Instant::now() + s.cfg.request_timeout;
    let n = g.n as usize;
    let total = prompts.len() * n;
    for (i, p) in prompts.into_iter().enumerate() {
        for j in 0..n {
            let mut params = g.params.clone();
            params.choice = j as u32;
            let ok = s.worker.submit(Submit {
                prompt: p.clone(),
                params,
                choice: i * n + j,
                deadline,
                updates: tx.clone(),
            });
            if !ok {
                return Err(ApiError::status(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    "the engine has stopped",
                ));
            }
        }
    }
    drop(tx);
    let mut early = Vec::new();
    let mut answered = 0;
    while answered < total {
        match rx.recv().await {
            Some((_, Update::Accepted)) => answered += 1,
            Some((_, Update::Rejected(e))) => {
                return Err(ApiError::from_engine(&e, kind.prompt_field(), &id.0));
            }
            Some(u) => early.push(u),
            None => return Err(ApiError::internal(&id.0, "the engine stopped")),
        }
    }
    Ok((rx, early))
}

async fn generate(
    s: Arc<AppState>,
    id: RequestId,
    kind: Kind,
    prompts: Vec<Vec<u32>>,
    g: Generation,
) -> Result<Response, ApiError> {
    let prompt_lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let (rx, early) = submit(&s, &id, kind, prompts, &g).await?;
    let n = g.n as usize;
    let mut choices: Vec<ChoiceState> = (0..prompt_lens.len() * n)
        .map(|_| ChoiceState::default())
        .collect();
    let want_logprobs = g.params.logprobs.is_some();
    let created = now_unix();
    let rid = match kind {
        Kind::Completion => format!("cmpl-{}", id.0),
        Kind::Chat { .. } => format!("chatcmpl-{}", id.0),
    };
    if g.stream {
        let stream = Streamer {
            s: s.clone(),
            id: id.0.clone(),
            kind,
            rid,
            created,
            rx,
            early: early.into(),
            choices,
            want_logprobs,
            include_usage: g.include_usage,
            done: false,
            started: false,
            prompt_tokens: prompt_lens.iter().sum(),
        };
        let events = futures_util::stream::unfold(stream, |mut st| async move {
            let out = st.next_events().await?;
            Some((futures_util::stream::iter(out), st))
        })
        .flatten()
        .map(Ok::<_, std::convert::Infallible>);
        return Ok(Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let mut rx = rx;
    let mut pending: std::collections::VecDeque<(usize, Update)> = early.into();
    let mut open = choices.len();
    while open > 0 {
        let (c, u) = match pending.pop_front() {
            Some(u) => u,
            None => match rx.recv().await {
                Some(u) => u,
                None => return Err(ApiError::internal(&id.0, "the engine stopped")),
            },
        };
        let ch = &mut choices[c];
        match u {
            Update::Token {
                token,
                text,
                logprobs,
            } => {
                ch.text.push_str(&text);
                ch.tokens += 1;
                if let Some(l) = logprobs {
                    ch.logprobs.push((token, l));
                }
            }
            Update::Finished { text, reason, .. } => {
                match reason {
                    Finish::Deadline => {
                        return Err(ApiError::status(
                            StatusCode::GATEWAY_TIMEOUT,
                            "timeout_error",
                            format!(
                                "request {} did not finish within the server's {} s",
                                id.0,
                                s.cfg.request_timeout.as_secs()
                            ),
                        ));
                    }
                    Finish::Shutdown => {
                        return Err(ApiError::status(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "server_error",
                            "the server shut down before the request finished",
                        ));
                    }
                    Finish::Engine(_) => {}
                }
                ch.text.push_str(&text);
                ch.finish = Some(reason.openai().into());
                open -= 1;
            }
            Update::Failed(why) => return Err(ApiError::internal(&id.0, why)),
            Update::Accepted | Update::Rejected(_) => {}
        }
    }
    let completion: usize = choices.iter().map(|c| c.tokens).sum();
    let prompt: usize = prompt_lens.iter().sum();
    let tok = &s.model.tokenizer;
    let body = match kind {
        Kind::Completion => json!({
            "id": rid, "object": "text_completion", "created": created, "model": s.model.name,
            "choices": choices.iter().enumerate().map(|(i, c)| json!({
                "index": i, "text": c.text,
                "logprobs": if want_logprobs { completion_logprobs(tok, &c.logprobs, 0) } else { Value::Null },
                "finish_reason": c.finish,
            })).collect::<Vec<_>>(),
            "usage": api::usage(prompt, completion),
        }),
        Kind::Chat { logprobs } => json!({
            "id": rid, "object": "chat.completion", "created": created, "model": s.model.name,
            "choices": choices.iter().enumerate().map(|(i, c)| json!({
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": if logprobs { chat_logprobs(tok, &c.logprobs) } else { Value::Null },
                "finish_reason": c.finish,
            })).collect::<Vec<_>>(),
            "usage": api::usage(prompt, completion),
        }),
    };
    Ok(axum::Json(body).into_response())
}

fn token_text(tok: &tokenizers::Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

/// The completions endpoint's `logprobs` for these tokens (`offset`: the text's length before
/// them).
fn completion_logprobs(
    tok: &tokenizers::Tokenizer,
    l: &[(u32, TokenLogprobs)],
    mut offset: usize,
) -> Value {
    let mut tokens = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for (id, lp) in l {
        let t = token_text(tok, *id);
        offsets.push(offset);
        offset += t.len();
        tokens.push(t);
        lps.push(lp.logprob);
        let top: serde_json::Map<String, Value> = lp
            .top
            .iter()
            .map(|&(i, p)| (token_text(tok, i), json!(p)))
            .collect();
        tops.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

/// The chat endpoint's `logprobs`.
fn chat_logprobs(tok: &tokenizers::Tokenizer, l: &[(u32, TokenLogprobs)]) -> Value {
    let entry = |id: u32, p: f32| {
        let t = token_text(tok, id);
        json!({"token": t, "logprob": p, "bytes": t.as_bytes()})
    };
    json!({"content": l.iter().map(|(id, lp)| {
        let mut e = entry(*id, lp.logprob);
        e["top_logprobs"] = Value::Array(lp.top.iter().map(|&(i, p)| entry(i, p)).collect());
        e
    }).collect::<Vec<_>>()})
}

/// A streamed response's state: the engine's updates in, server-sent events out.
struct Streamer {
    s: Arc<AppState>,
    id: String,
    kind: Kind,
    rid: String,
    created: u64,
    rx: UnboundedReceiver<(usize, Update)>,
    early: std::collections::VecDeque<(usize, Update)>,
    choices: Vec<ChoiceState>,
    want_logprobs: bool,
    include_usage: bool,
    started: bool,
    done: bool,
    prompt_tokens: usize,
}

impl Streamer {
    fn chunk(
        &self,
        index: usize,
        text: Option<&str>,
        lp: Option<Value>,
        finish: Option<&str>,
    ) -> SseEvent {
        let mut v = match self.kind {
            Kind::Completion => json!({
                "id": self.rid, "object": "text_completion", "created": self.created,
                "model": self.s.model.name,
                "choices": [{"index": index, "text": text.unwrap_or(""),
                    "logprobs": lp, "finish_reason": finish}],
            }),
            Kind::Chat { .. } => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                json!({
                    "id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.s.model.name,
                    "choices": [{"index": index, "delta": delta, "logprobs": lp,
                        "finish_reason": finish}],
                })
            }
        };
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        SseEvent::default().data(v.to_string())
    }

    /// The events for the next update; `None` after `[DONE]`.
    async fn next_events(&mut self) -> Option<Vec<SseEvent>> {
        if self.done {
            return None;
        }
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            if matches!(self.kind, Kind::Chat { .. }) {
                for i in 0..self.choices.len() {
                    let mut v = json!({
                        "id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                        "model": self.s.model.name,
                        "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                            "logprobs": null, "finish_reason": null}],
                    });
                    if self.include_usage {
                        v["usage"] = Value::Null;
                    }
                    out.push(SseEvent::default().data(v.to_string()));
                }
                return Some(out);
            }
        }
        let next = match self.early.pop_front() {
            Some(u) => Some(u),
            None => self.rx.recv().await,
        };
        let Some((c, u)) = next else {
            out.push(self.error(ApiError::internal(&self.id, "the engine stopped")));
            out.push(SseEvent::default().data("[DONE]"));
            self.done = true;
            return Some(out);
        };
        match u {
            Update::Token {
                token,
                text,
                logprobs,
            } => {
                let offset = self.choices[c].text.len();
                self.choices[c].tokens += 1;
                self.choices[c].text.push_str(&text);
                let lp = match (&logprobs, self.want_logprobs) {
                    (Some(l), true) => {
                        let one = [(token, l.clone())];
                        let tok = &self.s.model.tokenizer;
                        Some(match self.kind {
                            Kind::Completion => completion_logprobs(tok, &one, offset),
                            Kind::Chat { .. } => chat_logprobs(tok, &one),
                        })
                    }
                    _ => None,
                };
                out.push(self.chunk(c, Some(&text), lp, None));
            }
            Update::Finished { text, reason, .. } => {
                match reason {
                    Finish::Deadline => out.push(self.error(ApiError::status(
                        StatusCode::GATEWAY_TIMEOUT,
                        "timeout_error",
                        format!(
                            "the request did not finish within the server's {} s",
                            self.s.cfg.request_timeout.as_secs()
                        ),
                    ))),
                    Finish::Shutdown => out.push(self.error(ApiError::status(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "server_error",
                        "the server shut down before the request finished",
                    ))),
                    Finish::Engine(_) => {}
                }
                if !text.is_empty() {
                    self.choices[c].text.push_str(&text);
                    out.push(self.chunk(c, Some(&text), None, None));
                }
                let finish = reason.openai().to_string();
                self.choices[c].finish = Some(finish.clone());
                out.push(self.chunk(c, None, None, Some(&finish)));
                if self.choices.iter().all(|c| c.finish.is_some()) {
                    if self.include_usage {
                        let completion = self.choices.iter().map(|c| c.tokens).sum();
                        let object = match self.kind {
                            Kind::Completion => "text_completion",
                            Kind::Chat { .. } => "chat.completion.chunk",
                        };
                        let v = json!({"id": self.rid, "object": object, "created": self.created,
                            "model": self.s.model.name, "choices": [],
                            "usage": api::usage(self.prompt_tokens, completion)});
                        out.push(SseEvent::default().data(v.to_string()));
                    }
                    out.push(SseEvent::default().data("[DONE]"));
                    self.done = true;
                }
            }
            Update::Failed(why) => {
                out.push(self.error(ApiError::internal(&self.id, why)));
                out.push(SseEvent::default().data("[DONE]"));
                self.done = true;
            }
            Update::Accepted | Update::Rejected(_) => {}
        }
        Some(out)
    }

    fn error(&self, e: ApiError) -> SseEvent {
        SseEvent::default().data(e.body().to_string())
    }
}
