//! A step's JSON: `{"launch": {...}}`, `{"send": {...}}`, `{"recv": {...}}`, or a
//! collective's `{"<name>": {"input", "output", "groups", <parameters in order>}}`, its
//! name and parameters those of [`Collective`]'s table (so a new collective needs nothing
//! here).

use super::Step;
use crate::collective::{Collective, Param, ParamKind};
use serde::de::Error as _;
use serde::ser::SerializeStructVariant;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

impl Serialize for Step {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Step::Launch { kernel, buffers } => {
                let mut v = s.serialize_struct_variant("Step", 0, "launch", 2)?;
                v.serialize_field("kernel", kernel)?;
                v.serialize_field("buffers", buffers)?;
                v.end()
            }
            Step::Collective {
                op,
                input,
                output,
                groups,
            } => {
                let params = op.params();
                let mut v = s.serialize_struct_variant("Step", 1, op.name(), 3 + params.len())?;
                v.serialize_field("input", input)?;
                v.serialize_field("output", output)?;
                v.serialize_field("groups", groups)?;
                for (k, p) in params {
                    match p {
                        Param::Index(i) => v.serialize_field(k, &i)?,
                        Param::Flag(b) => v.serialize_field(k, &b)?,
                    }
                }
                v.end()
            }
            Step::Send { buffer, to, tag } => {
                let mut v = s.serialize_struct_variant("Step", 2, "send", 3)?;
                v.serialize_field("buffer", buffer)?;
                v.serialize_field("to", to)?;
                v.serialize_field("tag", tag)?;
                v.end()
            }
            Step::Recv { buffer, from, tag } => {
                let mut v = s.serialize_struct_variant("Step", 3, "recv", 3)?;
                v.serialize_field("buffer", buffer)?;
                v.serialize_field("from", from)?;
                v.serialize_field("tag", tag)?;
                v.end()
            }
        }
    }
}

/// The steps that are not collectives, as serde reads them.
#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum Plain {
    Launch {
        kernel: usize,
        buffers: Vec<usize>,
    },
    Send {
        buffer: usize,
        to: usize,
        tag: String,
    },
    Recv {
        buffer: usize,
        from: usize,
        tag: String,
    },
}

impl<'de> Deserialize<'de> for Step {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        from_json(Value::deserialize(d)?).map_err(D::Error::custom)
    }
}

fn from_json(v: Value) -> Result<Step, String> {
    let Value::Object(m) = &v else {
        return Err("a step is not an object".into());
    };
    let mut keys = m.iter();
    let (Some((name, body)), None) = (keys.next(), keys.next()) else {
        return Err(format!("a step has {} keys, not one", m.len()));
    };
    if let Some(op) = Collective::parse(name, |f, k| param(name, body, f, k)) {
        return collective(name, body, op?);
    }
    if !matches!(name.as_str(), "launch" | "send" | "recv") {
        return Err(format!("unknown step '{name}'"));
    }
    Ok(
        match serde_json::from_value(v).map_err(|e| e.to_string())? {
            Plain::Launch { kernel, buffers } => Step::Launch { kernel, buffers },
            Plain::Send { buffer, to, tag } => Step::Send { buffer, to, tag },
            Plain::Recv { buffer, from, tag } => Step::Recv { buffer, from, tag },
        },
    )
}

/// The fields of a collective step `name` (`body`) less its parameters (read by `op`'s
/// parse), checked to name nothing else.
fn collective(name: &str, body: &Value, op: Collective) -> Result<Step, String> {
    let m = fields(name, body)?;
    let params = op.params();
    if let Some(k) = m.keys().find(|k| {
        !matches!(k.as_str(), "input" | "output" | "groups") && !params.iter().any(|(p, _)| p == k)
    }) {
        return Err(format!("unknown field `{k}` in a {name} step"));
    }
    let get = |k: &str| {
        m.get(k)
            .ok_or_else(|| format!("missing field `{k}` in a {name} step"))
    };
    let index = |k: &str| -> Result<usize, String> {
        serde_json::from_value(get(k)?.clone()).map_err(|e| format!("{name} step's `{k}`: {e}"))
    };
    Ok(Step::Collective {
        op,
        input: index("input")?,
        output: index("output")?,
        groups: serde_json::from_value(get("groups")?.clone())
            .map_err(|e| format!("{name} step's `groups`: {e}"))?,
    })
}

fn fields<'v>(name: &str, body: &'v Value) -> Result<&'v Map<String, Value>, String> {
    match body {
        Value::Object(m) => Ok(m),
        _ => Err(format!("a {name} step is not an object")),
    }
}

/// Parameter `f` (of kind `k`) of collective step `name`.
fn param(name: &str, body: &Value, f: &str, k: ParamKind) -> Result<Param, String> {
    let v = fields(name, body)?
        .get(f)
        .ok_or_else(|| format!("missing field `{f}` in a {name} step"))?;
    let bad = || format!("{name} step's `{f}` is not {}", what(k));
    Ok(match k {
        ParamKind::Max => Param::Flag(v.as_bool().ok_or_else(bad)?),
        ParamKind::Dim | ParamKind::Member => Param::Index(
            v.as_u64()
                .and_then(|i| usize::try_from(i).ok())
                .ok_or_else(bad)?,
        ),
    })
}

fn what(k: ParamKind) -> &'static str {
    match k {
        ParamKind::Max => "a boolean",
        ParamKind::Dim | ParamKind::Member => "an index",
    }
}
