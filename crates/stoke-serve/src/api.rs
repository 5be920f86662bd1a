//! The OpenAI API's request and response bodies, as far as Stoke serves them, and its error
//! shape. A request is parsed in one place ([`parse`]): a body that is not JSON, a field of the
//! wrong type or a value out of range is an [`ApiError`] naming the field.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use stoke_engine::{EngineError, Params};

/// Choices per prompt at most (`n`).
pub const MAX_N: u32 = 16;
/// Prompts in one completions request at most.
pub const MAX_PROMPTS: usize = 64;

/// An error as the OpenAI API answers it: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// `invalid_request_error`, `not_found_error`, `rate_limit_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request field at fault.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds to wait before retrying (429, 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// 400: `param` is wrong.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
            retry_after: None,
        }
    }

    /// Any status, with no field at fault.
    pub fn status(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 500 for request `id`: the server failed while running it.
    pub fn internal(id: &str, what: impl std::fmt::Display) -> Self {
        Self::status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("request {id} failed: {what}"),
        )
    }

    /// The engine's refusal of a request, as the API answers it; `prompt_field` names the
    /// field the prompt came in (`prompt` or `messages`).
    pub fn from_engine(e: &EngineError, prompt_field: &str, id: &str) -> Self {
        match e {
            EngineError::Param(p) => Self::invalid(api_field(p.field, prompt_field), e.to_string()),
            EngineError::EmptyPrompt | EngineError::Token { .. } => {
                Self::invalid(prompt_field, e.to_string())
            }
            EngineError::TooLong {
                prompt, context, ..
            } => {
                let field = if prompt >= context {
                    prompt_field
                } else {
                    "max_tokens"
                };
                Self {
                    code: Some("context_length_exceeded"),
                    ..Self::invalid(field, e.to_string())
                }
            }
            EngineError::TooLarge { .. } => Self {
                code: Some("context_length_exceeded"),
                ..Self::invalid(prompt_field, e.to_string())
            },
            EngineError::QueueFull { .. } => Self {
                retry_after: Some(1),
                ..Self::status(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    format!("the server is at capacity: {e}; retry later"),
                )
            },
            EngineError::NoDetokenizer | EngineError::Config(_) | EngineError::Decode(_) => {
                Self::internal(id, e)
            }
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param,
            "code": self.code}})
    }
}

/// The API's name for a [`Params`] field.
fn api_field(field: &str, prompt_field: &str) -> String {
    match (field, prompt_field) {
        ("logprobs", "messages") => "top_logprobs".into(),
        (f, _) => f.into(),
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(
                "retry-after",
                HeaderValue::from(s.min(u32::MAX as u64) as u32),
            );
        }
        r
    }
}

/// Parses a request body: a JSON object (any syntax error, or nesting deeper than 128, is an
/// error naming the body).
pub fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid("body", format!("the body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::invalid("body", "the body must be a JSON object"));
    }
    Ok(v)
}

/// Reads the fields `T` declares from a request object (others are left alone), naming the
/// path of a field that does not fit.
pub fn fields<T: serde::de::DeserializeOwned>(v: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || path.is_empty() {
            ApiError::invalid("body", format!("the body is not a valid request: {inner}"))
        } else {
            ApiError::invalid(path.clone(), format!("{path}: {inner}"))
        }
    })
}

/// A body's common fields and its endpoint's own.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<(Common, T), ApiError> {
    let v = parse_body(body)?;
    Ok((fields(&v)?, fields(&v)?))
}

/// A string, or a list of them (`stop`).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

/// `prompt`: text, texts, token ids, or lists of token ids.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields both endpoints take.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub stop: Option<OneOrMany>,
    pub seed: Option<i64>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// Ignored (the API's end-user id).
    pub user: Option<String>,
    // Extensions other OpenAI-compatible servers take.
    /// Sample among the k most likely tokens (0 or -1: off).
    pub top_k: Option<i64>,
    /// Divide positive (multiply negative) logits of tokens already seen (1: off).
    pub repetition_penalty: Option<f32>,
    pub stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub ignore_eos: bool,
    pub min_p: Option<f32>,
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Log-probabilities of each token and this many alternatives.
    pub logprobs: Option<u32>,
    #[serde(default)]
    pub echo: bool,
    pub best_of: Option<u32>,
    pub suffix: Option<String>,
}

/// One part of a message's content.
#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// A message's content: text or parts.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    pub name: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<u32>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub response_format: Option<Value>,
}

/// `POST /tokenize`: a prompt or messages, and their tokens.
#[derive(Clone, Debug, Deserialize)]
pub struct TokenizeRequest {
    pub prompt: Option<String>,
    pub messages: Option<Vec<Message>>,
    pub add_special_tokens: Option<bool>,
}

impl Message {
    /// The message's text: its content, or its text parts joined.
    pub fn text(&self, i: usize) -> Result<String, ApiError> {
        match &self.content {
            None => Ok(String::new()),
            Some(Content::Text(t)) => Ok(t.clone()),
            Some(Content::Parts(parts)) => {
                let mut out = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => out.push_str(t),
                        ("text", None) => {
                            return Err(ApiError::invalid(
                                format!("messages[{i}].content[{j}].text"),
                                "a text part needs `text`",
                            ));
                        }
                        (other, _) => {
                            return Err(ApiError::invalid(
                                format!("messages[{i}].content[{j}].type"),
                                format!(
                                    "content parts of type `{other}` are not supported (text is)"
                                ),
                            ));
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

/// Refuses what Stoke does not do rather than ignore it.
fn unsupported(c: &Common) -> Result<(), ApiError> {
    let nonzero = |v: Option<f32>| v.is_some_and(|v| v != 0.0);
    for (field, set) in [
        ("frequency_penalty", nonzero(c.frequency_penalty)),
        ("presence_penalty", nonzero(c.presence_penalty)),
    ] {
        if set {
            return Err(ApiError::invalid(
                field,
                format!(
                    "{field} is not supported; repetition_penalty (a multiplicative penalty on \
                     tokens already seen, 1: off) is"
                ),
            ));
        }
    }
    if c.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
        return Err(ApiError::invalid(
            "logit_bias",
            "logit_bias is not supported",
        ));
    }
    if nonzero(c.min_p) {
        return Err(ApiError::invalid(
            "min_p",
            "min_p is not supported; top_p and top_k are",
        ));
    }
    Ok(())
}

/// What a request asks for, checked against the model: the engine's [`Params`] (for choice 0),
/// the number of choices and the stream options.
#[derive(Clone, Debug)]
pub struct Generation {
    pub params: Params,
    pub n: u32,
    pub stream: bool,
    pub include_usage: bool,
}

/// The engine's parameters from the common fields; `max_tokens` as the endpoint resolved it
/// (`None`: the rest of the context), `logprobs` as the endpoint reads it; errors name the
/// endpoint's fields (`prompt_field`: `prompt` or `messages`).
pub fn generation(
    prompt_field: &str,
    c: &Common,
    max_tokens: Option<u64>,
    logprobs: Option<u32>,
    context: usize,
    prompt_tokens: usize,
    vocab: usize,
) -> Result<Generation, ApiError> {
    unsupported(c)?;
    let n = c.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::invalid(
            "n",
            format!("n: {n} is not allowed (expected 1 to {MAX_N})"),
        ));
    }
    if c.stream_options.is_some() && !c.stream {
        return Err(ApiError::invalid(
            "stream_options",
            "stream_options is only allowed with stream: true",
        ));
    }
    if prompt_tokens >= context {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid(
                prompt_field,
                format!(
                    "the prompt has {prompt_tokens} tokens; the context holds {context} (prompt \
                     and output)"
                ),
            )
        });
    }
    let room = context - prompt_tokens;
    let max_tokens = match max_tokens {
        Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
        None => room,
    };
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 && (k as u64) <= vocab as u64 => k as u32,
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("top_k: {k} is not allowed (expected -1 or 0 (off), or 1 to {vocab})"),
            ));
        }
    };
    let params = Params {
        max_tokens,
        temperature: c.temperature.unwrap_or(1.0),
        top_k,
        top_p: c.top_p.unwrap_or(1.0),
        repetition_penalty: c.repetition_penalty.unwrap_or(1.0),
        seed: c.seed.map(|s| s as u64),
        choice: 0,
        stop: c.stop.clone().map(OneOrMany::into_vec).unwrap_or_default(),
        stop_token_ids: c.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: c.ignore_eos,
        logprobs,
    };
    params
        .validate(vocab)
        .map_err(|e| ApiError::invalid(api_field(e.field, prompt_field), e.to_string()))?;
    if params.max_tokens > room {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid(
                "max_tokens",
                format!(
                    "max_tokens: {} with a prompt of {prompt_tokens} tokens is over the context \
                     of {context} (at most {room})",
                    params.max_tokens
                ),
            )
        });
    }
    Ok(Generation {
        params,
        n,
        stream: c.stream,
        include_usage: c.stream_options.is_some_and(|o| o.include_usage),
    })
}

/// `usage`.
pub fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_fields_are_named() {
        let e =
            parse::<CompletionRequest>(br#"{"prompt": "hi", "temperature": "hot"}"#).unwrap_err();
        assert!(e.message.contains("temperature"), "{e:?}");
        assert_eq!(e.param.as_deref(), Some("temperature"), "{e:?}");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let e = parse::<ChatRequest>(br#"{"messages": [{"role": 3}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"), "{e:?}");
        let e = parse::<CompletionRequest>(br#"{"prompt": "hi"} x"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("body"));
        let e = parse::<CompletionRequest>(b"{\"prompt\": \"hi\"").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("body"), "{e:?}");
        let deep = "[".repeat(10_000);
        let body = format!(r#"{{"prompt": {deep}"#);
        assert!(parse::<CompletionRequest>(body.as_bytes()).is_err());
        let (c, r): (_, CompletionRequest) =
            parse(br#"{"prompt": [[1, 2], [3]], "stop": "x", "n": 2, "user": "u"}"#).unwrap();
        assert!(matches!(r.prompt, Prompt::TokenLists(ref v) if v.len() == 2));
        assert_eq!(c.n, Some(2));
        let e = parse::<CompletionRequest>(b"[1]").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("body"));
        let e = parse::<CompletionRequest>(br#"{"max_tokens": 3}"#).unwrap_err();
        assert!(e.message.contains("prompt"), "{e:?}");
    }

    #[test]
    fn generation_checks_ranges_and_the_context() {
        let c = |j: &str| parse::<CompletionRequest>(j.as_bytes()).unwrap().0;
        let g = generation(
            "prompt",
            &c(r#"{"prompt": "", "max_tokens": 5}"#),
            Some(5),
            None,
            100,
            10,
            50,
        )
        .unwrap();
        assert_eq!(g.params.max_tokens, 5);
        assert_eq!(g.params.temperature, 1.0);
        let field = |j: &str, max: Option<u64>| {
            generation("prompt", &c(j), max, None, 100, 10, 50)
                .unwrap_err()
                .param
                .unwrap()
        };
        assert_eq!(field(r#"{"prompt": "", "top_p": 1.5}"#, None), "top_p");
        assert_eq!(
            field(r#"{"prompt": "", "temperature": 1e30}"#, None),
            "temperature"
        );
        assert_eq!(field(r#"{"prompt": "", "n": 0}"#, None), "n");
        assert_eq!(field(r#"{"prompt": "", "top_k": 51}"#, None), "top_k");
        assert_eq!(field(r#"{"prompt": ""}"#, Some(91)), "max_tokens");
        assert_eq!(field(r#"{"prompt": ""}"#, Some(0)), "max_tokens");
        assert_eq!(
            field(r#"{"prompt": "", "presence_penalty": 0.5}"#, None),
            "presence_penalty"
        );
        assert_eq!(
            field(
                r#"{"prompt": "", "stream_options": {"include_usage": true}}"#,
                None
            ),
            "stream_options"
        );
        // Without max_tokens: the rest of the context.
        let g = generation("prompt", &c(r#"{"prompt": ""}"#), None, None, 100, 10, 50).unwrap();
        assert_eq!(g.params.max_tokens, 90);
        let e =
            generation("prompt", &c(r#"{"prompt": ""}"#), None, None, 100, 100, 50).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert_eq!(e.code, Some("context_length_exceeded"));
        // The chat endpoint's names.
        let e = generation(
            "messages",
            &c(r#"{"prompt": ""}"#),
            None,
            None,
            100,
            100,
            50,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = generation(
            "messages",
            &c(r#"{"prompt": ""}"#),
            None,
            Some(21),
            100,
            10,
            50,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
    }
}
