//! A request's generation parameters, validated once when the request is added: every value out
//! of range is a [`ParamError`] naming the field, what was given and what is allowed.

/// Most stop strings a request may give.
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 256;
/// Highest temperature a request may ask for.
pub const MAX_TEMPERATURE: f32 = 100.0;
/// Highest repetition penalty a request may ask for.
pub const MAX_REPETITION_PENALTY: f32 = 10.0;

/// How one request generates.
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    /// Tokens to generate at most (the stop tokens and strings may end it sooner): at least 1.
    pub max_tokens: usize,
    /// 0: greedy (argmax). Otherwise the logits are divided by it before sampling: `0 ..=`
    /// [`MAX_TEMPERATURE`].
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0: off.
    pub top_k: u32,
    /// Keep the smallest set of most likely tokens holding at least this share of the
    /// probability: `(0, 1]`, 1: off.
    pub top_p: f32,
    /// Divides positive and multiplies negative logits of tokens already in the sequence
    /// (prompt included): `(0, ` [`MAX_REPETITION_PENALTY`] `]`, 1: off.
    pub repetition_penalty: f32,
    /// The draws' seed: the same seed, prompt and parameters give the same tokens whatever
    /// else is running. `None`: one from the engine's own generator.
    pub seed: Option<u64>,
    /// Which of several choices of one request this is (two choices with one seed draw
    /// differently).
    pub choice: u32,
    /// Generation ends after any of these strings; the text returned stops before it.
    pub stop: Vec<String>,
    /// Generation ends with any of these tokens (not returned), besides the model's EOS.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the model's EOS tokens.
    pub ignore_eos: bool,
    /// Log-probabilities of each generated token and of this many most likely ones (`0 ..=`
    /// [`stoke::MAX_TOP_LOGPROBS`]); `None`: none.
    pub logprobs: Option<u32>,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            max_tokens: 64,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: None,
            choice: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
        }
    }
}

/// A parameter out of its range.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{field}: {value} is not allowed (expected {expected})")]
pub struct ParamError {
    pub field: &'static str,
    pub value: String,
    pub expected: String,
}

fn err(field: &'static str, value: impl ToString, expected: impl ToString) -> ParamError {
    ParamError {
        field,
        value: value.to_string(),
        expected: expected.to_string(),
    }
}

impl Params {
    /// Greedy decoding of at most `max_tokens` tokens.
    pub fn greedy(max_tokens: usize) -> Self {
        Self {
            max_tokens,
            ..Self::default()
        }
    }

    /// Checks every field for a model of `vocab` tokens.
    pub fn validate(&self, vocab: usize) -> Result<(), ParamError> {
        if self.max_tokens == 0 {
            return Err(err("max_tokens", 0, "at least 1"));
        }
        if !(0.0..=MAX_TEMPERATURE).contains(&self.temperature) {
            return Err(err(
                "temperature",
                self.temperature,
                format!("0 to {MAX_TEMPERATURE} (0: greedy)"),
            ));
        }
        if self.top_k as usize > vocab {
            return Err(err(
                "top_k",
                self.top_k,
                format!("0 (off) to the vocabulary size {vocab}"),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(err("top_p", self.top_p, "above 0 and at most 1 (1: off)"));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= MAX_REPETITION_PENALTY) {
            return Err(err(
                "repetition_penalty",
                self.repetition_penalty,
                format!("above 0 and at most {MAX_REPETITION_PENALTY} (1: off)"),
            ));
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return Err(err(
                "stop",
                format!("{} strings", self.stop.len()),
                format!("at most {MAX_STOP_STRINGS}"),
            ));
        }
        if let Some(s) = self
            .stop
            .iter()
            .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
        {
            return Err(err(
                "stop",
                format!("{s:?}"),
                format!("strings of 1 to {MAX_STOP_BYTES} bytes"),
            ));
        }
        if let Some(t) = self.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(err(
                "stop_token_ids",
                t,
                format!("token ids below the vocabulary size {vocab}"),
            ));
        }
        if let Some(n) = self.logprobs
            && n as usize > stoke::MAX_TOP_LOGPROBS
        {
            return Err(err(
                "logprobs",
                n,
                format!("0 to {}", stoke::MAX_TOP_LOGPROBS),
            ));
        }
        Ok(())
    }

    /// The decoder's settings for this request, with `seed` (the request's, or one the engine
    /// drew).
    pub fn lane_sampling(&self, seed: u64) -> stoke::LaneSampling {
        stoke::LaneSampling {
            params: stoke::Sampling {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                repetition_penalty: self.repetition_penalty,
                seed,
            },
            stream: self.choice,
            logprobs: self.logprobs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bad_value_names_its_field() {
        let ok = Params::default();
        assert_eq!(ok.validate(100), Ok(()));
        let field = |f: fn(&mut Params)| {
            let mut p = ok.clone();
            f(&mut p);
            p.validate(100).unwrap_err().field
        };
        assert_eq!(field(|p| p.max_tokens = 0), "max_tokens");
        assert_eq!(field(|p| p.temperature = -0.5), "temperature");
        assert_eq!(field(|p| p.temperature = f32::NAN), "temperature");
        assert_eq!(field(|p| p.temperature = 1e9), "temperature");
        assert_eq!(field(|p| p.top_k = 101), "top_k");
        assert_eq!(field(|p| p.top_p = 1.5), "top_p");
        assert_eq!(field(|p| p.top_p = 0.0), "top_p");
        assert_eq!(field(|p| p.top_p = f32::NAN), "top_p");
        assert_eq!(field(|p| p.repetition_penalty = 0.0), "repetition_penalty");
        assert_eq!(field(|p| p.repetition_penalty = -1.0), "repetition_penalty");
        assert_eq!(
            field(|p| p.repetition_penalty = f32::INFINITY),
            "repetition_penalty"
        );
        assert_eq!(field(|p| p.stop = vec![String::new()]), "stop");
        assert_eq!(field(|p| p.stop = vec!["x".repeat(257)]), "stop");
        assert_eq!(field(|p| p.stop = vec!["a".into(); 17]), "stop");
        assert_eq!(field(|p| p.stop_token_ids = vec![100]), "stop_token_ids");
        assert_eq!(field(|p| p.logprobs = Some(21)), "logprobs");
        let e = Params {
            top_p: 1.5,
            ..ok.clone()
        }
        .validate(100)
        .unwrap_err();
        assert_eq!(e.value, "1.5");
        assert!(e.to_string().contains("top_p"), "{e}");
        // Edges that are allowed.
        let edge = Params {
            temperature: MAX_TEMPERATURE,
            top_k: 100,
            top_p: 1.0,
            repetition_penalty: MAX_REPETITION_PENALTY,
            stop: vec!["x".repeat(256); 16],
            logprobs: Some(20),
            ..ok
        };
        assert_eq!(edge.validate(100), Ok(()));
    }
}
