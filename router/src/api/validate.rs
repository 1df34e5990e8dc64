//! Validation shared by the OpenAI and TGI routes: numeric ranges, stop lists, prompt token
//! ids, chat roles and the context-length check. Each check names the field and the numbers
//! involved, and none of them needs a worker. The bounds are `tandem_proto::limits`, the
//! ones the workers' engines hold: whatever a worker would refuse, the router refuses first,
//! with a message that names the field (a worker's refusal reaches the client only as "a
//! worker rejected this request").

use serde::Deserialize;
use serde_json::Value;
use tandem_proto::limits::{
    MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE, MAX_OPENAI_PENALTY, MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE, MAX_TOP_LOGPROBS,
};
use tandem_proto::v1::{LogitBias, SamplingParams};

use crate::error::ApiError;
use crate::model::ServedModel;

/// The chat roles a conversation may use.
pub const CHAT_ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// `max_tokens` (or its TGI/chat alias `param`): at least 1, at most `u32::MAX`; the
/// context-length check bounds it further.
pub fn max_tokens(value: Option<i64>, param: &str) -> Result<Option<u32>, ApiError> {
    match value {
        None => Ok(None),
        Some(n) if n < 1 => Err(ApiError::invalid(
            param,
            format!("`{param}` must be at least 1, got {n}"),
        )),
        Some(n) => u32::try_from(n)
            .map(Some)
            .map_err(|_| ApiError::invalid(param, format!("`{param}` is far too large: {n}"))),
    }
}

/// `temperature`: in [0, MAX_TEMPERATURE] (0 is greedy).
pub fn temperature(value: Option<f64>, default: f64) -> Result<f32, ApiError> {
    let t = value.unwrap_or(default);
    if !(t.is_finite() && (0.0..=f64::from(MAX_TEMPERATURE)).contains(&t)) {
        return Err(ApiError::invalid(
            "temperature",
            format!("`temperature` must be in [0, {MAX_TEMPERATURE}], got {t}"),
        ));
    }
    Ok(t as f32)
}

/// `top_p`: in (0, 1].
pub fn top_p(value: Option<f64>) -> Result<f32, ApiError> {
    let p = value.unwrap_or(1.0);
    if !(p > 0.0 && p <= 1.0) {
        return Err(ApiError::invalid(
            "top_p",
            format!("`top_p` must be in (0, 1], got {p}"),
        ));
    }
    Ok(p as f32)
}

/// `top_k`: vLLM's convention, where -1 and 0 disable it.
pub fn top_k(value: Option<i64>) -> Result<u32, ApiError> {
    match value {
        None | Some(-1) | Some(0) => Ok(0),
        Some(k) if k > 0 => u32::try_from(k)
            .map_err(|_| ApiError::invalid("top_k", format!("`top_k` is far too large: {k}"))),
        Some(k) => Err(ApiError::invalid(
            "top_k",
            format!("`top_k` must be -1 (disabled) or at least 1, got {k}"),
        )),
    }
}

/// `repetition_penalty`: in (0, MAX_REPETITION_PENALTY], 1 disables.
pub fn repetition_penalty(value: Option<f64>) -> Result<f32, ApiError> {
    let r = value.unwrap_or(1.0);
    if !(r.is_finite() && r > 0.0 && r <= f64::from(MAX_REPETITION_PENALTY)) {
        return Err(ApiError::invalid(
            "repetition_penalty",
            format!("`repetition_penalty` must be in (0, {MAX_REPETITION_PENALTY}], got {r}"),
        ));
    }
    Ok(r as f32)
}

/// `n` or `best_of`: choices per request, 1 when absent.
pub fn choices(value: Option<i64>, param: &str) -> Result<u32, ApiError> {
    let max = tandem_proto::limits::MAX_CHOICES;
    match value {
        None => Ok(1),
        Some(n) if (1..=max as i64).contains(&n) => Ok(n as u32),
        Some(n) => Err(ApiError::invalid(
            param,
            format!("`{param}` must be in [1, {max}], got {n}"),
        )),
    }
}

/// `n` and `best_of` together: how many choices to generate (`best_of`, at least `n`) and to
/// return (`n`, the best by mean token logprob). `best_of` above `n` needs the whole answer
/// before ranking, so it cannot stream (as OpenAI and vLLM say).
pub fn n_and_best_of(
    n: Option<i64>,
    best_of: Option<i64>,
    stream: bool,
) -> Result<(u32, u32), ApiError> {
    let n = choices(n, "n")?;
    let best_of = match best_of {
        None => n,
        Some(_) => choices(best_of, "best_of")?,
    };
    if best_of < n {
        return Err(ApiError::invalid(
            "best_of",
            format!("`best_of` ({best_of}) must be at least `n` ({n})"),
        ));
    }
    if best_of > n && stream {
        return Err(ApiError::invalid(
            "best_of",
            "`best_of` above `n` cannot be used with `stream`",
        ));
    }
    Ok((n, best_of))
}

/// A stop field given as one string or a list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

/// The stop strings: at most `MAX_STOP_STRINGS`, none empty or over-long.
pub fn stop_strings(value: Option<StopField>) -> Result<Vec<String>, ApiError> {
    let list = match value {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s],
        Some(StopField::Many(v)) => v,
    };
    if list.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "at most {MAX_STOP_STRINGS} stop strings are allowed, got {}",
                list.len()
            ),
        ));
    }
    if list.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "stop strings must not be empty"));
    }
    // Bytes, not characters: a worker bounds its stop-string scan by UTF-8 bytes.
    if let Some(long) = list.iter().find(|s| s.len() > MAX_STOP_STRING_BYTES) {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "stop strings must be at most {MAX_STOP_STRING_BYTES} bytes of UTF-8, one has {}",
                long.len()
            ),
        ));
    }
    Ok(list)
}

/// `stop_token_ids`: at most MAX_STOP_TOKEN_IDS, each inside the vocabulary.
pub fn stop_token_ids(ids: Option<Vec<u32>>, model: &ServedModel) -> Result<Vec<u32>, ApiError> {
    let ids = ids.unwrap_or_default();
    if ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(ApiError::invalid(
            "stop_token_ids",
            format!(
                "at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed, got {}",
                ids.len()
            ),
        ));
    }
    if model.vocab_size > 0
        && let Some(bad) = ids.iter().find(|&&id| id >= model.vocab_size)
    {
        return Err(ApiError::invalid(
            "stop_token_ids",
            format!(
                "stop token id {bad} is out of range: the vocabulary has {} tokens",
                model.vocab_size
            ),
        ));
    }
    Ok(ids)
}

/// A chat message's `role`: one of [`CHAT_ROLES`].
pub fn chat_role(role: &str, i: usize) -> Result<(), ApiError> {
    let param = format!("messages[{i}].role");
    if role.is_empty() {
        return Err(ApiError::invalid(param, "a message role must not be empty"));
    }
    if !CHAT_ROLES.contains(&role) {
        return Err(ApiError::invalid(
            param,
            format!(
                "unknown role `{}`: use one of {}",
                role.chars().take(32).collect::<String>(),
                CHAT_ROLES.join(", ")
            ),
        ));
    }
    Ok(())
}

/// Rejects a feature the router does not implement, naming it, instead of ignoring it.
pub fn unsupported(param: &str, what: &str) -> ApiError {
    ApiError::invalid(param, format!("`{param}` is not supported: {what}"))
}

/// Token ids given directly must exist in the vocabulary.
pub fn prompt_ids(ids: &[u32], model: &ServedModel, param: &str) -> Result<(), ApiError> {
    if model.vocab_size > 0
        && let Some(bad) = ids.iter().find(|&&id| id >= model.vocab_size)
    {
        return Err(ApiError::invalid(
            param,
            format!(
                "token id {bad} is out of range: the vocabulary has {} tokens",
                model.vocab_size
            ),
        ));
    }
    Ok(())
}

/// What a route calls the prompt and the completion budget, for the errors that name them.
#[derive(Debug, Clone, Copy)]
pub struct Fields<'a> {
    pub prompt: &'a str,
    pub max_tokens: &'a str,
}

/// The completion budget: `requested` if it fits, else a 400 naming both numbers;
/// `default` (clamped to what is left) when nothing was requested. Exactly filling the
/// context is accepted.
pub fn completion_budget(
    prompt_tokens: usize,
    requested: Option<u32>,
    default: Option<u32>,
    model: &ServedModel,
    fields: Fields<'_>,
) -> Result<u32, ApiError> {
    let param = fields.max_tokens;
    if prompt_tokens == 0 {
        return Err(ApiError::invalid(
            fields.prompt,
            format!("`{}` must not be empty", fields.prompt),
        ));
    }
    let context = model.context_length as usize;
    if context == 0 {
        // The worker did not say; let it judge.
        return Ok(requested.or(default).unwrap_or(16));
    }
    if prompt_tokens >= context {
        return Err(ApiError::invalid(
            fields.prompt,
            format!(
                "This model's maximum context length is {context} tokens, and `{}` has \
                 {prompt_tokens} tokens: no room is left to generate. Shorten it.",
                fields.prompt
            ),
        ));
    }
    let room = context - prompt_tokens;
    match requested {
        Some(n) if n as usize > room => Err(ApiError::invalid(
            param,
            format!(
                "This model's maximum context length is {context} tokens. However, you \
                 requested {} tokens ({prompt_tokens} in the prompt, {n} for the completion). \
                 Reduce the prompt or `{param}`.",
                prompt_tokens + n as usize
            ),
        )),
        Some(n) => Ok(n),
        None => {
            let room = u32::try_from(room).unwrap_or(u32::MAX);
            Ok(default.map_or(room, |d| d.min(room)))
        }
    }
}

/// Sampling parameters for the workers (the OpenAI-only ones at their neutral values).
pub fn sampling(
    temperature: f32,
    top_p: f32,
    top_k: u32,
    seed: Option<u64>,
    repetition_penalty: f32,
) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        seed,
        repetition_penalty,
        ..SamplingParams::default()
    }
}

/// `presence_penalty` / `frequency_penalty`: in [-2, 2] (0 when absent).
pub fn openai_penalty(value: Option<f64>, param: &str) -> Result<f32, ApiError> {
    let v = value.unwrap_or(0.0);
    let max = f64::from(MAX_OPENAI_PENALTY);
    if !(v.is_finite() && (-max..=max).contains(&v)) {
        return Err(ApiError::invalid(
            param,
            format!("`{param}` must be in [-{max}, {max}], got {v}"),
        ));
    }
    Ok(v as f32)
}

/// `logit_bias`: token ids (as JSON object keys) to biases in [-100, 100], at most
/// `MAX_LOGIT_BIAS` of them, each id inside the vocabulary.
pub fn logit_bias(
    map: Option<serde_json::Map<String, Value>>,
    model: &ServedModel,
) -> Result<Vec<LogitBias>, ApiError> {
    let map = map.unwrap_or_default();
    if map.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            "logit_bias",
            format!(
                "`logit_bias` may hold at most {MAX_LOGIT_BIAS} tokens, got {}",
                map.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(map.len());
    for (key, value) in map {
        let Ok(id) = key.parse::<u32>() else {
            return Err(ApiError::invalid(
                "logit_bias",
                "`logit_bias` keys must be token ids (non-negative integers as strings)",
            ));
        };
        if model.vocab_size > 0 && id >= model.vocab_size {
            return Err(ApiError::invalid(
                "logit_bias",
                format!(
                    "token id {id} is out of range: the vocabulary has {} tokens",
                    model.vocab_size
                ),
            ));
        }
        let max = f64::from(MAX_LOGIT_BIAS_VALUE);
        match value.as_f64() {
            Some(bias) if (-max..=max).contains(&bias) => out.push(LogitBias {
                id,
                bias: bias as f32,
            }),
            _ => {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("the bias of token {id} must be a number in [-{max}, {max}]"),
                ));
            }
        }
    }
    Ok(out)
}

/// How many alternatives to report per token (`top_logprobs`, or completions' `logprobs`):
/// 0 to `MAX_TOP_LOGPROBS`.
pub fn top_logprobs(value: Option<i64>, param: &str) -> Result<u32, ApiError> {
    match value {
        None => Ok(0),
        Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Ok(n as u32),
        Some(n) => Err(ApiError::invalid(
            param,
            format!("`{param}` must be in [0, {MAX_TOP_LOGPROBS}], got {n}"),
        )),
    }
}

/// `min_tokens`: at least 0 and at most the completion budget.
pub fn min_tokens(value: Option<i64>, budget: u32, budget_param: &str) -> Result<u32, ApiError> {
    match value {
        None => Ok(0),
        Some(n) if n < 0 => Err(ApiError::invalid(
            "min_tokens",
            format!("`min_tokens` must be at least 0, got {n}"),
        )),
        Some(n) if n > i64::from(budget) => Err(ApiError::invalid(
            "min_tokens",
            format!("`min_tokens` ({n}) is more than `{budget_param}` ({budget})"),
        )),
        Some(n) => Ok(n as u32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_text::TextTokenizer;

    fn model(context: u32) -> ServedModel {
        ServedModel::new("m", context, TextTokenizer::byte_level(), None)
    }

    fn message(e: ApiError) -> String {
        e.to_string()
    }

    #[test]
    fn max_tokens_range() {
        assert_eq!(max_tokens(None, "max_tokens").unwrap(), None);
        assert_eq!(max_tokens(Some(1), "max_tokens").unwrap(), Some(1));
        assert!(message(max_tokens(Some(0), "max_tokens").unwrap_err()).contains("at least 1"));
        assert!(max_tokens(Some(-5), "max_tokens").is_err());
        assert!(max_tokens(Some(1 << 40), "max_tokens").is_err());
    }

    #[test]
    fn sampling_ranges() {
        assert_eq!(temperature(None, 1.0).unwrap(), 1.0);
        assert_eq!(temperature(Some(0.0), 1.0).unwrap(), 0.0);
        assert!(temperature(Some(-0.1), 1.0).is_err());
        assert!(temperature(Some(f64::NAN), 1.0).is_err());
        assert_eq!(temperature(Some(100.0), 1.0).unwrap(), 100.0);
        let e = message(temperature(Some(150.0), 1.0).unwrap_err());
        assert!(e.contains("temperature") && e.contains("150"), "{e}");
        assert!(repetition_penalty(Some(10.0)).is_ok());
        assert!(repetition_penalty(Some(50.0)).is_err());
        assert!(top_p(Some(0.0)).is_err());
        assert!(top_p(Some(1.5)).is_err());
        assert_eq!(top_p(Some(1.0)).unwrap(), 1.0);
        assert_eq!(top_k(Some(-1)).unwrap(), 0);
        assert_eq!(top_k(Some(40)).unwrap(), 40);
        assert!(top_k(Some(-2)).is_err());
        assert!(repetition_penalty(Some(0.0)).is_err());
        assert_eq!(choices(None, "n").unwrap(), 1);
        assert_eq!(choices(Some(16), "n").unwrap(), 16);
        assert!(choices(Some(17), "n").is_err());
        assert!(choices(Some(0), "n").is_err());
        assert_eq!(n_and_best_of(Some(2), None, true).unwrap(), (2, 2));
        assert_eq!(n_and_best_of(Some(2), Some(5), false).unwrap(), (2, 5));
        assert_eq!(n_and_best_of(None, Some(3), false).unwrap(), (1, 3));
        assert!(n_and_best_of(Some(3), Some(2), false).is_err());
        assert!(n_and_best_of(Some(2), Some(3), true).is_err());
        assert!(n_and_best_of(Some(2), Some(2), true).is_ok());
    }

    #[test]
    fn stops() {
        assert_eq!(
            stop_strings(Some(StopField::One("x".into()))).unwrap(),
            ["x"]
        );
        assert!(stop_strings(Some(StopField::Many(vec![String::new()]))).is_err());
        assert!(stop_strings(Some(StopField::Many(vec!["a".into(); 17]))).is_err());
        // 128 two-byte characters fit; 129 are 258 bytes, over the worker's 256.
        assert!(stop_strings(Some(StopField::One("é".repeat(128)))).is_ok());
        let e = message(stop_strings(Some(StopField::One("é".repeat(129)))).unwrap_err());
        assert!(e.contains("256 bytes") && e.contains("258"), "{e}");
    }

    #[test]
    fn stop_token_ids_and_roles() {
        let m = model(100);
        assert_eq!(stop_token_ids(None, &m).unwrap(), Vec::<u32>::new());
        assert!(stop_token_ids(Some(vec![5]), &m).is_ok());
        let e = message(stop_token_ids(Some(vec![5, 100_000]), &m).unwrap_err());
        assert!(e.contains("100000") && e.contains("vocabulary"), "{e}");
        assert!(stop_token_ids(Some(vec![1; 65]), &m).is_err());
        assert!(stop_token_ids(Some(vec![1; 64]), &m).is_ok());
        for role in CHAT_ROLES {
            assert!(chat_role(role, 0).is_ok());
        }
        let e = chat_role("wizard", 3).unwrap_err();
        match e {
            ApiError::Invalid { param, message } => {
                assert_eq!(param.as_deref(), Some("messages[3].role"));
                assert!(message.contains("wizard"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        assert!(chat_role("", 0).is_err());
    }

    const MAX: Fields<'static> = Fields {
        prompt: "prompt",
        max_tokens: "max_tokens",
    };

    #[test]
    fn context_boundary_is_inclusive_and_names_both_numbers() {
        let m = model(100);
        assert_eq!(completion_budget(90, Some(10), None, &m, MAX).unwrap(), 10);
        let e = message(completion_budget(90, Some(11), None, &m, MAX).unwrap_err());
        assert!(
            e.contains("100") && e.contains("90") && e.contains("11") && e.contains("101"),
            "{e}"
        );
        assert!(completion_budget(100, None, None, &m, MAX).is_err());
        assert!(completion_budget(0, Some(1), None, &m, MAX).is_err());
        // Defaults are clamped to the room left.
        assert_eq!(completion_budget(95, None, Some(16), &m, MAX).unwrap(), 5);
        assert_eq!(completion_budget(10, None, None, &m, MAX).unwrap(), 90);
    }

    #[test]
    fn ids_in_vocabulary() {
        let m = model(100);
        assert!(prompt_ids(&[3, 4], &m, "prompt").is_ok());
        assert!(prompt_ids(&[3, 1_000_000], &m, "prompt").is_err());
    }
}

/// Fields of OpenAI's and vLLM's APIs whose features tandem lacks. Typed as raw JSON, so any
/// value parses and [`refuse_unimplemented`] names the field; one that asks for the default
/// behaviour passes.
#[derive(Debug, Default, Deserialize)]
pub struct UnimplementedFields {
    pub guided_whitespace_pattern: Option<Value>,
    pub tool_choice: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
}

/// A 400 naming the first unimplemented field that asks for something.
pub fn refuse_unimplemented(f: &UnimplementedFields) -> Result<(), ApiError> {
    let given = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
    let is = |v: &Option<Value>, allowed: &[Value]| {
        v.as_ref()
            .is_none_or(|v| v.is_null() || allowed.contains(v))
    };
    if given(&f.guided_whitespace_pattern) {
        return Err(unsupported(
            "guided_whitespace_pattern",
            "JSON output is written with one space after `:` and `,`",
        ));
    }
    let no_tools = [Value::from("none"), Value::from("auto")];
    if !is(&f.tool_choice, &no_tools) {
        return Err(unsupported("tool_choice", "no tool calling"));
    }
    let asks_for_functions = given(&f.functions)
        && f.functions
            .as_ref()
            .and_then(Value::as_array)
            .is_none_or(|a| !a.is_empty());
    if asks_for_functions {
        return Err(unsupported("functions", "no function calling"));
    }
    if !is(&f.function_call, &no_tools) {
        return Err(unsupported("function_call", "no function calling"));
    }
    Ok(())
}
