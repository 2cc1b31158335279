//! Tensors on disk: safetensors files, named by the arguments' and results' `nns.name`.

use crate::tensor::{Data, Tensor};
use nnscaler_dialects::types::Elem;
use safetensors::{Dtype, SafeTensors};
use std::path::Path;

/// A tensor read from a file, with the element type it was stored as.
#[derive(Clone, Debug)]
pub struct Stored {
    /// The tensor's name in the file.
    pub name: String,
    /// The stored element type.
    pub elem: Elem,
    /// The values (f32 for floats, i64 for integers).
    pub tensor: Tensor,
}

fn elem_of(d: Dtype) -> Option<Elem> {
    Some(match d {
        Dtype::F32 => Elem::F32,
        Dtype::I64 => Elem::I64,
        Dtype::I32 => Elem::I32,
        _ => return None,
    })
}

/// The names in the header of safetensors `bytes` that occur more than once. JSON parsers
/// (the safetensors crate's among them) keep the last of duplicate keys, so a file naming a
/// tensor twice would silently lose one.
fn duplicate_names(bytes: &[u8]) -> Vec<String> {
    use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
    struct Keys;
    impl<'de> Visitor<'de> for Keys {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut keys = Vec::new();
            while let Some(k) = map.next_key::<String>()? {
                map.next_value::<IgnoredAny>()?;
                keys.push(k);
            }
            Ok(keys)
        }
    }
    let Some(len) = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
    else {
        return Vec::new();
    };
    let Some(header) = usize::try_from(len)
        .ok()
        .and_then(|n| bytes.get(8..8usize.checked_add(n)?))
    else {
        return Vec::new();
    };
    let mut de = serde_json::Deserializer::from_slice(header);
    let Ok(mut keys) = de.deserialize_map(Keys) else {
        return Vec::new(); // malformed: the safetensors parser reports it
    };
    keys.sort_unstable();
    let mut dups: Vec<String> = keys
        .windows(2)
        .filter(|w| w[0] == w[1])
        .map(|w| w[0].clone())
        .collect();
    dups.dedup();
    dups
}

/// Parses safetensors bytes; `what` (the file name) starts every error message.
pub fn parse(bytes: &[u8], what: &str) -> Result<Vec<Stored>, String> {
    if let Some(name) = duplicate_names(bytes).first() {
        return Err(format!(
            "{what}: not a valid safetensors file (the header names tensor '{name}' twice)"
        ));
    }
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| format!("{what}: not a valid safetensors file ({e})"))?;
    let mut names: Vec<&str> = st.names();
    names.sort_unstable();
    let mut out = Vec::new();
    for name in names {
        let view = st
            .tensor(name)
            .map_err(|e| format!("{what}: tensor '{name}': {e}"))?;
        let elem = elem_of(view.dtype()).ok_or_else(|| {
            format!(
                "{what}: tensor '{name}' has dtype {:?}; the CPU runtime reads F32, I64 and I32",
                view.dtype()
            )
        })?;
        let raw = view.data();
        let shape = view.shape().to_vec();
        let tensor = match elem {
            Elem::F32 => Tensor::f32(
                &shape,
                raw.chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
            Elem::I64 => Tensor::i64(
                &shape,
                raw.chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                    .collect(),
            ),
            _ => Tensor::i64(
                &shape,
                raw.chunks_exact(4)
                    .map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                    .collect(),
            ),
        };
        out.push(Stored {
            name: name.to_string(),
            elem,
            tensor,
        });
    }
    Ok(out)
}

/// Reads a safetensors file.
pub fn load(path: &Path) -> Result<Vec<Stored>, String> {
    let what = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| format!("{what}: cannot read: {e}"))?;
    parse(&bytes, &what)
}

/// Serializes named tensors (each with the element type to store it as: f32, i64 or i32).
pub fn to_bytes(tensors: &[(String, Elem, &Tensor)]) -> Result<Vec<u8>, String> {
    let mut names: Vec<&str> = tensors.iter().map(|(n, _, _)| n.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!("two tensors are named '{}'", w[0]));
    }
    let mut bufs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, elem, t) in tensors {
        let (dtype, bytes) = match (&t.data, elem) {
            (Data::F32(v), _) => (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            (Data::I64(v), Elem::I32) => (
                Dtype::I32,
                v.iter()
                    .map(|&x| i32::try_from(x).map(i32::to_le_bytes))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|_| format!("tensor '{name}' does not fit in i32"))?
                    .concat(),
            ),
            (Data::I64(v), _) => (Dtype::I64, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        };
        bufs.push((name.clone(), dtype, t.shape.clone(), bytes));
    }
    let views = bufs
        .iter()
        .map(|(n, d, s, b)| {
            safetensors::tensor::TensorView::new(*d, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| format!("tensor '{n}': {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize(views, None).map_err(|e| format!("cannot serialize: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_errors() {
        let a = Tensor::f32(&[2, 2], vec![1.0, -2.0, 3.5, 0.0]);
        let b = Tensor::i64(&[3], vec![1, 2, 70000]);
        let bytes = to_bytes(&[("a".into(), Elem::F32, &a), ("b".into(), Elem::I32, &b)]).unwrap();
        let back = parse(&bytes, "t.safetensors").unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(back[0].tensor, a);
        assert_eq!((back[1].elem, &back[1].tensor), (Elem::I32, &b));
        let e = parse(&bytes[..bytes.len() - 3], "t.safetensors").unwrap_err();
        assert!(
            e.starts_with("t.safetensors: not a valid safetensors file"),
            "{e}"
        );
        let e = parse(b"garbage", "g.safetensors").unwrap_err();
        assert!(e.contains("g.safetensors"), "{e}");
        // A header naming a tensor twice.
        let header = br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
        let mut dup = (header.len() as u64).to_le_bytes().to_vec();
        dup.extend_from_slice(header);
        dup.extend_from_slice(&[0; 8]);
        let e = parse(&dup, "d.safetensors").unwrap_err();
        assert!(e.contains("names tensor 'a' twice"), "{e}");
    }
}
