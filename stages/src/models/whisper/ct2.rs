//! Reader for CTranslate2's `model.bin`: the header, the variables (name, shape, dtype, raw
//! bytes) and the aliases.
//!
//! The layout is CTranslate2's (python `ctranslate2/specs/model_spec.py` `_serialize`, C++
//! `src/models/model.cc` `Model::load`), little endian:
//!
//! ```text
//! u32 binary_version                        (1..=6 here; CTranslate2 4.x writes 6)
//! if version >= 2: str spec_name, u32 spec_revision
//! u32 n_variables, then per variable:
//!     str name, u8 rank, u32 dims[rank],
//!     version >= 4: u8 dtype_id, u32 n_bytes      (dtype ids: f32 i8 i16 i32 f16 bf16)
//!     version <  4: u8 item_size, u32 n_items      (4: f32, 2: i16, 1: i8)
//!     n_bytes raw bytes
//! if version >= 3: u32 n_aliases, then per alias: str alias, str variable_name
//! str = u16 length (including a trailing NUL), then that many bytes
//! ```
//!
//! Everything is bounds-checked: a truncated or inconsistent file is an error, never a panic.
//! Variable data stays in the one buffer the file was read into (no copy per variable).

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use crate::models::{ModelError, Result};

/// The newest binary version this reader understands (CTranslate2's `CURRENT_BINARY_VERSION`).
pub const MAX_BINARY_VERSION: u32 = 6;

/// Element type of a stored variable (CTranslate2's `DataType` ids, in order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ct2DType {
    F32,
    I8,
    I16,
    I32,
    F16,
    BF16,
}

impl Ct2DType {
    fn from_id(id: u8) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::I8,
            2 => Self::I16,
            3 => Self::I32,
            4 => Self::F16,
            5 => Self::BF16,
            _ => return None,
        })
    }

    /// The pre-v4 files stored an item size instead of a type (CTranslate2's own, "flawed",
    /// resolution: 2 bytes always meant int16).
    fn from_item_size(size: u8) -> Option<Self> {
        Some(match size {
            4 => Self::F32,
            2 => Self::I16,
            1 => Self::I8,
            _ => return None,
        })
    }

    pub fn size(self) -> usize {
        match self {
            Self::I8 => 1,
            Self::I16 | Self::F16 | Self::BF16 => 2,
            Self::F32 | Self::I32 => 4,
        }
    }
}

/// One stored variable; its bytes are [`Ct2Model::bytes`].
#[derive(Debug, Clone)]
pub struct Variable {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: Ct2DType,
    data: Range<usize>,
}

impl Variable {
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A parsed `model.bin`.
#[derive(Debug)]
pub struct Ct2Model {
    path: PathBuf,
    pub binary_version: u32,
    /// Spec name (e.g. `WhisperSpec`); empty for binary version 1.
    pub spec: String,
    pub spec_revision: u32,
    variables: Vec<Variable>,
    index: HashMap<String, usize>,
    /// `(alias, variable name)` in file order.
    pub aliases: Vec<(String, String)>,
    buf: Vec<u8>,
}

/// Bounds-checked little-endian cursor over the file.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, msg: String) -> ModelError {
        ModelError::Format {
            path: self.path.to_path_buf(),
            msg,
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(self.err(format!(
                "truncated: {what} needs {n} bytes at offset {}, file has {}",
                self.pos,
                self.buf.len()
            ))),
        }
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A length-prefixed string; like CTranslate2's `std::string(c_str)`, it ends at the first
    /// NUL (which must be inside the stored length).
    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u16(what)? as usize;
        let at = self.pos;
        let bytes = self.take(len, what)?;
        let end = bytes
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| self.err(format!("{what} at offset {at} is not NUL-terminated")))?;
        String::from_utf8(bytes[..end].to_vec())
            .map_err(|_| self.err(format!("{what} at offset {at} is not UTF-8")))
    }
}

impl Ct2Model {
    /// Reads and parses `path` (a `model.bin`).
    pub fn read(path: &Path) -> Result<Self> {
        let buf = std::fs::read(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(buf, path)
    }

    /// Parses the bytes of a `model.bin`; `path` only names the file in errors.
    pub fn parse(buf: Vec<u8>, path: &Path) -> Result<Self> {
        let mut c = Cursor {
            buf: &buf,
            pos: 0,
            path,
        };
        let binary_version = c.u32("binary version")?;
        if binary_version == 0 || binary_version > MAX_BINARY_VERSION {
            return Err(c.err(format!(
                "binary version {binary_version} (this reader knows 1..={MAX_BINARY_VERSION})"
            )));
        }
        let (spec, spec_revision) = if binary_version >= 2 {
            (c.string("spec name")?, c.u32("spec revision")?)
        } else {
            (String::new(), 1)
        };

        let n_vars = c.u32("variable count")? as usize;
        // Each variable takes at least 8 bytes, so a huge count in a small file is caught here
        // instead of by a huge allocation.
        let mut variables = Vec::with_capacity(n_vars.min(buf.len() / 8));
        let mut index = HashMap::new();
        for i in 0..n_vars {
            let name = c.string("variable name")?;
            let rank = c.u8("rank")? as usize;
            let mut shape = Vec::with_capacity(rank);
            for _ in 0..rank {
                shape.push(c.u32("dimension")? as usize);
            }
            let (dtype, n_bytes) = if binary_version >= 4 {
                let id = c.u8("dtype")?;
                let dtype = Ct2DType::from_id(id)
                    .ok_or_else(|| c.err(format!("variable {name}: unknown dtype id {id}")))?;
                (dtype, c.u32("byte count")? as usize)
            } else {
                let size = c.u8("item size")?;
                let dtype = Ct2DType::from_item_size(size)
                    .ok_or_else(|| c.err(format!("variable {name}: unknown item size {size}")))?;
                let n = c.u32("item count")? as usize;
                let n_bytes = n
                    .checked_mul(dtype.size())
                    .ok_or_else(|| c.err(format!("variable {name}: size overflows")))?;
                (dtype, n_bytes)
            };
            let expected = shape
                .iter()
                .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| c.err(format!("variable {name}: shape {shape:?} overflows")))?;
            if expected != n_bytes {
                return Err(c.err(format!(
                    "variable {name}: shape {shape:?} of {dtype:?} needs {expected} bytes, \
                     the file says {n_bytes}"
                )));
            }
            let start = c.pos;
            c.take(n_bytes, &format!("data of {name}"))?;
            if index.insert(name.clone(), i).is_some() {
                return Err(c.err(format!("variable {name} stored twice")));
            }
            variables.push(Variable {
                name,
                shape,
                dtype,
                data: start..start + n_bytes,
            });
        }

        let mut aliases = Vec::new();
        if binary_version >= 3 {
            let n = c.u32("alias count")? as usize;
            for _ in 0..n {
                let alias = c.string("alias")?;
                let target = c.string("alias target")?;
                aliases.push((alias, target));
            }
        }
        // Bytes after the aliases are ignored, as CTranslate2 does.
        Ok(Self {
            path: path.to_path_buf(),
            binary_version,
            spec,
            spec_revision,
            variables,
            index,
            aliases,
            buf,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn variables(&self) -> &[Variable] {
        &self.variables
    }

    /// The variable called `name`, directly or through an alias (CTranslate2 resolves an
    /// alias to a stored variable, never to another alias; an alias to a missing variable is
    /// ignored, as there).
    pub fn get(&self, name: &str) -> Option<&Variable> {
        if let Some(&i) = self.index.get(name) {
            return Some(&self.variables[i]);
        }
        let (_, target) = self.aliases.iter().find(|(a, _)| a == name)?;
        self.index.get(target).map(|&i| &self.variables[i])
    }

    /// Like [`Self::get`], but a missing variable is an error.
    pub fn require(&self, name: &str) -> Result<&Variable> {
        self.get(name)
            .ok_or_else(|| self.format_err(format!("no variable {name}")))
    }

    /// The raw (little-endian) bytes of `var`.
    pub fn bytes(&self, var: &Variable) -> &[u8] {
        // `data` was bounds-checked against this very buffer when parsing.
        &self.buf[var.data.clone()]
    }

    /// The values of a float variable (f32, f16 or bf16) as f32.
    pub fn to_f32(&self, var: &Variable) -> Result<Vec<f32>> {
        let b = self.bytes(var);
        Ok(match var.dtype {
            Ct2DType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Ct2DType::F16 => b
                .chunks_exact(2)
                .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            Ct2DType::BF16 => b
                .chunks_exact(2)
                .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
                .collect(),
            other => {
                return Err(self.format_err(format!(
                    "variable {}: {other:?} is not a float type (quantized models are not \
                     supported; convert with --quantization float16 or float32)",
                    var.name
                )))
            }
        })
    }

    /// `name` as an f32 tensor of its stored shape.
    pub fn tensor(&self, name: &str, device: &Device) -> Result<Tensor> {
        let var = self.require(name)?;
        let data = self.to_f32(var)?;
        Ok(Tensor::from_vec(data, var.shape.as_slice(), device)?)
    }

    /// An integer scalar (CTranslate2 stores model attributes such as `num_heads` or flags
    /// such as `pre_norm` as rank-0 int8/int16/int32 variables); None when absent.
    pub fn scalar_int(&self, name: &str) -> Result<Option<i64>> {
        let Some(var) = self.get(name) else {
            return Ok(None);
        };
        if var.elem_count() != 1 {
            return Err(self.format_err(format!(
                "variable {name}: expected a scalar, shape {:?}",
                var.shape
            )));
        }
        let b = self.bytes(var);
        Ok(Some(match var.dtype {
            Ct2DType::I8 => b[0] as i8 as i64,
            Ct2DType::I16 => i16::from_le_bytes([b[0], b[1]]) as i64,
            Ct2DType::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
            other => {
                return Err(
                    self.format_err(format!("variable {name}: {other:?} is not an integer type"))
                )
            }
        }))
    }

    pub(crate) fn format_err(&self, msg: String) -> ModelError {
        ModelError::Format {
            path: self.path.clone(),
            msg,
        }
    }
}

/// IEEE half -> single (exact: every f16 is an f32), subnormals, infinities and NaN included.
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        // Subnormal: man * 2^-24, exactly representable as a normal f32.
        (0, _) => {
            let v = man as f32 * f32::powi(2.0, -24);
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, _) => sign | 0x7fc0_0000 | (man << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u16 + 1).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
        out.push(0);
    }

    /// A small v6 file: an f16 matrix, an f32 vector, an int16 scalar and one alias.
    fn sample() -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&6u32.to_le_bytes());
        put_str(&mut b, "TestSpec");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&3u32.to_le_bytes());
        // "w": f16 [2, 2] = 1, -2, 0.5, 65504
        put_str(&mut b, "w");
        b.push(2);
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&2u32.to_le_bytes());
        b.push(4);
        b.extend_from_slice(&8u32.to_le_bytes());
        for h in [0x3c00u16, 0xc000, 0x3800, 0x7bff] {
            b.extend_from_slice(&h.to_le_bytes());
        }
        // "b": f32 [3]
        put_str(&mut b, "b");
        b.push(1);
        b.extend_from_slice(&3u32.to_le_bytes());
        b.push(0);
        b.extend_from_slice(&12u32.to_le_bytes());
        for v in [0.25f32, -1.5, 3.0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        // "n": int16 scalar 6
        put_str(&mut b, "n");
        b.push(0);
        b.push(2);
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&6i16.to_le_bytes());
        // alias "proj" -> "w"
        b.extend_from_slice(&1u32.to_le_bytes());
        put_str(&mut b, "proj");
        put_str(&mut b, "w");
        b
    }

    #[test]
    fn parses_header_variables_and_aliases() {
        let m = Ct2Model::parse(sample(), Path::new("sample.bin")).expect("parse");
        assert_eq!(m.binary_version, 6);
        assert_eq!(m.spec, "TestSpec");
        assert_eq!(m.spec_revision, 3);
        assert_eq!(m.variables().len(), 3);
        let w = m.require("w").expect("w");
        assert_eq!(w.shape, vec![2, 2]);
        assert_eq!(w.dtype, Ct2DType::F16);
        assert_eq!(m.to_f32(w).expect("f16"), vec![1.0, -2.0, 0.5, 65504.0]);
        assert_eq!(m.require("proj").expect("alias").name, "w");
        let b = m.tensor("b", &Device::Cpu).expect("tensor");
        assert_eq!(b.to_vec1::<f32>().expect("vec"), vec![0.25, -1.5, 3.0]);
        assert_eq!(m.scalar_int("n").expect("n"), Some(6));
        assert_eq!(m.scalar_int("missing").expect("missing"), None);
        assert!(m.require("missing").is_err());
        assert!(m.scalar_int("b").is_err(), "a vector is no scalar");
    }

    #[test]
    fn truncated_file_is_an_error_at_every_length() {
        let full = sample();
        for len in 0..full.len() {
            let r = Ct2Model::parse(full[..len].to_vec(), Path::new("cut.bin"));
            assert!(
                r.is_err(),
                "a file cut at {len} of {} bytes parsed",
                full.len()
            );
        }
        assert!(Ct2Model::parse(full, Path::new("ok.bin")).is_ok());
    }

    #[test]
    fn inconsistent_files_are_errors() {
        let good = sample();
        // Binary version from the future.
        let mut b = good.clone();
        b[..4].copy_from_slice(&7u32.to_le_bytes());
        assert!(Ct2Model::parse(b, Path::new("x")).is_err());
        // Byte count that disagrees with the shape (variable "w": name at 4+2+9+4+4 = 23).
        let w_bytes_at = 23 + 2 + 2 + 1 + 8 + 1;
        let mut b = good.clone();
        b[w_bytes_at..w_bytes_at + 4].copy_from_slice(&6u32.to_le_bytes());
        let e = Ct2Model::parse(b, Path::new("x")).expect_err("bad byte count");
        assert!(e.to_string().contains("needs 8 bytes"), "{e}");
        // Unknown dtype id.
        let mut b = good.clone();
        b[w_bytes_at - 1] = 9;
        assert!(Ct2Model::parse(b, Path::new("x")).is_err());
        // A string without its NUL.
        let mut b = good.clone();
        b[23 + 2 + 1] = b'x';
        assert!(Ct2Model::parse(b, Path::new("x")).is_err());
        // A huge variable count in a tiny file.
        let mut b = good;
        b[19..23].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Ct2Model::parse(b, Path::new("x")).is_err());
    }

    #[test]
    fn half_precision_conversion() {
        assert_eq!(f16_to_f32(0x0000), 0.0);
        assert!(f16_to_f32(0x8000).is_sign_negative());
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x83ff), -(1023.0 * 2f32.powi(-24)));
        assert_eq!(f16_to_f32(0x0400), 2f32.powi(-14));
        assert_eq!(f16_to_f32(0x3555), 0.333_251_95);
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
        assert_eq!(f16_to_f32(0xfc00), f32::NEG_INFINITY);
        assert!(f16_to_f32(0x7e00).is_nan());
    }

    /// The real tiny.en conversion (skipped when models/ lacks it).
    #[test]
    fn reads_whisper_tiny_en() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/whisper-tiny-en/model.bin");
        if !path.exists() {
            eprintln!("SKIP: {} not found", path.display());
            return;
        }
        let m = Ct2Model::read(&path).expect("model.bin");
        assert_eq!(
            (m.binary_version, m.spec.as_str(), m.spec_revision),
            (6, "WhisperSpec", 3)
        );
        assert_eq!(
            m.aliases,
            vec![(
                "decoder/projection/weight".to_string(),
                "decoder/embeddings/weight".to_string()
            )]
        );
        let emb = m.require("decoder/projection/weight").expect("projection");
        assert_eq!(
            (emb.name.as_str(), emb.shape.as_slice()),
            ("decoder/embeddings/weight", &[51864, 384][..])
        );
        assert_eq!(emb.dtype, Ct2DType::F16);
        assert_eq!(m.scalar_int("decoder/num_heads").expect("heads"), Some(6));
        // Cut anywhere in the header and first variables: an error, never a panic.
        let bytes = std::fs::read(&path).expect("read");
        for len in (0..4096).chain((4096..200_000).step_by(997)) {
            assert!(
                Ct2Model::parse(bytes[..len].to_vec(), &path).is_err(),
                "cut at {len}"
            );
        }
    }
}
