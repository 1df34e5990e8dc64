//! Structured output as the APIs ask for it, parsed into one grammar for the workers:
//! OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `guided_json`,
//! `guided_regex`, `guided_choice`, `guided_grammar` (llguidance's Lark syntax) and its newer
//! `structured_outputs` object, and TGI's `grammar` (`json`, `regex`). At most one may be
//! given. Shapes are checked here; whether the grammar compiles is checked after admission
//! ([`crate::model::ServedModel::check_guide`]), with the workers' own compiler.

use serde::Deserialize;
use serde_json::Value;
use tandem_proto::v1::{Choices, Guide, guide};
use tandem_text::GuideSpec;

use super::state::AppState;
use crate::error::ApiError;
use crate::model::ServedModel;
use std::sync::Arc;

/// A request's grammar and the field it came from (named in errors).
#[derive(Debug, Clone, PartialEq)]
pub struct Structured {
    pub spec: GuideSpec,
    pub param: &'static str,
}

impl Structured {
    /// The grammar as the workers receive it.
    pub fn to_proto(&self) -> Guide {
        let kind = match &self.spec {
            GuideSpec::JsonSchema(s) => guide::Kind::JsonSchema(s.clone()),
            GuideSpec::JsonObject => guide::Kind::JsonObject(true),
            GuideSpec::Regex(s) => guide::Kind::Regex(s.clone()),
            GuideSpec::Choice(c) => guide::Kind::Choice(Choices { choices: c.clone() }),
            GuideSpec::Lark(s) => guide::Kind::Lark(s.clone()),
        };
        Guide { kind: Some(kind) }
    }
}

/// Compiles an admitted request's grammar with the workers' compiler (on the tokenizing
/// pool): a grammar the workers would refuse is a 400 naming its field.
pub async fn check(
    state: &AppState,
    model: &Arc<ServedModel>,
    structured: Option<&Structured>,
) -> Result<(), ApiError> {
    let Some(s) = structured.cloned() else {
        return Ok(());
    };
    state
        .encode(model, move |m| m.check_guide(&s.spec, s.param))
        .await
}

/// The structured-output fields of an OpenAI (or vLLM) request. Typed as raw JSON, so any
/// value parses and [`OpenAiStructured::parse`] names the field at fault.
#[derive(Debug, Default, Deserialize)]
pub struct OpenAiStructured {
    pub response_format: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    pub structured_outputs: Option<Value>,
}

fn given(v: &Option<Value>) -> Option<&Value> {
    v.as_ref().filter(|v| !v.is_null())
}

/// A JSON schema given as an object, or as JSON text (vLLM accepts both).
fn schema(value: &Value, param: &'static str) -> Result<GuideSpec, ApiError> {
    match value {
        Value::Object(_) => Ok(GuideSpec::JsonSchema(value.to_string())),
        Value::Bool(true) => Ok(GuideSpec::JsonObject),
        Value::String(text) => match serde_json::from_str::<Value>(text) {
            Ok(v @ Value::Object(_)) => Ok(GuideSpec::JsonSchema(v.to_string())),
            _ => Err(ApiError::invalid(
                param,
                format!("`{param}` must be a JSON schema (an object, or its JSON text)"),
            )),
        },
        _ => Err(ApiError::invalid(
            param,
            format!("`{param}` must be a JSON schema object"),
        )),
    }
}

fn text(value: &Value, param: &'static str, what: &str) -> Result<String, ApiError> {
    match value {
        Value::String(s) if !s.is_empty() => Ok(s.clone()),
        _ => Err(ApiError::invalid(
            param,
            format!("`{param}` must be a non-empty string ({what})"),
        )),
    }
}

fn choices(value: &Value, param: &'static str) -> Result<GuideSpec, ApiError> {
    let strings = value.as_array().and_then(|items| {
        items
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<String>>>()
    });
    match strings {
        Some(c) if !c.is_empty() => Ok(GuideSpec::Choice(c)),
        _ => Err(ApiError::invalid(
            param,
            format!("`{param}` must be a non-empty list of strings"),
        )),
    }
}

fn response_format(value: &Value) -> Result<Option<GuideSpec>, ApiError> {
    const P: &str = "response_format";
    match value.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GuideSpec::JsonObject)),
        Some("json_schema") => {
            let inner = value.get("json_schema").ok_or_else(|| {
                ApiError::invalid(
                    P,
                    "`response_format.json_schema` is required for json_schema",
                )
            })?;
            // OpenAI nests the schema under `schema`; a bare schema is taken as well.
            let schema_value = inner.get("schema").unwrap_or(inner);
            schema(schema_value, P).map(Some)
        }
        Some(other) => Err(super::validate::unsupported(
            P,
            &format!("type `{other}` (text, json_object and json_schema are)"),
        )),
        None => Err(ApiError::invalid(
            P,
            "`response_format` must be an object with a `type`",
        )),
    }
}

/// vLLM's `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object"}`.
fn structured_outputs(value: &Value) -> Result<Option<GuideSpec>, ApiError> {
    const P: &str = "structured_outputs";
    let Some(object) = value.as_object() else {
        return Err(ApiError::invalid(
            P,
            "`structured_outputs` must be an object",
        ));
    };
    let mut found = Vec::new();
    for (key, v) in object.iter().filter(|(_, v)| !v.is_null()) {
        let spec = match key.as_str() {
            "json" => schema(v, P)?,
            "regex" => GuideSpec::Regex(text(v, P, "a regular expression")?),
            "choice" => choices(v, P)?,
            "grammar" => GuideSpec::Lark(text(v, P, "a Lark grammar")?),
            "json_object" if v == &Value::Bool(true) => GuideSpec::JsonObject,
            "json_object" => continue,
            other => {
                return Err(super::validate::unsupported(
                    P,
                    &format!("`{other}` (json, regex, choice, grammar and json_object are)"),
                ));
            }
        };
        found.push(spec);
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(ApiError::invalid(P, "give one kind of structured output")),
    }
}

impl OpenAiStructured {
    /// The one grammar these fields ask for, if any.
    pub fn parse(&self) -> Result<Option<Structured>, ApiError> {
        let mut found: Vec<Structured> = Vec::new();
        let mut add = |spec: Option<GuideSpec>, param| {
            if let Some(spec) = spec {
                found.push(Structured { spec, param });
            }
        };
        if let Some(v) = given(&self.response_format) {
            add(response_format(v)?, "response_format");
        }
        if let Some(v) = given(&self.guided_json) {
            add(Some(schema(v, "guided_json")?), "guided_json");
        }
        if let Some(v) = given(&self.guided_regex) {
            let rx = text(v, "guided_regex", "a regular expression")?;
            add(Some(GuideSpec::Regex(rx)), "guided_regex");
        }
        if let Some(v) = given(&self.guided_choice) {
            add(Some(choices(v, "guided_choice")?), "guided_choice");
        }
        if let Some(v) = given(&self.guided_grammar) {
            let lark = text(v, "guided_grammar", "a grammar in llguidance's Lark syntax")?;
            add(Some(GuideSpec::Lark(lark)), "guided_grammar");
        }
        if let Some(v) = given(&self.structured_outputs) {
            add(structured_outputs(v)?, "structured_outputs");
        }
        if found.len() > 1 {
            let names: Vec<&str> = found.iter().map(|s| s.param).collect();
            return Err(ApiError::invalid(
                found[1].param,
                format!(
                    "give one kind of structured output, not {}",
                    names.join(" and ")
                ),
            ));
        }
        Ok(found.pop())
    }
}

/// TGI's `grammar`: `{"type": "json", "value": schema}` or `{"type": "regex", "value": rx}`.
pub fn tgi_grammar(value: Option<&Value>) -> Result<Option<Structured>, ApiError> {
    const P: &str = "grammar";
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let inner = value.get("value").unwrap_or(&Value::Null);
    let spec = match value.get("type").and_then(Value::as_str) {
        Some("json" | "json_schema") => schema(inner, P)?,
        Some("regex") => GuideSpec::Regex(text(inner, P, "a regular expression")?),
        _ => {
            return Err(ApiError::invalid(
                P,
                "`grammar` must be {\"type\": \"json\" | \"regex\", \"value\": ...}",
            ));
        }
    };
    Ok(Some(Structured { spec, param: P }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn openai(field: &str, value: Value) -> Result<Option<Structured>, ApiError> {
        let mut f = OpenAiStructured::default();
        let slot = match field {
            "response_format" => &mut f.response_format,
            "guided_json" => &mut f.guided_json,
            "guided_regex" => &mut f.guided_regex,
            "guided_choice" => &mut f.guided_choice,
            "guided_grammar" => &mut f.guided_grammar,
            _ => &mut f.structured_outputs,
        };
        *slot = Some(value);
        f.parse()
    }

    fn spec(r: Result<Option<Structured>, ApiError>) -> Option<GuideSpec> {
        r.unwrap().map(|s| s.spec)
    }

    #[test]
    fn every_field_maps_to_its_grammar() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let text = schema.to_string();
        assert_eq!(
            spec(openai("response_format", json!({"type": "text"}))),
            None
        );
        assert_eq!(
            spec(openai("response_format", json!({"type": "json_object"}))),
            Some(GuideSpec::JsonObject)
        );
        assert_eq!(
            spec(openai(
                "response_format",
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}})
            )),
            Some(GuideSpec::JsonSchema(text.clone()))
        );
        assert_eq!(
            spec(openai("guided_json", schema.clone())),
            Some(GuideSpec::JsonSchema(text.clone()))
        );
        assert_eq!(
            spec(openai("guided_json", Value::String(text.clone()))),
            Some(GuideSpec::JsonSchema(text.clone()))
        );
        assert_eq!(
            spec(openai("guided_regex", json!("a+"))),
            Some(GuideSpec::Regex("a+".into()))
        );
        assert_eq!(
            spec(openai("guided_choice", json!(["x", "y"]))),
            Some(GuideSpec::Choice(vec!["x".into(), "y".into()]))
        );
        assert_eq!(
            spec(openai("guided_grammar", json!("start: \"a\""))),
            Some(GuideSpec::Lark("start: \"a\"".into()))
        );
        assert_eq!(
            spec(openai("structured_outputs", json!({"choice": ["a"]}))),
            Some(GuideSpec::Choice(vec!["a".into()]))
        );
        assert_eq!(
            spec(tgi_grammar(Some(
                &json!({"type": "regex", "value": "[0-9]+"})
            ))),
            Some(GuideSpec::Regex("[0-9]+".into()))
        );
        assert_eq!(
            spec(tgi_grammar(Some(&json!({"type": "json", "value": schema})))),
            Some(GuideSpec::JsonSchema(text))
        );
        assert_eq!(spec(tgi_grammar(None)), None);
    }

    #[test]
    fn malformed_or_several_are_refused_naming_the_field() {
        let param = |r: Result<Option<Structured>, ApiError>| match r {
            Err(ApiError::Invalid { param, .. }) => param,
            other => panic!("{other:?}"),
        };
        for (field, value) in [
            ("response_format", json!({"type": "xml"})),
            ("response_format", json!({"type": "json_schema"})),
            ("response_format", json!("json")),
            ("guided_json", json!(3)),
            ("guided_json", json!("not json")),
            ("guided_regex", json!("")),
            ("guided_choice", json!([])),
            ("guided_choice", json!(["a", 1])),
            ("guided_grammar", json!(["start"])),
            ("structured_outputs", json!({"xml": "x"})),
            ("structured_outputs", json!({"regex": "a", "choice": ["b"]})),
        ] {
            assert_eq!(
                param(openai(field, value.clone())).as_deref(),
                Some(field),
                "{field}: {value}"
            );
        }
        let both = OpenAiStructured {
            response_format: Some(json!({"type": "json_object"})),
            guided_regex: Some(json!("a")),
            ..Default::default()
        };
        assert_eq!(param(both.parse()).as_deref(), Some("guided_regex"));
        assert!(tgi_grammar(Some(&json!({"type": "lark", "value": "x"}))).is_err());
    }
}
