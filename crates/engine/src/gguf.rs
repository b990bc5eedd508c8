//! GGUF (v2 and v3) model files, memory-mapped: metadata, tensor directory, dequantization.
//!
//! Every count, length and offset is checked against the file before it is used, so a
//! malformed file gives [`EngineError::Malformed`] and never a panic or an allocation larger
//! than the file.

use std::collections::BTreeMap;
use std::path::Path;

use half::{bf16, f16};
use memmap2::Mmap;

use crate::EngineError;

/// An open GGUF file.
#[derive(Debug)]
pub struct Gguf {
    data: Bytes,
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorInfo>,
}

/// The file's bytes: a memory map, or a buffer (tests, embedded models).
#[derive(Debug)]
enum Bytes {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Map(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// `f32` or `f64`.
    F64(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string (invalid UTF-8 is replaced).
    Str(String),
    /// An array of values.
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(x) => Some(x),
            Value::I64(x) => u64::try_from(x).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(x) => Some(x),
            Value::U64(x) => Some(x as f64),
            Value::I64(x) => Some(x as f64),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// The element types this engine reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// Blocks of 32: an f16 scale and 32 signed bytes.
    Q8_0,
    /// Blocks of 32: an f16 scale and 32 nibbles offset by 8.
    Q4_0,
    /// Blocks of 32: f16 scale and minimum, and 32 nibbles.
    Q4_1,
}

impl DType {
    fn from_ggml(t: u32) -> Option<DType> {
        Some(match t {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            8 => DType::Q8_0,
            30 => DType::BF16,
            _ => return None,
        })
    }

    /// Elements per block and bytes per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            DType::F32 => (1, 4),
            DType::F16 | DType::BF16 => (1, 2),
            DType::Q8_0 => (32, 34),
            DType::Q4_0 => (32, 18),
            DType::Q4_1 => (32, 20),
        }
    }
}

/// Where a tensor lies and what it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Dimensions, innermost first (GGUF order: `dims[0]` is the row length).
    pub dims: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// Byte range in the file.
    pub range: std::ops::Range<usize>,
}

impl TensorInfo {
    /// Elements.
    pub fn len(&self) -> usize {
        self.dims.iter().product()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A bounds-checked reader over the file's bytes.
struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], EngineError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| {
                EngineError::Malformed(format!(
                    "{what} at byte {} needs {n} bytes; the file has {}",
                    self.pos,
                    self.b.len()
                ))
            })?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u32(&mut self, what: &str) -> Result<u32, EngineError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64, EngineError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A count of items of at least `min_size` bytes each, checked against what is left.
    fn count(&mut self, min_size: usize, what: &str) -> Result<usize, EngineError> {
        let n = self.u64(what)?;
        let left = (self.b.len() - self.pos) as u64;
        if n.saturating_mul(min_size.max(1) as u64) > left {
            return Err(EngineError::Malformed(format!(
                "{what} of {n} at byte {} exceeds the {left} bytes left",
                self.pos
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, EngineError> {
        let n = self.count(1, what)?;
        Ok(String::from_utf8_lossy(self.take(n, what)?).into_owned())
    }

    fn value(&mut self, t: u32, depth: usize) -> Result<Value, EngineError> {
        let v = |c: &mut Self, n: usize| c.take(n, "a metadata value");
        Ok(match t {
            0 => Value::U64(u64::from(v(self, 1)?[0])),
            1 => Value::I64(i64::from(v(self, 1)?[0] as i8)),
            2 => Value::U64(u64::from(u16::from_le_bytes(
                v(self, 2)?.try_into().expect("2 bytes"),
            ))),
            3 => Value::I64(i64::from(i16::from_le_bytes(
                v(self, 2)?.try_into().expect("2 bytes"),
            ))),
            4 => Value::U64(u64::from(self.u32("a metadata value")?)),
            5 => Value::I64(i64::from(self.u32("a metadata value")? as i32)),
            6 => Value::F64(f64::from(f32::from_bits(self.u32("a metadata value")?))),
            7 => Value::Bool(v(self, 1)?[0] != 0),
            8 => Value::Str(self.string("a metadata string")?),
            9 => {
                if depth > 4 {
                    return Err(EngineError::Malformed("arrays nested too deep".into()));
                }
                let et = self.u32("an array type")?;
                let n = self.count(elem_size(et), "an array")?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(et, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64("a metadata value")?),
            11 => Value::I64(self.u64("a metadata value")? as i64),
            12 => Value::F64(f64::from_bits(self.u64("a metadata value")?)),
            _ => return Err(EngineError::Malformed(format!("metadata value type {t}"))),
        })
    }
}

/// The least bytes one element of metadata type `t` takes.
fn elem_size(t: u32) -> usize {
    match t {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8..=12 => 8,
        _ => 1,
    }
}

impl Gguf {
    /// Maps and parses a file.
    pub fn open(path: &Path) -> Result<Gguf, EngineError> {
        let io = |source| EngineError::Io {
            path: path.to_owned(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private to this process; a file changed underneath
        // it by another process could change the bytes we read, which every reader of a mapped
        // model file accepts (the parse checks bounds, so it cannot read outside the map).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(Bytes::Map(map))
    }

    /// Parses a file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Gguf, EngineError> {
        Self::parse(Bytes::Owned(bytes))
    }

    fn parse(data: Bytes) -> Result<Gguf, EngineError> {
        let mut c = Cursor { b: &data, pos: 0 };
        if c.take(4, "the magic")? != b"GGUF" {
            return Err(EngineError::Malformed("not a GGUF file (bad magic)".into()));
        }
        let version = c.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(EngineError::Unsupported(format!("GGUF version {version}")));
        }
        // A tensor entry takes at least 8 (name) + 4 + 8 + 4 + 8 bytes; a metadata entry 8 + 4 + 1.
        let n_tensors = c.count(32, "the tensor count")?;
        let n_kv = c.count(13, "the metadata count")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("a metadata key")?;
            let t = c.u32("a metadata type")?;
            metadata.insert(key, c.value(t, 0)?);
        }
        let mut raw = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string("a tensor name")?;
            let n_dims = c.u32("a tensor rank")? as usize;
            if n_dims == 0 || n_dims > 4 {
                return Err(EngineError::Malformed(format!("{name}: rank {n_dims}")));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.u64("a tensor dimension")?);
            }
            let t = c.u32("a tensor type")?;
            let offset = c.u64("a tensor offset")?;
            raw.push((name, dims, t, offset));
        }
        let align = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() && a <= 1 << 20 => a as usize,
                _ => return Err(EngineError::Malformed(format!("alignment {v:?}"))),
            },
        };
        let start = c.pos.div_ceil(align) * align;
        let mut tensors = BTreeMap::new();
        for (name, dims, t, offset) in raw {
            let dtype = DType::from_ggml(t)
                .ok_or_else(|| EngineError::Unsupported(format!("{name}: ggml type {t}")))?;
            let len = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .filter(|&n| n > 0)
                .ok_or_else(|| EngineError::Malformed(format!("{name}: dimensions {dims:?}")))?;
            let (per, bytes) = dtype.block();
            if dims[0] % per as u64 != 0 {
                return Err(EngineError::Malformed(format!(
                    "{name}: rows of {} are not whole blocks of {per}",
                    dims[0]
                )));
            }
            let size = (len / per as u64).checked_mul(bytes as u64);
            let begin = (start as u64).checked_add(offset);
            let range = match (begin, size) {
                (Some(b), Some(s)) if b.checked_add(s).is_some_and(|e| e <= data.len() as u64) => {
                    b as usize..(b + s) as usize
                }
                _ => {
                    return Err(EngineError::Malformed(format!(
                        "{name}: data at offset {offset} runs past the end of the file"
                    )));
                }
            };
            let dims = dims.iter().map(|&d| d as usize).collect();
            if tensors
                .insert(name.clone(), TensorInfo { dims, dtype, range })
                .is_some()
            {
                return Err(EngineError::Malformed(format!("tensor {name} twice")));
            }
        }
        Ok(Gguf {
            data,
            version,
            metadata,
            tensors,
        })
    }

    /// A tensor's info.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, EngineError> {
        self.tensors
            .get(name)
            .ok_or_else(|| EngineError::Malformed(format!("no tensor {name}")))
    }

    /// A tensor's raw bytes.
    pub fn raw(&self, name: &str) -> Result<&[u8], EngineError> {
        Ok(&self.data[self.tensor(name)?.range.clone()])
    }

    /// A tensor dequantized to f32, in file order (rows of `dims[0]`).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, EngineError> {
        let t = self.tensor(name)?;
        let mut out = vec![0.0f32; t.len()];
        dequantize(t.dtype, &self.data[t.range.clone()], &mut out);
        Ok(out)
    }
}

/// Dequantizes whole blocks of `dtype` from `src` into `dst` (`dst.len()` elements).
///
/// Inlined into its callers so that SIMD builds of them vectorize it; plain `for` loops, not
/// `for_each` closures, so that nothing stays behind in a separate scalar function.
#[inline(always)]
pub fn dequantize(dtype: DType, src: &[u8], dst: &mut [f32]) {
    let h = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]).to_f32();
    let (per, bytes) = dtype.block();
    let blocks = src.chunks_exact(bytes).zip(dst.chunks_exact_mut(per));
    match dtype {
        DType::F32 => {
            for (b, o) in blocks {
                o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        DType::F16 => {
            for (b, o) in blocks {
                o[0] = h(b);
            }
        }
        DType::BF16 => {
            for (b, o) in blocks {
                o[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        DType::Q8_0 => {
            for (b, o) in blocks {
                let d = h(b);
                let (q, o) = (&b[2..34], &mut o[..32]);
                for j in 0..32 {
                    o[j] = d * f32::from(q[j] as i8);
                }
            }
        }
        DType::Q4_0 => {
            for (b, o) in blocks {
                let d = h(b);
                let (q, o) = (&b[2..18], &mut o[..32]);
                for j in 0..16 {
                    o[j] = d * (f32::from(q[j] & 0xf) - 8.0);
                    o[j + 16] = d * (f32::from(q[j] >> 4) - 8.0);
                }
            }
        }
        DType::Q4_1 => {
            for (b, o) in blocks {
                let (d, m) = (h(b), h(&b[2..]));
                let (q, o) = (&b[4..20], &mut o[..32]);
                for j in 0..16 {
                    o[j] = d * f32::from(q[j] & 0xf) + m;
                    o[j + 16] = d * f32::from(q[j] >> 4) + m;
                }
            }
        }
    }
}
