//! The handles a [`Graph`](super::Graph) is made of besides its values
//! ([`ValueId`](crate::types::ValueId)): [`Op`], a node's op with what the dialects know
//! of it.

use crate::dnn;
use crate::nns::CollectiveSpec;
use crate::spec::OpSpec;

/// The op of a graph node: its full name (`dnn.matmul`) and what the dialects know of it
/// (the `dnn` op's [`OpSpec`], the `nns` collective's [`CollectiveSpec`]), looked up once
/// when the node is made instead of by name wherever it is needed. Compares with, prints
/// as and dereferences to its name.
#[derive(Clone)]
pub struct Op {
    name: std::sync::Arc<str>,
    spec: Option<&'static OpSpec>,
    collective: Option<&'static CollectiveSpec>,
}

impl Op {
    /// The op named `name` (any dialect's: ops nnscaler does not know have no spec).
    pub fn new(name: &str) -> Op {
        Op {
            name: name.into(),
            spec: dnn::spec(name),
            collective: crate::nns::collective(name),
        }
    }

    /// Its full name.
    pub fn as_str(&self) -> &str {
        &self.name
    }

    /// The spec of a `dnn` op (or another op the dialects specify), if it is one.
    pub fn spec(&self) -> Option<&'static OpSpec> {
        self.spec
    }

    /// The table entry of an `nns` collective or data-movement op, if it is one.
    pub fn collective(&self) -> Option<&'static CollectiveSpec> {
        self.collective
    }
}

impl Default for Op {
    fn default() -> Op {
        Op::new("")
    }
}

impl std::ops::Deref for Op {
    type Target = str;
    fn deref(&self) -> &str {
        &self.name
    }
}

impl AsRef<str> for Op {
    fn as_ref(&self) -> &str {
        &self.name
    }
}

impl std::borrow::Borrow<str> for Op {
    fn borrow(&self) -> &str {
        &self.name
    }
}

impl PartialEq for Op {
    fn eq(&self, other: &Op) -> bool {
        self.name == other.name
    }
}

impl Eq for Op {}

impl std::hash::Hash for Op {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.name.hash(h)
    }
}

impl PartialOrd for Op {
    fn partial_cmp(&self, other: &Op) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Op {
    fn cmp(&self, other: &Op) -> std::cmp::Ordering {
        self.name.cmp(&other.name)
    }
}

impl PartialEq<str> for Op {
    fn eq(&self, other: &str) -> bool {
        &*self.name == other
    }
}

impl PartialEq<&str> for Op {
    fn eq(&self, other: &&str) -> bool {
        &*self.name == *other
    }
}

impl PartialEq<String> for Op {
    fn eq(&self, other: &String) -> bool {
        *self.name == **other
    }
}

impl PartialEq<Op> for &str {
    fn eq(&self, other: &Op) -> bool {
        *self == &*other.name
    }
}

impl PartialEq<Op> for str {
    fn eq(&self, other: &Op) -> bool {
        self == &*other.name
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

/// As the name's: `"dnn.matmul"`.
impl std::fmt::Debug for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.name, f)
    }
}

impl From<&str> for Op {
    fn from(name: &str) -> Op {
        Op::new(name)
    }
}

impl From<String> for Op {
    fn from(name: String) -> Op {
        Op::new(&name)
    }
}

impl From<&String> for Op {
    fn from(name: &String) -> Op {
        Op::new(name)
    }
}
