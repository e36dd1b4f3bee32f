//! A reader for GGUF v3 files (llama.cpp's model format): metadata, tensor
//! directory, and tensor data dequantized to f32 (F32, F16, BF16, Q8_0, Q4_1).

use std::collections::BTreeMap;
use std::path::Path;

use half::{bf16, f16};

/// Why a GGUF file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("not a GGUF file (magic {0:#010x})")]
    Magic(u32),
    #[error("GGUF version {0} is not supported (2 and 3 are)")]
    Version(u32),
    #[error("the file ends early (at byte {0})")]
    Truncated(usize),
    #[error("metadata value type {0} is unknown")]
    ValueType(u32),
    #[error("tensor {name}: type {ty} is not supported (F32, F16, BF16, Q8_0, Q4_1 are)")]
    TensorType { name: String, ty: u32 },
    #[error("tensor {name}: {reason}")]
    Tensor { name: String, reason: String },
    #[error("no tensor named {0}")]
    MissingTensor(String),
    #[error("metadata key {key}: {reason}")]
    Metadata { key: String, reason: String },
}

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
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
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
            Value::F32(v) => Some(v.into()),
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
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// ggml tensor types this reader dequantizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorType {
    F32,
    F16,
    Q4_1,
    Q8_0,
    BF16,
}

impl TensorType {
    fn from_ggml(ty: u32) -> Option<Self> {
        Some(match ty {
            0 => Self::F32,
            1 => Self::F16,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            30 => Self::BF16,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block).
    fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q4_1 => (32, 20),
            Self::Q8_0 => (32, 34),
        }
    }
}

/// One entry of the tensor directory.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Dimensions innermost first: `[576, 49152]` is 49,152 rows of 576.
    pub dims: Vec<u64>,
    pub ty: TensorType,
    /// Byte offset from the start of the data section.
    offset: usize,
}

impl TensorInfo {
    pub fn elements(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }
}

/// A parsed GGUF file, its bytes kept in memory.
#[derive(Debug)]
pub struct Gguf {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: BTreeMap<String, TensorInfo>,
    bytes: Vec<u8>,
    data_start: usize,
}

/// A little-endian cursor over the file's bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], GgufError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or(GgufError::Truncated(self.at))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        Ok(self.take(N)?.try_into().expect("length checked"))
    }
    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// A length that must fit what is left of the file (guards huge allocations).
    fn len(&mut self, unit: usize) -> Result<usize, GgufError> {
        let n = self.u64()? as usize;
        if n.saturating_mul(unit.max(1)) > self.bytes.len() - self.at {
            return Err(GgufError::Truncated(self.at));
        }
        Ok(n)
    }
    fn string(&mut self) -> Result<String, GgufError> {
        let n = self.len(1)?;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
    fn value(&mut self, ty: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>()?[0]),
            1 => Value::I8(self.array::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                let elem = self.u32()?;
                let n = self.len(1)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(GgufError::ValueType(other)),
        })
    }
}

impl Gguf {
    pub fn open(path: &Path) -> Result<Gguf, GgufError> {
        let bytes = std::fs::read(path).map_err(|source| GgufError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Gguf::parse(bytes)
    }

    pub fn parse(bytes: Vec<u8>) -> Result<Gguf, GgufError> {
        let mut c = Cursor {
            bytes: &bytes,
            at: 0,
        };
        let magic = c.u32()?;
        if magic != u32::from_le_bytes(*b"GGUF") {
            return Err(GgufError::Magic(magic));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let tensor_count = c.len(8)?;
        let kv_count = c.len(8)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = c.string()?;
            let ty = c.u32()?;
            metadata.insert(key, c.value(ty)?);
        }
        let mut tensors = BTreeMap::new();
        for _ in 0..tensor_count {
            let name = c.string()?;
            let n_dims = c.u32()? as usize;
            if n_dims > 4 {
                return Err(GgufError::Tensor {
                    name,
                    reason: format!("{n_dims} dimensions"),
                });
            }
            let dims = (0..n_dims)
                .map(|_| c.u64())
                .collect::<Result<Vec<_>, _>>()?;
            let raw_ty = c.u32()?;
            let ty = TensorType::from_ggml(raw_ty).ok_or_else(|| GgufError::TensorType {
                name: name.clone(),
                ty: raw_ty,
            })?;
            let offset = c.u64()? as usize;
            tensors.insert(name, TensorInfo { dims, ty, offset });
        }
        let alignment = metadata
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(32)
            .max(1) as usize;
        let data_start = c.at.div_ceil(alignment) * alignment;
        let gguf = Gguf {
            version,
            metadata,
            tensors,
            data_start,
            bytes,
        };
        for (name, info) in &gguf.tensors {
            gguf.tensor_bytes(name, info)?;
        }
        Ok(gguf)
    }

    fn tensor_bytes(&self, name: &str, info: &TensorInfo) -> Result<&[u8], GgufError> {
        let (per_block, block_bytes) = info.ty.block();
        let n = info.elements();
        if !n.is_multiple_of(per_block) {
            return Err(GgufError::Tensor {
                name: name.into(),
                reason: format!("{n} elements are not whole blocks of {per_block}"),
            });
        }
        let start = self.data_start + info.offset;
        let end = start + n / per_block * block_bytes;
        self.bytes.get(start..end).ok_or_else(|| GgufError::Tensor {
            name: name.into(),
            reason: format!("data {start}..{end} is past the end of the file"),
        })
    }

    /// A metadata value, or an error naming the missing key.
    pub fn get(&self, key: &str) -> Result<&Value, GgufError> {
        self.metadata.get(key).ok_or_else(|| GgufError::Metadata {
            key: key.into(),
            reason: "missing".into(),
        })
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.get(key)?.as_u64().ok_or_else(|| GgufError::Metadata {
            key: key.into(),
            reason: "not an unsigned integer".into(),
        })
    }

    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        self.get(key)?.as_f64().ok_or_else(|| GgufError::Metadata {
            key: key.into(),
            reason: "not a number".into(),
        })
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        self.get(key)?.as_str().ok_or_else(|| GgufError::Metadata {
            key: key.into(),
            reason: "not a string".into(),
        })
    }

    /// A tensor's type, raw bytes and dims (innermost first).
    pub fn tensor_raw(&self, name: &str) -> Result<(TensorType, &[u8], &[u64]), GgufError> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor(name.into()))?;
        Ok((info.ty, self.tensor_bytes(name, info)?, &info.dims))
    }

    /// A tensor dequantized to f32, in file order (innermost dimension fastest).
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<u64>), GgufError> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor(name.into()))?;
        let bytes = self.tensor_bytes(name, info)?;
        Ok((dequantize(info.ty, bytes), info.dims.clone()))
    }
}

/// Dequantizes whole blocks of `ty` to f32.
pub fn dequantize(ty: TensorType, bytes: &[u8]) -> Vec<f32> {
    let half = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]).to_f32();
    match ty {
        TensorType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        TensorType::F16 => bytes.chunks_exact(2).map(half).collect(),
        TensorType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        TensorType::Q8_0 => {
            let mut out = Vec::with_capacity(bytes.len() / 34 * 32);
            for block in bytes.chunks_exact(34) {
                let d = half(&block[0..2]);
                out.extend(block[2..].iter().map(|&q| f32::from(q as i8) * d));
            }
            out
        }
        TensorType::Q4_1 => {
            let mut out = Vec::with_capacity(bytes.len() / 20 * 32);
            for block in bytes.chunks_exact(20) {
                let (d, m) = (half(&block[0..2]), half(&block[2..4]));
                let qs = &block[4..20];
                out.extend(qs.iter().map(|&q| f32::from(q & 0x0f) * d + m));
                out.extend(qs.iter().map(|&q| f32::from(q >> 4) * d + m));
            }
            out
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A GGUF v3 file with the given metadata and tensors, as a writer would make it.
    pub fn build(
        meta: &[(&str, u32, Vec<u8>)],
        tensors: &[(&str, &[u64], u32, Vec<u8>)],
    ) -> Vec<u8> {
        let mut out = Vec::new();
        let string = |out: &mut Vec<u8>, s: &str| {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        };
        out.extend(b"GGUF");
        out.extend(3u32.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        out.extend((meta.len() as u64).to_le_bytes());
        for (key, ty, value) in meta {
            string(&mut out, key);
            out.extend(ty.to_le_bytes());
            out.extend(value);
        }
        let mut offset = 0u64;
        for (name, dims, ty, data) in tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in *dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        while out.len() % 32 != 0 {
            out.push(0);
        }
        for (_, _, _, data) in tensors {
            out.extend(data);
            while out.len() % 32 != 0 {
                out.push(0);
            }
        }
        out
    }

    #[test]
    fn q4_1_blocks_put_low_nibbles_first() {
        // d = 2.0, m = -1.0; nibble j of byte i: low = weight i, high = weight i+16.
        let mut block = Vec::new();
        block.extend(f16::from_f32(2.0).to_le_bytes());
        block.extend(f16::from_f32(-1.0).to_le_bytes());
        block.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
        let w = dequantize(TensorType::Q4_1, &block);
        assert_eq!(w.len(), 32);
        assert_eq!(w[0], -1.0); // 0 * 2 - 1
        assert_eq!(w[15], 29.0); // 15 * 2 - 1
        assert_eq!(w[16], 29.0); // high nibble of byte 0 = 15
        assert_eq!(w[31], -1.0);
    }

    #[test]
    fn q8_0_is_signed_times_scale() {
        let mut block = Vec::new();
        block.extend(f16::from_f32(0.5).to_le_bytes());
        block.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let w = dequantize(TensorType::Q8_0, &block);
        assert_eq!((w[0], w[16], w[31]), (-8.0, 0.0, 7.5));
    }

    #[test]
    fn parses_metadata_and_tensors() {
        let u32v = |v: u32| v.to_le_bytes().to_vec();
        let mut arr = Vec::new();
        arr.extend(8u32.to_le_bytes()); // array of strings
        arr.extend(2u64.to_le_bytes());
        for s in ["a", "bc"] {
            arr.extend((s.len() as u64).to_le_bytes());
            arr.extend(s.as_bytes());
        }
        let weights: Vec<u8> = [1.0f32, -2.5, 3.0, 0.25]
            .iter()
            .flat_map(|f| f.to_le_bytes())
            .collect();
        let file = build(
            &[
                ("llama.block_count", 4, u32v(30)),
                ("tokenizer.ggml.tokens", 9, arr),
            ],
            &[("w", &[2, 2], 0, weights)],
        );
        let g = Gguf::parse(file).unwrap();
        assert_eq!(g.get_u64("llama.block_count").unwrap(), 30);
        let tokens = g.get("tokenizer.ggml.tokens").unwrap().as_array().unwrap();
        assert_eq!(tokens[1].as_str(), Some("bc"));
        let (w, dims) = g.tensor_f32("w").unwrap();
        assert_eq!((w, dims), (vec![1.0, -2.5, 3.0, 0.25], vec![2, 2]));
        assert!(matches!(
            g.tensor_f32("nope"),
            Err(GgufError::MissingTensor(_))
        ));
    }

    #[test]
    fn rejects_bad_files_without_panicking() {
        assert!(matches!(
            Gguf::parse(b"GGML....".to_vec()),
            Err(GgufError::Magic(_))
        ));
        let mut f = build(&[], &[]);
        f[4] = 9;
        assert!(matches!(Gguf::parse(f), Err(GgufError::Version(9))));
        // A huge declared count must not allocate: it is checked against the file size.
        let mut f = build(&[], &[]);
        f[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(Gguf::parse(f).is_err());
        // Every prefix of a valid file that cuts into its data fails cleanly
        // (the file ends with the 4 data bytes and 28 bytes of padding).
        let full = build(
            &[("k", 4, 7u32.to_le_bytes().to_vec())],
            &[("w", &[1], 0, vec![0; 4])],
        );
        for cut in 0..full.len() - 28 {
            assert!(Gguf::parse(full[..cut].to_vec()).is_err(), "cut at {cut}");
        }
    }
}
