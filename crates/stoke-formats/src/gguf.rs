//! GGUF (v2/v3) files: metadata, tensor directory and dequantization of the tensor types Llama
//! checkpoints use (F32, F16, BF16, Q8_0, Q4_0, Q4_1).
//!
//! Parsing works on a byte slice (a memory map or a buffer) and borrows tensor data from it.
//! Every malformed input is a [`GgufError`] naming what was wrong and where.
//!
//! Layout (all little-endian): magic `GGUF`, version u32, tensor count u64, metadata count u64;
//! the metadata key/value pairs; the tensor infos (name, rank u32, dims u64 with the fastest
//! varying first, ggml type u32, offset u64 into the data section); padding to
//! `general.alignment` (default 32); the data section.

use std::collections::BTreeMap;
use std::fmt;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The GGUF value-type id written before a value of this kind.
    pub fn type_code(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }

    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// ggml tensor types this crate knows by name; others are kept as their number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    BF16,
    Other(u32),
}

impl GgmlType {
    pub fn from_u32(v: u32) -> Self {
        match v {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            30 => Self::BF16,
            other => Self::Other(other),
        }
    }

    pub fn to_u32(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 8,
            Self::BF16 => 30,
            Self::Other(v) => v,
        }
    }

    /// (elements per block, bytes per block), for the types this crate can read.
    pub fn block(self) -> Option<(usize, usize)> {
        match self {
            Self::F32 => Some((1, 4)),
            Self::F16 | Self::BF16 => Some((1, 2)),
            Self::Q4_0 => Some((32, 18)),
            Self::Q4_1 => Some((32, 20)),
            Self::Q8_0 => Some((32, 34)),
            Self::Other(_) => None,
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Other(v) => write!(f, "ggml type {v}"),
            t => write!(f, "{t:?}"),
        }
    }
}

/// One tensor's directory entry.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` varies fastest. A matrix of `rows x cols` (row-major) is
    /// `[cols, rows]` here.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset into the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// The element count, saturating at `u64::MAX` (a parsed file's tensors never overflow:
    /// [`Gguf::parse`] rejects dims whose product does).
    pub fn num_elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |a, &d| a.saturating_mul(d))
    }

    /// The shape in row-major (PyTorch/Burn) order: `dims` reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GgufError {
    #[error("{file}: not a GGUF file (magic {found:?}, expected \"GGUF\")")]
    BadMagic { file: String, found: [u8; 4] },
    #[error("{file}: GGUF version {version} is not supported (2 and 3 are)")]
    Version { file: String, version: u32 },
    #[error("{file}: truncated at byte {offset} while reading {what} (file has {len} bytes)")]
    Truncated {
        file: String,
        what: String,
        offset: usize,
        len: usize,
    },
    #[error("{file}: metadata `{key}` has unknown value type {ty}")]
    ValueType { file: String, key: String, ty: u32 },
    #[error("{file}: {what} is not valid UTF-8")]
    Utf8 { file: String, what: String },
    #[error("{file}: tensor `{tensor}` has {dims} dimensions (at most 4 are allowed)")]
    Rank {
        file: String,
        tensor: String,
        dims: u32,
    },
    #[error("{file}: tensor `{tensor}` of type {ty}: {problem}")]
    TensorType {
        file: String,
        tensor: String,
        ty: GgmlType,
        problem: String,
    },
    #[error("{file}: tensor `{tensor}` data [{start}, {end}) lies outside the file ({len} bytes)")]
    TensorBounds {
        file: String,
        tensor: String,
        start: u64,
        end: u64,
        len: usize,
    },
    #[error("{file}: no tensor named `{tensor}`")]
    MissingTensor { file: String, tensor: String },
    #[error("{file}: alignment {alignment} is not a power of two")]
    Alignment { file: String, alignment: u64 },
    #[error("{file}: metadata `{key}` appears twice")]
    DuplicateKey { file: String, key: String },
    #[error("{file}: tensor `{tensor}` appears twice in the tensor directory")]
    DuplicateTensor { file: String, tensor: String },
    #[error("{file}: metadata `{key}` nests arrays deeper than {MAX_ARRAY_DEPTH} levels")]
    Nesting { file: String, key: String },
    #[error(
        "{file}: tensor `{tensor}` offset {offset} is not a multiple of the alignment {alignment}"
    )]
    Misaligned {
        file: String,
        tensor: String,
        offset: u64,
        alignment: u64,
    },
}

/// How deep metadata arrays may nest (an array of arrays is depth 2). ggml writes no nested
/// arrays; the bound keeps a file of nested array headers from exhausting the stack.
pub const MAX_ARRAY_DEPTH: usize = 4;

/// A parsed GGUF file borrowing its bytes.
#[derive(Debug)]
pub struct Gguf<'a> {
    /// Name used in errors (the path).
    pub file: String,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    bytes: &'a [u8],
    data_start: usize,
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    file: &'a str,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(GgufError::Truncated {
                file: self.file.to_string(),
                what: what(),
                offset: self.pos,
                len: self.bytes.len(),
            });
        };
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn len(&mut self, what: &dyn Fn() -> String) -> Result<usize, GgufError> {
        let n = self.u64(what)?;
        // A length can never exceed the bytes left; checking here keeps a corrupt length from
        // becoming a huge allocation.
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.bytes.len() - self.pos)
            .ok_or_else(|| GgufError::Truncated {
                file: self.file.to_string(),
                what: format!("{} (length {n})", what()),
                offset: self.pos,
                len: self.bytes.len(),
            })
    }
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let n = self.len(what)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| GgufError::Utf8 {
            file: self.file.to_string(),
            what: what(),
        })
    }
    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value, GgufError> {
        let what = || format!("metadata `{key}`");
        Ok(match ty {
            0 => Value::U8(self.take(1, &what)?[0]),
            1 => Value::I8(self.take(1, &what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.take(2, &what)?.try_into().unwrap())),
            3 => Value::I16(i16::from_le_bytes(self.take(2, &what)?.try_into().unwrap())),
            4 => Value::U32(self.u32(&what)?),
            5 => Value::I32(self.u32(&what)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(&what)?)),
            7 => Value::Bool(self.take(1, &what)?[0] != 0),
            8 => Value::String(self.string(&what)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::Nesting {
                        file: self.file.to_string(),
                        key: key.to_string(),
                    });
                }
                let elem_ty = self.u32(&what)?;
                if elem_ty > 12 {
                    return Err(GgufError::ValueType {
                        file: self.file.to_string(),
                        key: key.to_string(),
                        ty: elem_ty,
                    });
                }
                // `len` bounds the count by the bytes left, and every element takes at least
                // one byte, so the capacity is backed by the file.
                let n = self.len(&what)?;
                let mut v = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    v.push(self.value(elem_ty, key, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(&what)?),
            11 => Value::I64(self.u64(&what)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(&what)?)),
            other => {
                return Err(GgufError::ValueType {
                    file: self.file.to_string(),
                    key: key.to_string(),
                    ty: other,
                });
            }
        })
    }
}

impl<'a> Gguf<'a> {
    /// Parses the header, metadata and tensor directory of `bytes` (the contents of `file`), and
    /// checks that every tensor's data lies inside the file.
    pub fn parse(file: &str, bytes: &'a [u8]) -> Result<Self, GgufError> {
        let mut r = Reader {
            bytes,
            pos: 0,
            file,
        };
        let magic: [u8; 4] = r.take(4, &|| "the magic".into())?.try_into().unwrap();
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic {
                file: file.into(),
                found: magic,
            });
        }
        let version = r.u32(&|| "the version".into())?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version {
                file: file.into(),
                version,
            });
        }
        let n_tensors = r.u64(&|| "the tensor count".into())?;
        let n_kv = r.u64(&|| "the metadata count".into())?;
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(&|| format!("metadata key #{i}"))?;
            let ty = r.u32(&|| format!("the type of metadata `{key}`"))?;
            let v = r.value(ty, &key, 0)?;
            if metadata.contains_key(&key) {
                return Err(GgufError::DuplicateKey {
                    file: file.into(),
                    key,
                });
            }
            metadata.insert(key, v);
        }
        let mut tensors: Vec<TensorInfo> = Vec::new();
        let mut names = std::collections::BTreeSet::new();
        for i in 0..n_tensors {
            let name = r.string(&|| format!("tensor name #{i}"))?;
            if !names.insert(name.clone()) {
                return Err(GgufError::DuplicateTensor {
                    file: file.into(),
                    tensor: name,
                });
            }
            let what = || format!("tensor `{name}`'s directory entry");
            let rank = r.u32(&what)?;
            if rank > 4 {
                return Err(GgufError::Rank {
                    file: file.into(),
                    tensor: name,
                    dims: rank,
                });
            }
            let dims = (0..rank)
                .map(|_| r.u64(&what))
                .collect::<Result<Vec<_>, _>>()?;
            let ggml_type = GgmlType::from_u32(r.u32(&what)?);
            let offset = r.u64(&what)?;
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let alignment = metadata
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(32);
        if !alignment.is_power_of_two() {
            return Err(GgufError::Alignment {
                file: file.into(),
                alignment,
            });
        }
        // Past the end of the file when the alignment exceeds it; then every tensor with data
        // fails its bounds check.
        let data_start = usize::try_from(alignment)
            .ok()
            .and_then(|a| r.pos.div_ceil(a).checked_mul(a))
            .unwrap_or(usize::MAX);
        if let Some(t) = tensors.iter().find(|t| t.offset % alignment != 0) {
            return Err(GgufError::Misaligned {
                file: file.into(),
                tensor: t.name.clone(),
                offset: t.offset,
                alignment,
            });
        }
        let g = Gguf {
            file: file.into(),
            version,
            metadata,
            tensors,
            bytes,
            data_start,
        };
        for t in &g.tensors {
            g.data_range(t)?;
        }
        Ok(g)
    }

    /// Byte range of a tensor's data within the file.
    fn data_range(&self, t: &TensorInfo) -> Result<std::ops::Range<usize>, GgufError> {
        let ty_err = |problem: String| GgufError::TensorType {
            file: self.file.clone(),
            tensor: t.name.clone(),
            ty: t.ggml_type,
            problem,
        };
        let (per_block, block_bytes) = t.ggml_type.block().ok_or_else(|| {
            ty_err("not a supported type (F32, F16, BF16, Q8_0, Q4_0, Q4_1 are)".into())
        })?;
        let n = t
            .dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| ty_err(format!("dims {:?} overflow", t.dims)))?;
        if t.dims.first().is_some_and(|&d| d % per_block as u64 != 0) {
            return Err(ty_err(format!(
                "row length {} is not a multiple of the block size {per_block}",
                t.dims[0]
            )));
        }
        // A rank-0 tensor of a block type: one element, no whole block (once read as zero bytes
        // and zero values for a one-element shape).
        if n % per_block as u64 != 0 {
            return Err(ty_err(format!(
                "{n} elements are not a whole number of blocks of {per_block}"
            )));
        }
        let bytes = (n / per_block as u64)
            .checked_mul(block_bytes as u64)
            .ok_or_else(|| ty_err(format!("dims {:?} overflow as bytes", t.dims)))?;
        let start = (self.data_start as u64).checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(bytes));
        match (start, end) {
            (Some(s), Some(e)) if e <= self.bytes.len() as u64 => Ok(s as usize..e as usize),
            _ => Err(GgufError::TensorBounds {
                file: self.file.clone(),
                tensor: t.name.clone(),
                start: (self.data_start as u64).saturating_add(t.offset),
                end: (self.data_start as u64)
                    .saturating_add(t.offset)
                    .saturating_add(bytes),
                len: self.bytes.len(),
            }),
        }
    }

    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| GgufError::MissingTensor {
                file: self.file.clone(),
                tensor: name.into(),
            })
    }

    /// The raw bytes of a tensor (quantized blocks as stored).
    pub fn raw(&self, t: &TensorInfo) -> Result<&'a [u8], GgufError> {
        Ok(&self.bytes[self.data_range(t)?])
    }

    /// The tensor's values as f32, in row-major order of [`TensorInfo::shape`].
    pub fn dequantize(&self, t: &TensorInfo) -> Result<Vec<f32>, GgufError> {
        let raw = self.raw(t)?;
        // Sized by the bytes the file holds, not by the dims (which `raw` checked against them).
        let (per_block, block_bytes) = t.ggml_type.block().unwrap_or((1, 1));
        let mut out = Vec::with_capacity(raw.len() / block_bytes * per_block);
        dequantize_into(t.ggml_type, raw, &mut out);
        Ok(out)
    }
}

fn f16(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Appends the values of `raw` (whole blocks of `ty`) to `out`. `ty` must have a block layout.
pub fn dequantize_into(ty: GgmlType, raw: &[u8], out: &mut Vec<f32>) {
    match ty {
        GgmlType::F32 => out.extend(
            raw.chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap())),
        ),
        GgmlType::F16 => out.extend(raw.chunks_exact(2).map(f16)),
        GgmlType::BF16 => out.extend(
            raw.chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        // d (f16), 32 x i8: x = d * q
        GgmlType::Q8_0 => {
            for b in raw.chunks_exact(34) {
                let d = f16(&b[0..2]);
                out.extend(b[2..].iter().map(|&q| d * (q as i8) as f32));
            }
        }
        // d (f16), 16 bytes: element j is the low nibble of byte j, element j+16 the high one;
        // x = d * (q - 8)
        GgmlType::Q4_0 => {
            for b in raw.chunks_exact(18) {
                let d = f16(&b[0..2]);
                let qs = &b[2..];
                out.extend(qs.iter().map(|&q| d * ((q & 0xF) as i32 - 8) as f32));
                out.extend(qs.iter().map(|&q| d * ((q >> 4) as i32 - 8) as f32));
            }
        }
        // d (f16), m (f16), 16 bytes as Q4_0: x = d * q + m
        GgmlType::Q4_1 => {
            for b in raw.chunks_exact(20) {
                let (d, m) = (f16(&b[0..2]), f16(&b[2..4]));
                let qs = &b[4..];
                out.extend(qs.iter().map(|&q| d * (q & 0xF) as f32 + m));
                out.extend(qs.iter().map(|&q| d * (q >> 4) as f32 + m));
            }
        }
        GgmlType::Other(t) => panic!("dequantize_into: ggml type {t} has no block layout"),
    }
}

/// Undoes llama.cpp's permutation of q/k projection rows (made for its interleaved RoPE) to get
/// the Hugging Face layout used with rotate-half RoPE:
/// `w.reshape(n_head, rows / n_head / 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)`.
pub fn unpermute_qk_rows<T: Copy>(w: &[T], rows: usize, cols: usize, n_head: usize) -> Vec<T> {
    assert_eq!(w.len(), rows * cols);
    unpermute_qk_index(rows, n_head)
        .into_iter()
        .flat_map(|src| w[src * cols..(src + 1) * cols].iter().copied())
        .collect()
}

/// For each row of the un-permuted q/k matrix, the row of the GGUF matrix it comes from.
pub fn unpermute_qk_index(rows: usize, n_head: usize) -> Vec<usize> {
    assert_eq!(
        rows % (2 * n_head),
        0,
        "rows {rows} not divisible by 2 * n_head {n_head}"
    );
    let half = rows / n_head / 2;
    let mut out = Vec::with_capacity(rows);
    for h in 0..n_head {
        for j in 0..2 {
            for i in 0..half {
                // Source row (h, i, j) in the (n_head, half, 2) view lands at (h, j, i).
                out.push((h * half + i) * 2 + j);
            }
        }
    }
    out
}

/// Writes GGUF v3 files; used by tests to make small files of their own.
#[derive(Default)]
pub struct Writer {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl Writer {
    pub fn meta(mut self, key: &str, v: Value) -> Self {
        self.metadata.push((key.into(), v));
        self
    }

    /// Adds a tensor with ggml `dims` (fastest first) and its raw data.
    pub fn tensor(mut self, name: &str, dims: &[u64], ty: GgmlType, raw: Vec<u8>) -> Self {
        self.tensors.push((name.into(), dims.to_vec(), ty, raw));
        self
    }

    fn put_value(out: &mut Vec<u8>, v: &Value) {
        match v {
            Value::U8(x) => out.push(*x),
            Value::I8(x) => out.push(*x as u8),
            Value::U16(x) => out.extend(x.to_le_bytes()),
            Value::I16(x) => out.extend(x.to_le_bytes()),
            Value::U32(x) => out.extend(x.to_le_bytes()),
            Value::I32(x) => out.extend(x.to_le_bytes()),
            Value::F32(x) => out.extend(x.to_le_bytes()),
            Value::Bool(x) => out.push(*x as u8),
            Value::String(s) => {
                out.extend((s.len() as u64).to_le_bytes());
                out.extend(s.as_bytes());
            }
            Value::Array(items) => {
                let ty = items.first().map_or(4, Value::type_code);
                out.extend(ty.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for i in items {
                    Self::put_value(out, i);
                }
            }
            Value::U64(x) => out.extend(x.to_le_bytes()),
            Value::I64(x) => out.extend(x.to_le_bytes()),
            Value::F64(x) => out.extend(x.to_le_bytes()),
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        const ALIGN: usize = 32;
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            Self::put_value(&mut out, &Value::String(k.clone()));
            out.extend(v.type_code().to_le_bytes());
            Self::put_value(&mut out, v);
        }
        let mut offset = 0u64;
        for (name, dims, ty, raw) in &self.tensors {
            Self::put_value(&mut out, &Value::String(name.clone()));
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.to_u32().to_le_bytes());
            out.extend(offset.to_le_bytes());
            offset += (raw.len() as u64).div_ceil(ALIGN as u64) * ALIGN as u64;
        }
        out.resize(out.len().div_ceil(ALIGN) * ALIGN, 0);
        for (i, (_, _, _, raw)) in self.tensors.iter().enumerate() {
            out.extend(raw);
            if i + 1 < self.tensors.len() {
                out.resize(out.len().div_ceil(ALIGN) * ALIGN, 0);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(x: f32) -> [u8; 2] {
        half::f16::from_f32(x).to_le_bytes()
    }

    /// One Q4_1 block: d, m and nibbles 0..15, 15..0 (low nibbles then high nibbles).
    fn q4_1_block(d: f32, m: f32) -> (Vec<u8>, Vec<f32>) {
        let mut raw = f16_bytes(d).to_vec();
        raw.extend(f16_bytes(m));
        let lo: Vec<u8> = (0..16).collect();
        let hi: Vec<u8> = (0..16).rev().collect();
        raw.extend(lo.iter().zip(&hi).map(|(l, h)| l | (h << 4)));
        let (d, m) = (
            half::f16::from_f32(d).to_f32(),
            half::f16::from_f32(m).to_f32(),
        );
        let vals = lo.iter().chain(&hi).map(|&q| d * q as f32 + m).collect();
        (raw, vals)
    }

    fn sample() -> Vec<u8> {
        let (q41, _) = q4_1_block(0.5, -1.0);
        let f32s: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        Writer::default()
            .meta("general.architecture", Value::String("llama".into()))
            .meta("llama.block_count", Value::U32(2))
            .meta(
                "tokenizer.ggml.tokens",
                Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
            )
            .tensor("w", &[3, 2], GgmlType::F32, f32s)
            .tensor("q", &[32, 1], GgmlType::Q4_1, q41)
            .to_bytes()
    }

    #[test]
    fn round_trips_metadata_and_tensors() {
        let bytes = sample();
        let g = Gguf::parse("sample.gguf", &bytes).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.metadata["general.architecture"].as_str(), Some("llama"));
        assert_eq!(g.metadata["llama.block_count"].as_u64(), Some(2));
        assert_eq!(
            g.metadata["tokenizer.ggml.tokens"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        let w = g.tensor("w").unwrap();
        assert_eq!(w.shape(), vec![2, 3]);
        assert_eq!(g.dequantize(w).unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    }

    #[test]
    fn dequantizes_q4_1_q4_0_q8_0_exactly() {
        let (raw, want) = q4_1_block(0.25, 0.75);
        let mut got = Vec::new();
        dequantize_into(GgmlType::Q4_1, &raw, &mut got);
        assert_eq!(got, want);

        let mut raw = f16_bytes(2.0).to_vec();
        raw.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut got = Vec::new();
        dequantize_into(GgmlType::Q4_0, &raw, &mut got);
        let want: Vec<f32> = (0..16)
            .map(|j| 2.0 * (j - 8) as f32)
            .chain((0..16).map(|j| 2.0 * (7 - j) as f32))
            .collect();
        assert_eq!(got, want);

        let mut raw = f16_bytes(0.5).to_vec();
        raw.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let mut got = Vec::new();
        dequantize_into(GgmlType::Q8_0, &raw, &mut got);
        assert_eq!(
            got,
            (0..32).map(|i| 0.5 * (i - 16) as f32).collect::<Vec<_>>()
        );
    }

    #[test]
    fn truncation_anywhere_is_a_typed_error_never_a_panic() {
        let bytes = sample();
        for cut in 0..bytes.len() - 1 {
            match Gguf::parse("cut.gguf", &bytes[..cut]) {
                Err(GgufError::Truncated { .. } | GgufError::TensorBounds { .. }) => {}
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
    }

    #[test]
    fn bad_magic_version_and_type_are_named() {
        let mut bytes = sample();
        bytes[0] = b'X';
        assert!(matches!(
            Gguf::parse("f", &bytes),
            Err(GgufError::BadMagic { .. })
        ));
        let mut bytes = sample();
        bytes[4] = 9;
        assert!(matches!(
            Gguf::parse("f", &bytes),
            Err(GgufError::Version { version: 9, .. })
        ));
        let bytes = Writer::default()
            .tensor("odd", &[32], GgmlType::Other(12), vec![0; 144])
            .to_bytes();
        match Gguf::parse("f.gguf", &bytes) {
            Err(e @ GgufError::TensorType { .. }) => {
                assert!(e.to_string().contains("`odd`"), "{e}")
            }
            other => panic!("{other:?}"),
        }
        let bytes = sample();
        let g = Gguf::parse("f.gguf", &bytes).unwrap();
        assert_eq!(
            g.tensor("nope").unwrap_err().to_string(),
            "f.gguf: no tensor named `nope`"
        );
    }

    /// The byte position of tensor `name`'s directory entry fields (dims, then type, then
    /// offset) in `bytes`, found after the name.
    fn entry_pos(bytes: &[u8], name: &str) -> usize {
        let pat: Vec<u8> = (name.len() as u64)
            .to_le_bytes()
            .into_iter()
            .chain(name.bytes())
            .collect();
        bytes.windows(pat.len()).position(|w| w == pat).unwrap() + pat.len()
    }

    #[test]
    fn absurd_dims_and_offsets_are_typed_errors() {
        // dims whose element count fits u64 but whose byte size does not (once wrapped to a
        // zero-byte range that passed the bounds check, then allocated 2^62 floats).
        let bytes = Writer::default()
            .tensor("huge", &[1 << 62], GgmlType::F32, vec![])
            .to_bytes();
        match Gguf::parse("f.gguf", &bytes) {
            Err(e @ GgufError::TensorType { .. }) => assert!(e.to_string().contains("`huge`")),
            other => panic!("{other:?}"),
        }
        // An offset near u64::MAX (once overflowed while building the error).
        let mut bytes = Writer::default()
            .tensor("far", &[4], GgmlType::F32, vec![0; 16])
            .to_bytes();
        let at = entry_pos(&bytes, "far") + 4 + 8 + 4;
        bytes[at..at + 8].copy_from_slice(&(u64::MAX - 31).to_le_bytes());
        assert!(matches!(
            Gguf::parse("f.gguf", &bytes),
            Err(GgufError::TensorBounds { .. })
        ));
        // A scalar of a block type.
        let scalar = Writer::default()
            .tensor("scalar", &[], GgmlType::Q4_0, vec![])
            .to_bytes();
        assert!(matches!(
            Gguf::parse("f.gguf", &scalar),
            Err(GgufError::TensorType { .. })
        ));
        // An offset off the alignment.
        bytes[at..at + 8].copy_from_slice(&4u64.to_le_bytes());
        assert!(matches!(
            Gguf::parse("f.gguf", &bytes),
            Err(GgufError::Misaligned { offset: 4, .. })
        ));
    }

    #[test]
    fn duplicates_and_deep_nesting_are_typed_errors() {
        let bytes = Writer::default()
            .meta("k", Value::U8(1))
            .meta("k", Value::U8(2))
            .to_bytes();
        assert!(matches!(
            Gguf::parse("f.gguf", &bytes),
            Err(GgufError::DuplicateKey { .. })
        ));
        let bytes = Writer::default()
            .tensor("t", &[1], GgmlType::F32, vec![0; 4])
            .tensor("t", &[1], GgmlType::F32, vec![0; 4])
            .to_bytes();
        assert!(matches!(
            Gguf::parse("f.gguf", &bytes),
            Err(GgufError::DuplicateTensor { .. })
        ));
        let mut v = Value::U8(0);
        for _ in 0..MAX_ARRAY_DEPTH {
            v = Value::Array(vec![v]);
        }
        let ok = Writer::default().meta("deep", v.clone()).to_bytes();
        assert!(Gguf::parse("f.gguf", &ok).is_ok());
        let bytes = Writer::default()
            .meta("deep", Value::Array(vec![v]))
            .to_bytes();
        assert!(matches!(
            Gguf::parse("f.gguf", &bytes),
            Err(GgufError::Nesting { .. })
        ));
    }

    #[test]
    fn unpermute_matches_the_reshape_swapaxes_definition() {
        // 2 heads, 4 rows per head (half = 2), 3 columns; row r holds value r in every column.
        let (rows, cols, n_head) = (8, 3, 2);
        let w: Vec<usize> = (0..rows)
            .flat_map(|r| std::iter::repeat_n(r, cols))
            .collect();
        let out = unpermute_qk_rows(&w, rows, cols, n_head);
        // (h, i, j) -> (h, j, i): head 0 rows [0, 2, 1, 3], head 1 rows [4, 6, 5, 7].
        let order: Vec<usize> = out.chunks(cols).map(|c| c[0]).collect();
        assert_eq!(order, vec![0, 2, 1, 3, 4, 6, 5, 7]);
    }
}
