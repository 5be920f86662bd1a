//! Property-based mutation fuzzing of the model-file loaders: the GGUF reader (with the
//! configuration and tokenizer it carries), the safetensors header reader, the Hugging Face JSON
//! files (`config.json`, `generation_config.json`, `model.safetensors.index.json`) and the
//! tokenizer loaders (`tokenizer.json`, GGUF-embedded vocabularies).
//!
//! Inputs come from [proptest](mod@proptest) strategies: a valid file built programmatically from random parts
//! (recording where its counts, lengths, offsets, dims, type ids and strings lie), then mutated
//! (truncation, byte flips, inserted and deleted runs, a recorded field overwritten with an
//! extreme value, a string byte made non-UTF-8; JSON files also get edits of their value tree),
//! or plain random bytes. Each input runs its reader under `catch_unwind`; a case fails when the
//! reader panics, when an error's message does not name the file, or when one allocation request
//! exceeds [`alloc_bound`]. The allocation figures come from [`CountingAlloc`], which the test
//! and the `loader-fuzz` binary install as their global allocator.
//!
//! `cargo test -p stoke-tests --test loader_fuzz` runs a short seeded pass;
//! `cargo run --release -p stoke-tests --bin loader-fuzz -- --inputs 1000000` the long one.

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};
use serde_json::{Value as Json, json};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use stoke_formats::gguf::{GgmlType, Gguf, Value};
use stoke_llama::{config::LlamaConfig, load, tokenizer};

// ---------------------------------------------------------------------------------------------
// Allocation accounting

thread_local! {
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

/// A global allocator that, on threads inside [`measure`], records the largest single request
/// and the peak of bytes allocated and not yet freed (by that thread).
pub struct CountingAlloc;

fn note_alloc(size: usize) {
    let _ = TRACKING.try_with(|t| {
        if t.get() {
            LARGEST.with(|l| l.set(l.get().max(size)));
            LIVE.with(|live| {
                let v = live.get() + size as isize;
                live.set(v);
                PEAK.with(|p| p.set(p.get().max(v)));
            });
        }
    });
}

fn note_free(size: usize) {
    let _ = TRACKING.try_with(|t| {
        if t.get() {
            LIVE.with(|live| live.set(live.get() - size as isize));
        }
    });
}

// SAFETY: every call forwards to `System` with the same arguments; the bookkeeping only touches
// const-initialized thread-locals (no allocation, no destructors).
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_alloc(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_alloc(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note_free(layout.size());
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_free(layout.size());
        note_alloc(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Allocation while a reader ran (on its thread).
#[derive(Clone, Copy, Debug, Default)]
pub struct Allocs {
    /// The largest single allocation request, bytes.
    pub largest: usize,
    /// The most bytes allocated and not yet freed at once, bytes.
    pub peak_live: usize,
}

/// Runs `f` with this thread's allocations counted.
pub fn measure<R>(f: impl FnOnce() -> R) -> (R, Allocs) {
    LIVE.with(|c| c.set(0));
    PEAK.with(|c| c.set(0));
    LARGEST.with(|c| c.set(0));
    TRACKING.with(|t| t.set(true));
    let r = f();
    TRACKING.with(|t| t.set(false));
    let a = Allocs {
        largest: LARGEST.with(Cell::get),
        peak_live: PEAK.with(Cell::get).max(0) as usize,
    };
    (r, a)
}

// ---------------------------------------------------------------------------------------------
// Readers

/// The readers under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reader {
    /// `Gguf::parse`, every tensor's bytes and dequantized values, `LlamaConfig::from_gguf`,
    /// `tokenizer::from_gguf`.
    Gguf,
    /// `load::read_safetensors` and `load::safetensors_values` of every tensor.
    Safetensors,
    /// `load::config_from_json`, `config::token_ids` (generation_config.json) and
    /// `load::shard_index` (the shard index) on the same bytes.
    ConfigJson,
    /// `tokenizer::from_json` (tokenizer.json) or `tokenizer::from_gguf` (a GGUF vocabulary).
    Tokenizer,
}

pub const READERS: [Reader; 4] = [
    Reader::Gguf,
    Reader::Safetensors,
    Reader::ConfigJson,
    Reader::Tokenizer,
];

impl Reader {
    pub fn name(self) -> &'static str {
        match self {
            Reader::Gguf => "gguf",
            Reader::Safetensors => "safetensors",
            Reader::ConfigJson => "config_json",
            Reader::Tokenizer => "tokenizer",
        }
    }

    pub fn from_name(s: &str) -> Option<Self> {
        READERS.into_iter().find(|r| r.name() == s)
    }

    fn file(self) -> &'static str {
        match self {
            Reader::Gguf => "fuzz.gguf",
            Reader::Safetensors => "fuzz.safetensors",
            Reader::ConfigJson => "fuzz/config.json",
            Reader::Tokenizer => "fuzz/tokenizer.json",
        }
    }
}

/// One input: the file's bytes; for the tokenizer reader, `gguf` says which loader reads them.
#[derive(Clone, Debug)]
pub struct Input {
    pub bytes: Vec<u8>,
    pub gguf: bool,
}

/// The bound on a single allocation request while reading an input of `len` bytes.
///
/// - GGUF: 32 bytes per file byte. A metadata value is a 32-byte `Value`, and the smallest array
///   element (u8, i8, bool) takes one byte of the file, so an array of them is held at 32x its
///   size; dequantized tensors take at most 128 / 18 (Q4_0) times their bytes.
/// - safetensors, JSON: 32 bytes per file byte too (a `serde_json::Value` is 32 bytes; `[0,0,..]`
///   holds one per 2 bytes).
///
/// Plus 1 MiB for fixed-size tables (a JSON object's first B-tree node; the tokenizers crate's
/// BPE cache, a 10,000-entry hash map allocated at construction, about 800 KB). What this rules
/// out is what the fuzzing is after: an allocation sized by a count, length or shape that the
/// file's bytes do not back.
pub fn alloc_bound(_reader: Reader, len: usize) -> usize {
    len.saturating_mul(32).saturating_add(1 << 20)
}

/// What reading one input gave.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// Accepted (the reader returned a value).
    pub accepted: bool,
    /// A panic inside the `tokenizers` crate that the loader caught and turned into a typed error.
    pub caught_in_loader: bool,
    pub allocs: Allocs,
}

/// Panics seen by the hook [`install_panic_hook`] sets (every thread).
pub static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Counts the panics of readers (inside [`measure`]) instead of printing them (the fuzz cases
/// report their own); other panics go to the previous hook.
pub fn install_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if TRACKING.try_with(Cell::get).unwrap_or(false) {
                PANICS.fetch_add(1, Ordering::Relaxed);
            } else {
                previous(info)
            }
        }))
    });
}

fn check_error(file: &str, e: impl std::fmt::Display) -> Result<bool, String> {
    let msg = e.to_string();
    if !msg.contains(file) {
        return Err(format!("error does not name the file `{file}`: {msg}"));
    }
    let caught = msg.contains("the tokenizers crate panicked");
    if caught && std::env::var_os("STOKE_FUZZ_SHOW_CAUGHT").is_some() {
        eprintln!("caught in loader: {msg}");
    }
    Ok(caught)
}

/// Runs `reader` on `input`. `Err` is a failure: a panic, an error not naming the file, an
/// allocation over [`alloc_bound`].
pub fn read(reader: Reader, input: &Input) -> Result<Outcome, String> {
    let file = reader.file();
    let bytes = &input.bytes[..];
    let run = || -> Result<(bool, bool), String> {
        match reader {
            Reader::Gguf => read_gguf(file, bytes, true),
            Reader::Tokenizer if input.gguf => read_gguf(file, bytes, false),
            Reader::Tokenizer => match tokenizer::from_json(file, bytes) {
                Ok(_) => Ok((true, false)),
                Err(e) => Ok((false, check_error(file, e)?)),
            },
            Reader::Safetensors => match load::read_safetensors(file, bytes) {
                Ok(st) => {
                    for (name, view) in st.tensors() {
                        let shape = view.shape().to_vec();
                        if let Err(e) = load::safetensors_values(file, &st, &name, &shape) {
                            check_error(file, e)?;
                        }
                        let mut wrong = shape.clone();
                        wrong.push(1);
                        if let Err(e) = load::safetensors_values(file, &st, &name, &wrong) {
                            check_error(file, e)?;
                        }
                    }
                    Ok((true, false))
                }
                Err(e) => Ok((false, check_error(file, e)?)),
            },
            Reader::ConfigJson => {
                let accepted = match load::config_from_json(file, bytes) {
                    Ok(_) => true,
                    Err(e) => {
                        check_error(file, e)?;
                        false
                    }
                };
                if let Ok(j) = load::parse_json(file, bytes) {
                    if let Err(e) =
                        stoke_llama::config::token_ids(file, "eos_token_id", &j["eos_token_id"])
                    {
                        check_error(file, e)?;
                    }
                    if let Err(e) = load::shard_index(file, &j) {
                        check_error(file, e)?;
                    }
                }
                Ok((accepted, false))
            }
        }
    };
    let (r, allocs) = measure(|| std::panic::catch_unwind(run));
    let (accepted, caught_in_loader) = match r {
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            return Err(format!("panic: {msg}"));
        }
        Ok(r) => r?,
    };
    let bound = alloc_bound(reader, bytes.len());
    if allocs.largest > bound {
        return Err(format!(
            "an allocation of {} bytes for a {}-byte file (bound {bound})",
            allocs.largest,
            bytes.len()
        ));
    }
    Ok(Outcome {
        accepted,
        caught_in_loader,
        allocs,
    })
}

/// The GGUF reader chain; `all` also dequantizes every tensor and reads the configuration.
fn read_gguf(file: &str, bytes: &[u8], all: bool) -> Result<(bool, bool), String> {
    let g = match Gguf::parse(file, bytes) {
        Ok(g) => g,
        Err(e) => return Ok((false, check_error(file, e)?)),
    };
    let mut accepted = true;
    let mut caught = false;
    if all {
        for t in &g.tensors {
            let values = g.dequantize(t).map_err(|e| format!("parsed, then: {e}"))?;
            let raw = g.raw(t).map_err(|e| format!("parsed, then: {e}"))?;
            let (per, size) = t.ggml_type.block().expect("parse checked the type");
            if values.len() != raw.len() / size * per || values.len() as u64 != t.num_elements() {
                return Err(format!("tensor `{}`: wrong value count", t.name));
            }
        }
        if let Err(e) = LlamaConfig::from_gguf(&g) {
            check_error(file, e)?;
            accepted = false;
        }
    }
    if let Err(e) = tokenizer::from_gguf(&g) {
        caught |= check_error(file, e)?;
        accepted = false;
    }
    Ok((accepted, caught))
}

// ---------------------------------------------------------------------------------------------
// Mutations

/// Values written over a recorded field (a count, length, offset, dim or type id).
const EXTREMES: [u64; 22] = [
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    9,
    12,
    13,
    31,
    32,
    33,
    255,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    1 << 40,
    1 << 62,
    1 << 63,
    u64::MAX,
];

#[derive(Clone, Debug)]
enum Mutation {
    Truncate(Index),
    Flip(Index, u8),
    Insert(Index, Vec<u8>),
    Delete(Index, u8),
    /// Overwrite a recorded field: an extreme value, the file length plus a delta, or any value.
    Field(Index, Index, i8, u64, u8),
    /// Put a byte that is never UTF-8 into a recorded string.
    BadUtf8(Index, Index, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        2 => any::<Index>().prop_map(Mutation::Truncate),
        3 => (any::<Index>(), 1..=255u8).prop_map(|(i, x)| Mutation::Flip(i, x)),
        1 => (any::<Index>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        1 => (any::<Index>(), 1..64u8).prop_map(|(i, n)| Mutation::Delete(i, n)),
        6 => (any::<Index>(), any::<Index>(), any::<i8>(), any::<u64>(), 0..4u8)
            .prop_map(|(f, e, d, v, k)| Mutation::Field(f, e, d, v, k)),
        2 => (any::<Index>(), any::<Index>(), prop::sample::select(vec![0xffu8, 0xfe, 0xc0, 0x80, 0xed]))
            .prop_map(|(s, i, b)| Mutation::BadUtf8(s, i, b)),
    ]
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    prop::collection::vec(mutation(), 0..4)
}

/// A file with the positions of its fields (offset, width 4 or 8) and strings (offset, length).
#[derive(Clone, Debug, Default)]
struct Built {
    bytes: Vec<u8>,
    fields: Vec<(usize, usize)>,
    strings: Vec<(usize, usize)>,
}

impl Built {
    fn u32(&mut self, v: u32) {
        self.fields.push((self.bytes.len(), 4));
        self.bytes.extend(v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.fields.push((self.bytes.len(), 8));
        self.bytes.extend(v.to_le_bytes());
    }
    fn raw_str(&mut self, s: &[u8]) {
        self.strings.push((self.bytes.len(), s.len()));
        self.bytes.extend(s);
    }

    fn mutate(mut self, ms: &[Mutation]) -> Vec<u8> {
        for m in ms {
            let len = self.bytes.len();
            match m {
                Mutation::Truncate(i) if len > 0 => self.bytes.truncate(i.index(len)),
                Mutation::Flip(i, x) if len > 0 => self.bytes[i.index(len)] ^= x,
                Mutation::Insert(i, b) => {
                    let at = i.index(len + 1);
                    self.bytes.splice(at..at, b.iter().copied());
                }
                Mutation::Delete(i, n) if len > 0 => {
                    let at = i.index(len);
                    let end = (at + *n as usize).min(len);
                    self.bytes.drain(at..end);
                }
                Mutation::Field(f, e, delta, any, kind) if !self.fields.is_empty() => {
                    let (at, width) = self.fields[f.index(self.fields.len())];
                    let v = match kind {
                        0 | 1 => EXTREMES[e.index(EXTREMES.len())],
                        2 => (len as u64).wrapping_add(*delta as i64 as u64),
                        _ => *any,
                    };
                    if at + width <= len {
                        self.bytes[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
                    }
                }
                Mutation::BadUtf8(s, i, b) if !self.strings.is_empty() => {
                    let (at, n) = self.strings[s.index(self.strings.len())];
                    if n > 0 && at + n <= len {
                        self.bytes[at + i.index(n)] = *b;
                    }
                }
                _ => {}
            }
        }
        self.bytes
    }
}

// ---------------------------------------------------------------------------------------------
// GGUF

const GGUF_KEYS: [&str; 22] = [
    "general.architecture",
    "general.alignment",
    "llama.embedding_length",
    "llama.block_count",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.key_length",
    "llama.rope.dimension_count",
    "llama.vocab_size",
    "llama.rope.scaling.type",
    "llama.context_length",
    "llama.rope.freq_base",
    "llama.attention.layer_norm_rms_epsilon",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "x.unknown",
];

fn scalar_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u8>().prop_map(Value::U8),
        any::<i8>().prop_map(Value::I8),
        any::<u16>().prop_map(Value::U16),
        any::<i16>().prop_map(Value::I16),
        prop_oneof![0..64u32, any::<u32>()].prop_map(Value::U32),
        any::<i32>().prop_map(Value::I32),
        any::<f32>().prop_map(Value::F32),
        any::<bool>().prop_map(Value::Bool),
        token_string().prop_map(Value::String),
        any::<u64>().prop_map(Value::U64),
        any::<i64>().prop_map(Value::I64),
        any::<f64>().prop_map(Value::F64),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    scalar_value().prop_recursive(3, 24, 6, |inner| {
        prop::collection::vec(inner, 0..6).prop_map(Value::Array)
    })
}

/// Token-like strings: byte-level symbols, words, specials, odd ones.
fn token_string() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec![
            "a", "b", "c", "ab", "bc", "abc", "Ġ", "Ġa", "Ġab", "1", "2", "<|endoftext|>", "<s>",
            "</s>", "", " ", "a b", "Ċ", "é", "\u{0}", "llama", "gpt2", "smollm", "default",
            "llama3", "[UNK]", "##b",
        ])
        .prop_map(String::from),
        1 => "\\PC{0,12}",
    ]
}

fn type_id() -> impl Strategy<Value = u32> {
    prop_oneof![
        6 => prop::sample::select(vec![0u32, 1, 2, 3, 8, 30]),
        1 => prop::sample::select(vec![6u32, 7, 10, 12, 39, 255]),
        1 => any::<u32>(),
    ]
}

/// A tensor entry: name, ggml dims, type id; its data is the right size for the type when it
/// has one (else random bytes).
fn tensor() -> impl Strategy<Value = (String, Vec<u64>, u32, Vec<u8>)> {
    let name = prop_oneof![
        prop::sample::select(vec![
            "token_embd.weight",
            "output_norm.weight",
            "output.weight",
            "blk.0.attn_q.weight",
            "blk.0.attn_norm.weight",
            "w",
        ])
        .prop_map(String::from),
        "\\PC{0,8}",
    ];
    // At most 64 x 4 x 4 x 4 elements: the files stay small (each input is read whole).
    let dims = prop::collection::vec(prop_oneof![0..5u64, Just(32u64), Just(64)], 0..5).prop_map(
        |mut d| {
            for x in d.iter_mut().skip(1) {
                *x = (*x).min(4);
            }
            d
        },
    );
    (name, dims, type_id(), any::<u64>()).prop_map(|(name, dims, ty, seed)| {
        let ty_k = GgmlType::from_u32(ty);
        let dims = match ty_k.block() {
            Some((per, _)) if per > 1 && !dims.is_empty() => {
                let mut d = dims;
                d[0] = d[0].div_ceil(per as u64).max(1) * per as u64;
                d
            }
            _ => dims,
        };
        let bytes = match ty_k.block() {
            Some((per, size)) => (dims.iter().product::<u64>() as usize).div_ceil(per) * size,
            None => (seed % 64) as usize,
        };
        let data = (0..bytes)
            .map(|i| (seed >> (i % 57)) as u8 ^ i as u8)
            .collect();
        (name, dims, ty, data)
    })
}

/// Metadata of a coherent tiny Llama with a byte-level BPE vocabulary (what the configuration
/// and tokenizer readers accept), for inputs that reach past the container.
fn llama_metadata() -> impl Strategy<Value = Vec<(String, Value)>> {
    (1..4u32, 1..3u32, 1..3u32, any::<bool>(), vocab()).prop_map(
        |(layers, heads, kvm, scaling, (tokens, merges, types))| {
            let kv = heads;
            let heads = heads * kvm;
            let head_dim = 4u32;
            let hidden = heads * head_dim;
            let mut m: Vec<(String, Value)> = vec![
                ("general.architecture".into(), Value::String("llama".into())),
                ("llama.embedding_length".into(), Value::U32(hidden)),
                ("llama.block_count".into(), Value::U32(layers)),
                ("llama.feed_forward_length".into(), Value::U32(hidden * 2)),
                ("llama.attention.head_count".into(), Value::U32(heads)),
                ("llama.attention.head_count_kv".into(), Value::U32(kv)),
                ("llama.rope.freq_base".into(), Value::F32(10000.0)),
                ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
                ("tokenizer.ggml.pre".into(), Value::String("smollm".into())),
                (
                    "tokenizer.ggml.tokens".into(),
                    Value::Array(tokens.into_iter().map(Value::String).collect()),
                ),
                (
                    "tokenizer.ggml.merges".into(),
                    Value::Array(merges.into_iter().map(Value::String).collect()),
                ),
                (
                    "tokenizer.ggml.token_type".into(),
                    Value::Array(types.into_iter().map(Value::I32).collect()),
                ),
                ("tokenizer.ggml.eos_token_id".into(), Value::U32(0)),
            ];
            if scaling {
                m.push((
                    "llama.rope.scaling.type".into(),
                    Value::String("llama3".into()),
                ));
            }
            m
        },
    )
}

/// A byte-level BPE vocabulary: tokens, merges ("a b") and token types.
fn vocab() -> impl Strategy<Value = (Vec<String>, Vec<String>, Vec<i32>)> {
    let base: Vec<String> = ["a", "b", "c", "Ġ", "1", "2"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    (
        prop::collection::vec(token_string(), 0..6),
        prop::collection::vec((0..6usize, 0..6usize), 0..5),
        prop::collection::vec(
            prop_oneof![8 => Just(1i32), 1 => Just(3), 1 => any::<i32>()],
            16,
        ),
    )
        .prop_map(move |(extra, pairs, types)| {
            let mut tokens = base.clone();
            let mut merges = Vec::new();
            for (a, b) in pairs {
                let (a, b) = (base[a].clone(), base[b].clone());
                merges.push(format!("{a} {b}"));
                tokens.push(format!("{a}{b}"));
            }
            tokens.push("<|endoftext|>".into());
            tokens.extend(extra);
            let types = tokens
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    if t.starts_with("<|") {
                        3
                    } else {
                        types[i % types.len()]
                    }
                })
                .collect();
            (tokens, merges, types)
        })
}

fn put_value(b: &mut Built, v: &Value) {
    match v {
        Value::U8(x) => b.bytes.push(*x),
        Value::I8(x) => b.bytes.push(*x as u8),
        Value::U16(x) => b.bytes.extend(x.to_le_bytes()),
        Value::I16(x) => b.bytes.extend(x.to_le_bytes()),
        Value::U32(x) => b.u32(*x),
        Value::I32(x) => b.u32(*x as u32),
        Value::F32(x) => b.bytes.extend(x.to_le_bytes()),
        Value::Bool(x) => b.bytes.push(*x as u8),
        Value::String(s) => put_str(b, s.as_bytes()),
        Value::Array(items) => {
            b.u32(items.first().map_or(4, Value::type_code));
            b.u64(items.len() as u64);
            for i in items {
                put_value(b, i);
            }
        }
        Value::U64(x) => b.u64(*x),
        Value::I64(x) => b.u64(*x as u64),
        Value::F64(x) => b.bytes.extend(x.to_le_bytes()),
    }
}

fn put_str(b: &mut Built, s: &[u8]) {
    b.u64(s.len() as u64);
    b.raw_str(s);
}

/// GGUF v3 bytes with every field recorded (the same layout as `gguf::Writer`).
fn build_gguf(meta: &[(String, Value)], tensors: &[(String, Vec<u64>, u32, Vec<u8>)]) -> Built {
    const ALIGN: usize = 32;
    let mut b = Built::default();
    b.bytes.extend(b"GGUF");
    b.u32(3);
    b.u64(tensors.len() as u64);
    b.u64(meta.len() as u64);
    for (k, v) in meta {
        put_str(&mut b, k.as_bytes());
        b.u32(v.type_code());
        put_value(&mut b, v);
    }
    let mut offset = 0u64;
    for (name, dims, ty, raw) in tensors {
        put_str(&mut b, name.as_bytes());
        b.u32(dims.len() as u32);
        for &d in dims {
            b.u64(d);
        }
        b.u32(*ty);
        b.u64(offset);
        offset += (raw.len() as u64).div_ceil(ALIGN as u64) * ALIGN as u64;
    }
    b.bytes.resize(b.bytes.len().div_ceil(ALIGN) * ALIGN, 0);
    for (i, (_, _, _, raw)) in tensors.iter().enumerate() {
        b.bytes.extend(raw);
        if i + 1 < tensors.len() {
            b.bytes.resize(b.bytes.len().div_ceil(ALIGN) * ALIGN, 0);
        }
    }
    b
}

fn gguf_file() -> impl Strategy<Value = Built> {
    let meta = prop_oneof![
        1 => prop::collection::vec((prop::sample::select(GGUF_KEYS.to_vec()).prop_map(String::from), value()), 0..6),
        2 => (llama_metadata(), prop::collection::vec((prop::sample::select(GGUF_KEYS.to_vec()).prop_map(String::from), value()), 0..2))
            .prop_map(|(mut m, extra)| {
                for (k, v) in extra {
                    // A replaced value, not a duplicate key (a duplicate is one typed error).
                    match m.iter_mut().find(|(mk, _)| *mk == k) {
                        Some(slot) => slot.1 = v,
                        None => m.push((k, v)),
                    }
                }
                m
            }),
    ];
    (meta, prop::collection::vec(tensor(), 0..5))
        .prop_map(|(meta, tensors)| build_gguf(&meta, &tensors))
}

/// Random bytes: as they come, or behind a GGUF magic and version.
fn random_bytes(prefix: &'static [u8]) -> impl Strategy<Value = Vec<u8>> {
    (any::<bool>(), prop::collection::vec(any::<u8>(), 0..256)).prop_map(move |(p, mut b)| {
        if p {
            b.splice(0..0, prefix.iter().copied());
        }
        b
    })
}

// ---------------------------------------------------------------------------------------------
// JSON files

/// An edit of a JSON value tree: at the node picked by the index, replace the value, remove the
/// entry, or add a key.
#[derive(Clone, Debug)]
enum JsonEdit {
    Replace(Index, Json),
    Remove(Index),
    Add(Index, String, Json),
}

fn extreme_json() -> impl Strategy<Value = Json> {
    prop_oneof![
        prop::sample::select(vec![
            Json::Null,
            json!(true),
            json!(-1),
            json!(0),
            json!(1),
            json!(3),
            json!(0.5),
            json!(-0.0),
            json!(1e308),
            json!(-1e308),
            json!(u64::MAX),
            json!(i64::MIN),
            json!(1u64 << 32),
            json!(1u64 << 40),
            json!(1u64 << 62),
            json!(""),
            json!("llama"),
            json!("llama3"),
            json!("F16"),
            json!("Q4"),
            json!("../x"),
            json!("/etc/passwd"),
            json!("model.safetensors"),
            json!("(a|b)*"),
            json!("["),
            json!("\\p{Nope}"),
            json!([]),
            json!({}),
            json!([1, 2, 3]),
            json!([u64::MAX, 0]),
            json!([0, u64::MAX]),
            json!({"type": "llama3"}),
            json!({"rope_type": "llama3", "factor": -1.0}),
        ]),
        any::<u64>().prop_map(|v| json!(v)),
        any::<i64>().prop_map(|v| json!(v)),
        "\\PC{0,10}".prop_map(Json::String),
        (0..200usize).prop_map(|d| (0..d).fold(json!(0), |v, _| json!([v]))),
    ]
}

fn json_edit() -> impl Strategy<Value = JsonEdit> {
    prop_oneof![
        4 => (any::<Index>(), extreme_json()).prop_map(|(i, v)| JsonEdit::Replace(i, v)),
        1 => any::<Index>().prop_map(JsonEdit::Remove),
        1 => (any::<Index>(), "[a-z_]{1,12}", extreme_json()).prop_map(|(i, k, v)| JsonEdit::Add(i, k, v)),
    ]
}

/// JSON pointers of every node of `v`.
fn pointers(v: &Json, at: String, out: &mut Vec<String>) {
    match v {
        Json::Object(m) => {
            for (k, c) in m {
                let p = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
                pointers(c, p, out);
            }
        }
        Json::Array(a) => {
            for (i, c) in a.iter().enumerate().take(64) {
                pointers(c, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
    out.push(at);
}

fn apply_json_edits(mut v: Json, edits: &[JsonEdit]) -> Json {
    for e in edits {
        let mut ps = Vec::new();
        pointers(&v, String::new(), &mut ps);
        match e {
            JsonEdit::Replace(i, new) => {
                if let Some(slot) = v.pointer_mut(&ps[i.index(ps.len())]) {
                    *slot = new.clone();
                }
            }
            JsonEdit::Remove(i) => {
                let p = &ps[i.index(ps.len())];
                if let Some((parent, last)) = p.rsplit_once('/') {
                    match v.pointer_mut(parent) {
                        Some(Json::Object(m)) => {
                            m.remove(&last.replace("~1", "/").replace("~0", "~"));
                        }
                        Some(Json::Array(a)) => {
                            if let Ok(i) = last.parse::<usize>()
                                && i < a.len()
                            {
                                a.remove(i);
                            }
                        }
                        _ => {}
                    }
                }
            }
            JsonEdit::Add(i, k, new) => {
                if let Some(Json::Object(m)) = v.pointer_mut(&ps[i.index(ps.len())]) {
                    m.insert(k.clone(), new.clone());
                }
            }
        }
    }
    v
}

/// A JSON document: `base` edited, serialized, then mutated as bytes (its strings recorded for
/// non-UTF-8 bytes).
fn json_file(base: impl Strategy<Value = Json>) -> impl Strategy<Value = Built> {
    (
        base,
        prop::collection::vec(json_edit(), 0..3),
        any::<bool>(),
    )
        .prop_map(|(v, edits, pretty)| {
            let v = apply_json_edits(v, &edits);
            let text = if pretty {
                serde_json::to_string_pretty(&v)
            } else {
                serde_json::to_string(&v)
            }
            .expect("serializable");
            let bytes = text.into_bytes();
            let strings = json_strings(&bytes);
            Built {
                bytes,
                fields: Vec::new(),
                strings,
            }
        })
}

/// The spans between double quotes (JSON strings and keys), for non-UTF-8 bytes.
fn json_strings(b: &[u8]) -> Vec<(usize, usize)> {
    let q: Vec<usize> = b
        .iter()
        .enumerate()
        .filter(|(_, c)| **c == b'"')
        .map(|(i, _)| i)
        .collect();
    q.chunks_exact(2)
        .map(|p| (p[0] + 1, p[1] - p[0] - 1))
        .collect()
}

fn config_json() -> impl Strategy<Value = Json> {
    let config = (
        1..5usize,
        1..3usize,
        1..3usize,
        1..4usize,
        any::<bool>(),
        0..3u8,
    )
        .prop_map(|(heads, kvm, layers, hd, tie, rope)| {
            let (kv, heads) = (heads, heads * kvm);
            let head_dim = 2 * hd;
            let mut c = json!({
                "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "vocab_size": 64, "hidden_size": heads * head_dim, "intermediate_size": 48,
                "num_hidden_layers": layers, "num_attention_heads": heads,
                "num_key_value_heads": kv, "head_dim": head_dim, "rope_theta": 10000.0,
                "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
                "tie_word_embeddings": tie, "bos_token_id": 1, "eos_token_id": [2, 3],
            });
            if rope > 0 {
                c["rope_scaling"] = json!({
                    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                });
            }
            c
        });
    let index = prop::collection::vec(
        (
            "[a-z.]{1,12}",
            prop::sample::select(vec!["model-1.safetensors", "model-2.safetensors"]),
        ),
        0..4,
    )
    .prop_map(|m| {
        let map: serde_json::Map<String, Json> =
            m.into_iter().map(|(k, v)| (k, json!(v))).collect();
        json!({"metadata": {"total_size": 10}, "weight_map": map})
    });
    let generation = Just(json!({"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": true}));
    prop_oneof![8 => config, 1 => index, 1 => generation]
}

// ---------------------------------------------------------------------------------------------
// safetensors

const DTYPES: [&str; 14] = [
    "F32", "F16", "BF16", "F64", "I8", "U8", "BOOL", "I64", "U16", "F8_E4M3", "F8_E5M2", "F4",
    "F6_E2M3", "Q4",
];

fn dtype_bits(d: &str) -> u64 {
    match d {
        "F64" | "I64" => 64,
        "F32" => 32,
        "F16" | "BF16" | "U16" => 16,
        "F4" => 4,
        "F6_E2M3" => 6,
        _ => 8,
    }
}

/// A safetensors file: 8-byte header length, JSON header (edited as a value tree), data.
fn safetensors_file() -> impl Strategy<Value = (Built, Vec<Mutation>)> {
    let tensor = (
        prop_oneof![
            prop::sample::select(vec![
                "model.embed_tokens.weight",
                "model.norm.weight",
                "lm_head.weight",
                "__metadata__"
            ])
            .prop_map(String::from),
            "[a-z.]{1,10}",
        ],
        prop::sample::select(DTYPES.to_vec()),
        prop::collection::vec(0..5usize, 0..4),
    );
    (
        prop::collection::vec(tensor, 0..5),
        any::<bool>(),
        prop::collection::vec(json_edit(), 0..3),
        0..3usize,
        mutations(),
    )
        .prop_map(|(tensors, meta, edits, pad, muts)| {
            let mut header = serde_json::Map::new();
            let mut offset = 0u64;
            let mut data = Vec::new();
            for (name, dtype, shape) in tensors {
                if name == "__metadata__" || header.contains_key(&name) {
                    continue;
                }
                let n = (shape.iter().product::<usize>() as u64 * dtype_bits(dtype)).div_ceil(8);
                header.insert(
                    name,
                    json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}),
                );
                data.extend((0..n).map(|i| i as u8));
                offset += n;
            }
            if meta {
                header.insert("__metadata__".into(), json!({"format": "pt"}));
            }
            let header = apply_json_edits(Json::Object(header), &edits);
            let mut text = serde_json::to_vec(&header).expect("serializable");
            text.extend(std::iter::repeat_n(b' ', pad));
            let mut b = Built::default();
            b.u64(text.len() as u64);
            let strings = json_strings(&text);
            b.strings = strings.into_iter().map(|(at, n)| (at + 8, n)).collect();
            b.bytes.extend(text);
            b.bytes.extend(data);
            (b, muts)
        })
}

// ---------------------------------------------------------------------------------------------
// Tokenizers

/// tokenizer.json documents to start from: byte-level BPE (as the GGUF loader builds), WordPiece,
/// Unigram and WordLevel with regex pre-tokenizers and normalizers.
fn tokenizer_bases() -> Vec<Json> {
    let tokens = ["a", "b", "c", "Ġ", "1", "ab", "Ġa", "<|endoftext|>"];
    let bytes = stoke_formats::gguf::Writer::default()
        .meta("tokenizer.ggml.model", Value::String("gpt2".into()))
        .meta("tokenizer.ggml.pre", Value::String("smollm".into()))
        .meta(
            "tokenizer.ggml.tokens",
            Value::Array(
                tokens
                    .iter()
                    .map(|t| Value::String(t.to_string()))
                    .collect(),
            ),
        )
        .meta(
            "tokenizer.ggml.merges",
            Value::Array(vec![
                Value::String("a b".into()),
                Value::String("Ġ a".into()),
            ]),
        )
        .meta(
            "tokenizer.ggml.token_type",
            Value::Array(
                [1, 1, 1, 1, 1, 1, 1, 3]
                    .iter()
                    .map(|&t| Value::I32(t))
                    .collect(),
            ),
        )
        .to_bytes();
    let g = Gguf::parse("base.gguf", &bytes).expect("base GGUF");
    let bpe = tokenizer::from_gguf(&g).expect("base tokenizer");
    let bpe: Json = serde_json::from_str(&bpe.to_string(false).expect("serializes")).expect("json");
    let added = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let wordpiece = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [added(0, "[UNK]"), added(1, "[CLS]")],
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                       "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {"type": "BertProcessing", "sep": ["[CLS]", 1], "cls": ["[CLS]", 1]},
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100,
                  "vocab": {"[UNK]": 0, "[CLS]": 1, "a": 2, "b": 3, "##b": 4}}
    });
    let unigram = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [added(0, "<unk>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            {"type": "NFKC"}]},
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
        "post_processor": null,
        "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
        "model": {"type": "Unigram", "unk_id": 0, "byte_fallback": false,
                  "vocab": [["<unk>", 0.0], ["▁a", -1.0], ["b", -2.0], ["▁", -3.0]]}
    });
    let wordlevel = json!({
        "version": "1.0", "truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0},
        "padding": null, "added_tokens": [],
        "normalizer": {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[a-z]+|\\d"}, "behavior": "Isolated", "invert": false},
        "post_processor": {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {}},
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "a": 1, "b": 2}, "unk_token": "<unk>"}
    });
    vec![bpe, wordpiece, unigram, wordlevel]
}

fn tokenizer_input() -> impl Strategy<Value = Input> {
    let bases = tokenizer_bases();
    let json = json_file(prop::sample::select(bases));
    let gguf_vocab = (
        llama_metadata(),
        prop::collection::vec(
            (prop::sample::select(GGUF_KEYS[14..19].to_vec()), value()),
            0..2,
        ),
    )
        .prop_map(|(mut m, extra)| {
            m.retain(|(k, _)| k.starts_with("tokenizer."));
            for (k, v) in extra {
                if let Some(slot) = m.iter_mut().find(|(mk, _)| mk == k) {
                    slot.1 = v;
                }
            }
            build_gguf(&m, &[])
        });
    prop_oneof![
        5 => (json, mutations()).prop_map(|(b, m)| Input { bytes: b.mutate(&m), gguf: false }),
        4 => (gguf_vocab, mutations()).prop_map(|(b, m)| Input { bytes: b.mutate(&m), gguf: true }),
        1 => random_bytes(b"{\"model\":").prop_map(|bytes| Input { bytes, gguf: false }),
    ]
}

/// The input strategy for `reader`.
pub fn inputs(reader: Reader) -> BoxedStrategy<Input> {
    let plain = |bytes| Input { bytes, gguf: false };
    match reader {
        Reader::Gguf => prop_oneof![
            9 => (gguf_file(), mutations()).prop_map(move |(b, m)| plain(b.mutate(&m))),
            1 => random_bytes(b"GGUF\x03\x00\x00\x00").prop_map(plain),
        ]
        .boxed(),
        Reader::Safetensors => prop_oneof![
            9 => safetensors_file().prop_map(move |(b, m)| plain(b.mutate(&m))),
            1 => random_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{").prop_map(plain),
        ]
        .boxed(),
        Reader::ConfigJson => prop_oneof![
            9 => (json_file(config_json()), mutations()).prop_map(move |(b, m)| plain(b.mutate(&m))),
            1 => random_bytes(b"{\"").prop_map(plain),
        ]
        .boxed(),
        Reader::Tokenizer => tokenizer_input().boxed(),
    }
}

// ---------------------------------------------------------------------------------------------
// Runs

/// Totals of a run of one reader.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Totals {
    pub inputs: u64,
    pub accepted: u64,
    pub rejected_with_typed_error: u64,
    /// Panics inside the tokenizers crate that the loader caught (typed error `Build`).
    pub tokenizers_panics_caught_by_loader: u64,
    pub largest_allocation_bytes: usize,
    pub largest_allocation_file_bytes: usize,
    /// The largest ratio of one allocation request to the file's size, and that file's size.
    pub max_allocation_to_file_ratio: f64,
    pub max_ratio_file_bytes: usize,
    pub largest_peak_live_bytes: usize,
    pub largest_file_bytes: usize,
    /// Inputs whose largest single allocation exceeded the file's own size.
    pub inputs_allocating_more_than_file_size: u64,
}

impl Totals {
    fn add(&mut self, len: usize, o: &Outcome) {
        self.inputs += 1;
        if o.accepted {
            self.accepted += 1;
        } else {
            self.rejected_with_typed_error += 1;
        }
        self.tokenizers_panics_caught_by_loader += o.caught_in_loader as u64;
        if o.allocs.largest > self.largest_allocation_bytes {
            self.largest_allocation_bytes = o.allocs.largest;
            self.largest_allocation_file_bytes = len;
        }
        let ratio = o.allocs.largest as f64 / len.max(1) as f64;
        if ratio > self.max_allocation_to_file_ratio {
            self.max_allocation_to_file_ratio = ratio;
            self.max_ratio_file_bytes = len;
        }
        self.largest_peak_live_bytes = self.largest_peak_live_bytes.max(o.allocs.peak_live);
        self.largest_file_bytes = self.largest_file_bytes.max(len);
        self.inputs_allocating_more_than_file_size += (o.allocs.largest > len) as u64;
    }

    pub fn merge(&mut self, o: &Totals) {
        self.inputs += o.inputs;
        self.accepted += o.accepted;
        self.rejected_with_typed_error += o.rejected_with_typed_error;
        self.tokenizers_panics_caught_by_loader += o.tokenizers_panics_caught_by_loader;
        if o.largest_allocation_bytes > self.largest_allocation_bytes {
            self.largest_allocation_bytes = o.largest_allocation_bytes;
            self.largest_allocation_file_bytes = o.largest_allocation_file_bytes;
        }
        if o.max_allocation_to_file_ratio > self.max_allocation_to_file_ratio {
            self.max_allocation_to_file_ratio = o.max_allocation_to_file_ratio;
            self.max_ratio_file_bytes = o.max_ratio_file_bytes;
        }
        self.largest_peak_live_bytes = self.largest_peak_live_bytes.max(o.largest_peak_live_bytes);
        self.largest_file_bytes = self.largest_file_bytes.max(o.largest_file_bytes);
        self.inputs_allocating_more_than_file_size += o.inputs_allocating_more_than_file_size;
    }
}

/// The proptest RNG seed of chunk `chunk` of `reader`'s run from `seed`.
fn rng(seed: u64, reader: Reader, chunk: u64) -> TestRng {
    let mut s = [0u8; 32];
    s[..8].copy_from_slice(&seed.to_le_bytes());
    s[8..16].copy_from_slice(&chunk.to_le_bytes());
    s[16..24].copy_from_slice(&(reader as u64).to_le_bytes());
    s[24..].copy_from_slice(b"stokefuz");
    TestRng::from_seed(RngAlgorithm::ChaCha, &s)
}

/// Runs `cases` inputs of `reader` (chunk `chunk` of a run from `seed`: a deterministic stream).
/// `Err` carries the failing input, shrunk by proptest, and why it failed.
pub fn run_chunk(reader: Reader, seed: u64, chunk: u64, cases: u32) -> Result<Totals, String> {
    install_panic_hook();
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 2000,
        ..Config::default()
    };
    let mut runner = TestRunner::new_with_rng(config, rng(seed, reader, chunk));
    let totals = std::cell::RefCell::new(Totals::default());
    let result = runner.run(&inputs(reader), |input| {
        let o = read(reader, &input).map_err(TestCaseError::fail)?;
        totals.borrow_mut().add(input.bytes.len(), &o);
        Ok(())
    });
    match result {
        Ok(()) => Ok(totals.into_inner()),
        Err(TestError::Fail(why, input)) => Err(format!(
            "{} (seed {seed}, chunk {chunk}): {why}; input ({} bytes, gguf {}): {:?}",
            reader.name(),
            input.bytes.len(),
            input.gguf,
            String::from_utf8_lossy(&input.bytes)
        )),
        Err(e) => Err(format!(
            "{} (seed {seed}, chunk {chunk}): {e}",
            reader.name()
        )),
    }
}
