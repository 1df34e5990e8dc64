//! Reading the JSON files of a model folder under the [`ModelLimits`] ceilings: every file is
//! read whole only up to [`Ceiling::JsonBytes`] (a link to `/dev/zero` or a file growing under
//! the reader included), and a `tokenizer.json`'s vocabulary and merge list are counted by a
//! pass that allocates nothing before the tokenizers library builds them.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use serde::Deserialize;
use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::TextError;
use crate::limits::{Ceiling, ModelLimits};

/// The bytes of the file at `path`, refused past the [`Ceiling::JsonBytes`] ceiling before
/// more than that is read.
pub(crate) fn read_file(path: &Path, limits: &ModelLimits) -> Result<Vec<u8>, TextError> {
    let io = |source| TextError::Io {
        path: path.to_owned(),
        source,
    };
    let limit = limits.get(Ceiling::JsonBytes);
    let file = File::open(path).map_err(io)?;
    let mut bytes = Vec::new();
    // One byte past the ceiling tells a file at the ceiling from one beyond it.
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io)?;
    limits.check(
        Ceiling::JsonBytes,
        bytes.len() as u64,
        format_args!("{}: bytes", path.display()),
    )?;
    Ok(bytes)
}

/// [`read_file`] as UTF-8 text.
pub(crate) fn read_text(path: &Path, limits: &ModelLimits) -> Result<String, TextError> {
    String::from_utf8(read_file(path, limits)?).map_err(|e| TextError::Io {
        path: path.to_owned(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
    })
}

/// Checks a `tokenizer.json`'s vocabulary (entries, and the largest id + 1, which is what
/// tables indexed by id cost) and its merges against the ceilings, from a pass over the JSON
/// that keeps no value. Errors name `path`.
pub(crate) fn check_tokenizer_json(
    json: &[u8],
    path: &Path,
    limits: &ModelLimits,
) -> Result<(), TextError> {
    let shape: TokenizerShape = serde_json::from_slice(json)
        .map_err(|e| TextError::Tokenizer(format!("{}: {e}", path.display())))?;
    let model = shape.model.unwrap_or_default();
    let vocab = model.vocab.unwrap_or_default();
    let added = shape.added_tokens.unwrap_or_default();
    let what = |part: &str| format!("{}: {part}", path.display());
    limits.check(
        Ceiling::Vocab,
        vocab.items.saturating_add(added.items),
        what("vocabulary entries"),
    )?;
    let ids = vocab
        .max_id
        .max(added.max_id)
        .map_or(0, |m| m.saturating_add(1));
    limits.check(Ceiling::Vocab, ids, what("token ids (the largest + 1)"))?;
    let merges = model.merges.unwrap_or_default();
    limits.check(Ceiling::Merges, merges.items, what("merges"))
}

/// The parts of a `tokenizer.json` that size its tables; every other key is skipped.
#[derive(Deserialize)]
struct TokenizerShape {
    #[serde(default)]
    model: Option<ModelShape>,
    #[serde(default)]
    added_tokens: Option<Counted>,
}

#[derive(Default, Deserialize)]
struct ModelShape {
    #[serde(default)]
    vocab: Option<Counted>,
    #[serde(default)]
    merges: Option<Counted>,
}

/// A JSON map or list, counted: its entries, and the largest id among them (a map's values
/// that are whole numbers, `{"piece": id}`; a list's objects' `id` fields, as
/// `added_tokens` has them; a list of other items, such as Unigram's `[piece, score]` pairs,
/// numbers its items by position).
#[derive(Default)]
struct Counted {
    items: u64,
    max_id: Option<u64>,
}

impl Counted {
    fn saw(&mut self, id: Option<u64>) {
        self.items += 1;
        if let Some(id) = id {
            self.max_id = Some(self.max_id.map_or(id, |m| m.max(id)));
        }
    }
}

impl<'de> Deserialize<'de> for Counted {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(CountVisitor)
    }
}

struct CountVisitor;

impl<'de> Visitor<'de> for CountVisitor {
    type Value = Counted;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a map or a list")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Counted, A::Error> {
        let mut counted = Counted::default();
        while let Some((IgnoredAny, id)) = map.next_entry::<IgnoredAny, Id>()? {
            counted.saw(id.0);
        }
        Ok(counted)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Counted, A::Error> {
        let mut counted = Counted::default();
        while let Some(item) = seq.next_element::<Item>()? {
            let position = counted.items;
            counted.saw(Some(item.0.unwrap_or(position)));
        }
        Ok(counted)
    }

    // Anything else (`null`, a number) sizes nothing.
    fn visit_unit<E: de::Error>(self) -> Result<Counted, E> {
        Ok(Counted::default())
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Counted, E> {
        Ok(Counted::default())
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Counted, E> {
        Ok(Counted::default())
    }
}

/// A value that is an id when it is a whole number.
struct Id(Option<u64>);

impl<'de> Deserialize<'de> for Id {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(IdVisitor)
    }
}

struct IdVisitor;

impl<'de> Visitor<'de> for IdVisitor {
    type Value = Id;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any value")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Id, E> {
        Ok(Id(Some(v)))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Id, E> {
        Ok(Id(None))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Id, E> {
        Ok(Id(None))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Id, E> {
        Ok(Id(None))
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Id, E> {
        Ok(Id(None))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Id, E> {
        Ok(Id(None))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Id, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Id(None))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Id, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Id(None))
    }
}

/// A list item: an object's `id` field when it has a whole-number one.
struct Item(Option<u64>);

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ItemVisitor;
        impl<'de> Visitor<'de> for ItemVisitor {
            type Value = Item;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any value")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Item, A::Error> {
                let mut id = None;
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if key == "id" {
                        id = map.next_value::<Id>()?.0;
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(Item(id))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Item(None))
            }

            fn visit_str<E: de::Error>(self, _: &str) -> Result<Item, E> {
                Ok(Item(None))
            }

            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Item, E> {
                Ok(Item(None))
            }

            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Item, E> {
                Ok(Item(None))
            }

            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Item, E> {
                Ok(Item(None))
            }

            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Item, E> {
                Ok(Item(None))
            }

            fn visit_unit<E: de::Error>(self) -> Result<Item, E> {
                Ok(Item(None))
            }
        }
        d.deserialize_any(ItemVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(json: &str, limits: &ModelLimits) -> Result<(), String> {
        check_tokenizer_json(json.as_bytes(), Path::new("t.json"), limits)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn counts_vocabularies_ids_and_merges() {
        let limits = ModelLimits::default()
            .with(Ceiling::Vocab, 4)
            .with(Ceiling::Merges, 1);
        let ok = r#"{"added_tokens":[{"id":3,"content":"<s>"}],
            "model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2},"merges":["a b"]}}"#;
        assert_eq!(check(ok, &limits), Ok(()));
        let far = r#"{"model":{"vocab":{"a":0,"b":50000000}}}"#;
        let err = check(far, &limits).unwrap_err();
        assert!(
            err.contains("t.json: token ids (the largest + 1): 50000001 is above"),
            "{err}"
        );
        let many = r#"{"model":{"vocab":{"a":0,"b":1},"merges":["a b",["a","b"]]}}"#;
        let err = check(many, &limits).unwrap_err();
        assert!(
            err.contains("t.json: merges: 2 is above the ceiling of 1"),
            "{err}"
        );
        let unigram = r#"{"model":{"type":"Unigram","vocab":[["a",0.0],["b",0.0],["c",0.0],["d",0.0],["e",0.0]]}}"#;
        let err = check(unigram, &limits).unwrap_err();
        assert!(err.contains("vocabulary entries: 5"), "{err}");
        // Skipped values are skipped without recursion: deep nesting costs no stack here (the
        // tokenizers library's own parse then stops at serde_json's depth limit).
        let deep = format!(
            "{{\"model\":{}{}}}",
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert_eq!(check(&deep, &ModelLimits::default()), Ok(()));
    }

    #[test]
    fn reads_stop_at_the_ceiling() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.json");
        std::fs::write(&path, vec![b' '; 101]).unwrap();
        let limits = ModelLimits::default().with(Ceiling::JsonBytes, 100);
        let err = read_file(&path, &limits).unwrap_err().to_string();
        assert!(
            err.contains("big.json: bytes: 101 is above the ceiling of 100"),
            "{err}"
        );
        std::fs::write(&path, vec![b' '; 100]).unwrap();
        assert_eq!(read_file(&path, &limits).unwrap().len(), 100);
        let err = read_file(Path::new("/dev/zero"), &limits)
            .unwrap_err()
            .to_string();
        assert!(err.contains("above the ceiling"), "{err}");
    }
}
