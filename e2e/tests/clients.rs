//! Real clients against a real deployment: the `openai` Python package (streaming chat and
//! completions, usage, model list), TGI's own `text-generation` package (`Client(base_url)`:
//! `generate` and `generate_stream`), and curl on TGI's `/generate_stream` and `/generate`.

use std::process::Command;

use serde_json::Value;
use tandem_e2e::{Deployment, DeploymentSpec, run_python_client};

/// Runs a client `script` against a fresh deployment and parses the JSON line it prints.
async fn run_client(script: &'static str) -> Value {
    let dep = Deployment::start(&DeploymentSpec::default()).await.unwrap();
    run_python_client(script, dep.url("")).await
}

const OPENAI_SCRIPT: &str = r#"
import json, sys, openai
client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
models = [m.id for m in client.models.list()]
stream = client.chat.completions.create(
    model="tandem", messages=[{"role": "user", "content": "Say hello"}],
    max_tokens=12, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
chat, usage, finish = "", None, None
for chunk in stream:
    if chunk.choices:
        chat += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    if chunk.usage:
        usage = chunk.usage
completion = "".join(c.choices[0].text for c in client.completions.create(
    model="tandem", prompt="Once upon a time", max_tokens=8, stream=True, extra_body={"ignore_eos": True}) if c.choices)
whole = client.completions.create(model="tandem", prompt="Once upon a time", max_tokens=8, extra_body={"ignore_eos": True})
print(json.dumps({"models": models, "chat": chat, "finish": finish, "usage": usage.completion_tokens if usage else None,
                  "completion": completion, "whole": whole.choices[0].text, "whole_tokens": whole.usage.completion_tokens}))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_streams_chat_and_completions() {
    let v = run_client(OPENAI_SCRIPT).await;
    assert_eq!(v["models"], serde_json::json!(["tandem"]));
    assert_eq!(v["usage"], 12, "{v}");
    assert_eq!(v["finish"], "length");
    assert_eq!(v["whole_tokens"], 8);
    assert_eq!(
        v["completion"], v["whole"],
        "streamed and whole completions agree (greedy)"
    );
}

const TGI_SCRIPT: &str = r#"
import json, sys
from text_generation import Client
client = Client(sys.argv[1])
whole = client.generate("Once upon a time", max_new_tokens=8, top_n_tokens=2)
streamed, last = "", None
for event in client.generate_stream("Once upon a time", max_new_tokens=8):
    if not event.token.special:
        streamed += event.token.text
    last = event
print(json.dumps({"text": whole.generated_text, "finish": str(whole.details.finish_reason),
                  "generated": whole.details.generated_tokens, "tokens": len(whole.details.tokens),
                  "token_text": "".join(t.text for t in whole.details.tokens if not t.special),
                  "logprobs": [t.logprob for t in whole.details.tokens],
                  "greedy_is_top1": all(top[0].id == t.id and len(top) == 2
                                        for top, t in zip(whole.details.top_tokens, whole.details.tokens)),
                  "streamed": streamed, "stream_text": last.generated_text}))
"#;

/// TGI's own Python client, pointed at the router's root as at a TGI server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tgi_python_client_generates_and_streams() {
    let v = run_client(TGI_SCRIPT).await;
    assert!(
        v["finish"]
            .as_str()
            .unwrap()
            .to_lowercase()
            .contains("length"),
        "{v}"
    );
    assert_eq!(
        (&v["generated"], &v["tokens"]),
        (&8.into(), &8.into()),
        "{v}"
    );
    assert_eq!(v["token_text"], v["text"], "the tokens spell the text");
    assert!(
        v["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l.as_f64().is_some_and(|l| l <= 0.0))
    );
    assert_eq!(v["greedy_is_top1"], true, "top_n_tokens: {v}");
    assert_eq!(v["streamed"], v["text"], "greedy: streamed and whole agree");
    assert_eq!(v["stream_text"], v["text"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_drives_generate_stream() {
    let dep = Deployment::start(&DeploymentSpec::default()).await.unwrap();
    let body = r#"{"inputs": "hello", "parameters": {"max_new_tokens": 5, "details": true}}"#;
    let curl = |path: String| {
        let body = body.to_string();
        tokio::task::spawn_blocking(move || {
            Command::new("curl")
                .args([
                    "-sS",
                    "-N",
                    "--max-time",
                    "30",
                    "-X",
                    "POST",
                    "-H",
                    "Content-Type: application/json",
                    "-d",
                    &body,
                    &path,
                ])
                .output()
        })
    };
    let out = curl(dep.url("/generate_stream")).await.unwrap().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|l| serde_json::from_str(l.trim()).unwrap())
        .collect();
    assert_eq!(events.len(), 5, "{text}");
    for (i, e) in events.iter().enumerate() {
        assert!(
            e["token"]["id"].is_u64() && e["token"]["text"].is_string(),
            "{e}"
        );
        assert_eq!(e["token"]["special"], false);
        if i + 1 < events.len() {
            assert!(e["generated_text"].is_null());
        }
    }
    let last = events.last().unwrap();
    let joined: String = events
        .iter()
        .map(|e| e["token"]["text"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(last["generated_text"], joined.as_str());
    assert_eq!(last["details"]["generated_tokens"], 5);

    let out = curl(dep.url("/generate")).await.unwrap().unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["generated_text"],
        joined.as_str(),
        "non-streaming TGI answer matches"
    );
}

const OPENAI_SAMPLING_SCRIPT: &str = r#"
import json, math, sys, urllib.request, openai
base = sys.argv[1]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
msgs = [{"role": "user", "content": "Say hello"}]
ask = dict(model="tandem", messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
           extra_body={"ignore_eos": True})
whole = client.chat.completions.create(**ask)
content = whole.choices[0].logprobs.content
streamed = []
for chunk in client.chat.completions.create(stream=True, **ask):
    if chunk.choices and chunk.choices[0].logprobs:
        streamed += [[c.token, c.logprob] for c in chunk.choices[0].logprobs.content]
comp = client.completions.create(model="tandem", prompt="Once upon a time", max_tokens=6, temperature=0,
                                 logprobs=2, extra_body={"ignore_eos": True})
lp = comp.choices[0].logprobs
req = urllib.request.Request(base + "/tokenize", headers={"Content-Type": "application/json"},
                             data=json.dumps({"prompt": "x", "add_special_tokens": False}).encode())
x = json.load(urllib.request.urlopen(req))["tokens"][0]
def run(**kw):
    r = client.completions.create(model="tandem", prompt="Once upon a time", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True, **kw})
    return {"text": r.choices[0].text, "tokens": r.usage.completion_tokens, "finish": r.choices[0].finish_reason}
print(json.dumps({
    "chat_tokens": len(content), "chat_text": whole.choices[0].message.content,
    "chat_pieces": "".join(c.token for c in content),
    "greedy_is_top1": all(c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
                          for c in content),
    "ranked": all(len(c.top_logprobs) == 3 and all(a.logprob >= b.logprob
                  for a, b in zip(c.top_logprobs, c.top_logprobs[1:])) for c in content),
    "max_mass": max(sum(math.exp(t.logprob) for t in c.top_logprobs) for c in content),
    "streamed": streamed, "whole": [[c.token, c.logprob] for c in content],
    "comp_text": comp.choices[0].text, "comp_pieces": "".join(lp.tokens), "offsets": lp.text_offset,
    "comp_top_has_sampled": all(t in top and 2 <= len(top) <= 3 for t, top in zip(lp.tokens, lp.top_logprobs)),
    "comp_greedy_is_max": all(max(top.values()) == l for top, l in zip(lp.top_logprobs, lp.token_logprobs)),
    "forced": run(logit_bias={str(x): 100}),
    "stopped": run(logit_bias={str(x): 100}, stop_token_ids=[x]),
    "held": run(logit_bias={str(x): 100}, stop_token_ids=[x], min_tokens=3),
}))
"#;

/// The `openai` client's logprobs (chat and completions, streamed and whole), logit_bias and
/// min_tokens against a real deployment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_logprobs_bias_and_min_tokens() {
    let v = run_client(OPENAI_SAMPLING_SCRIPT).await;
    assert_eq!(v["chat_tokens"], 8, "{v}");
    assert_eq!(v["greedy_is_top1"], true, "{v}");
    assert_eq!(v["ranked"], true, "{v}");
    assert!(v["max_mass"].as_f64().unwrap() <= 1.0 + 1e-4, "{v}");
    assert_eq!(
        v["streamed"], v["whole"],
        "streamed logprobs equal the whole response's"
    );
    assert_eq!(v["comp_top_has_sampled"], true, "{v}");
    assert_eq!(v["comp_greedy_is_max"], true, "{v}");
    let offsets: Vec<u64> = serde_json::from_value(v["offsets"].clone()).unwrap();
    assert_eq!(offsets.len(), 6);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{v}");
    // +100 on "x" forces it; as a stop token it then ends generation at once, unless
    // min_tokens holds it back for 3 tokens.
    assert_eq!(v["forced"]["text"], "xxxxxx", "{v}");
    assert_eq!(v["stopped"]["tokens"], 1, "{v}");
    assert_eq!(v["stopped"]["finish"], "stop");
    let held = &v["held"];
    assert!(held["tokens"].as_u64().unwrap() >= 3, "{v}");
    assert!(!held["text"].as_str().unwrap().starts_with('x'), "{v}");
}

const STRUCTURED_SCRIPT: &str = r#"
import json, sys, jsonschema, openai
from text_generation import Client
from text_generation.types import Grammar, GrammarType
base = sys.argv[1]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tier", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tier": {"enum": ["gold", "silver"]}, "ok": {"type": "boolean"}}}
valid, finishes = 0, []
for i in range(20):
    r = client.chat.completions.create(
        model="tandem", messages=[{"role": "user", "content": f"Person number {i} as JSON"}],
        max_tokens=120, temperature=0.8, seed=i,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    valid += 1
    finishes.append(r.choices[0].finish_reason)
obj = client.chat.completions.create(model="tandem", messages=[{"role": "user", "content": "Any object"}],
                                     max_tokens=200, temperature=0, response_format={"type": "json_object"})
choice = client.completions.create(model="tandem", prompt="Pick a colour:", max_tokens=10, temperature=1.0, seed=3,
                                   extra_body={"guided_choice": ["red", "green", "blue"]})
regex = client.completions.create(model="tandem", prompt="A code:", max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": "[A-Z]{3}-[0-9]{4}"})
streamed = "".join(c.choices[0].text for c in client.completions.create(
    model="tandem", prompt="A code:", max_tokens=20, stream=True, temperature=0,
    extra_body={"guided_regex": "[A-Z]{3}-[0-9]{4}"}) if c.choices)
try:
    client.completions.create(model="tandem", prompt="x", max_tokens=5, extra_body={"guided_regex": "(unclosed"})
    refused = None
except openai.BadRequestError as e:
    refused = e.status_code
tgi = Client(base).generate("A code:", max_new_tokens=20,
                            grammar=Grammar(type=GrammarType.Regex, value="[a-z]{2}[0-9]{2}"))
print(json.dumps({"valid": valid, "finishes": finishes, "object": obj.choices[0].message.content,
                  "object_finish": obj.choices[0].finish_reason, "choice": choice.choices[0].text,
                  "regex": regex.choices[0].text, "streamed": streamed, "refused": refused,
                  "tgi": tgi.generated_text}))
"#;

/// Structured output through the official clients on a real (disaggregated) deployment: 20
/// json_schema answers validate (jsonschema), json_object parses, guided_choice picks a
/// choice, guided_regex matches (streamed too), TGI's grammar works, and a grammar that does
/// not compile is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_output_parses_and_validates_through_the_clients() {
    let v = run_client(STRUCTURED_SCRIPT).await;
    assert_eq!(v["valid"], 20, "{v}");
    assert!(
        v["finishes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|f| f == "stop"),
        "a complete grammar ends the answer: {v}"
    );
    if v["object_finish"] == "stop" {
        let object: Value = serde_json::from_str(v["object"].as_str().unwrap()).unwrap();
        assert!(object.is_object(), "{v}");
    } else {
        assert!(v["object"].as_str().unwrap().starts_with('{'), "{v}");
    }
    assert!(
        ["red", "green", "blue"].contains(&v["choice"].as_str().unwrap()),
        "{v}"
    );
    let code = |s: &str| {
        let b = s.as_bytes();
        b.len() == 8
            && b[..3].iter().all(u8::is_ascii_uppercase)
            && b[3] == b'-'
            && b[4..].iter().all(u8::is_ascii_digit)
    };
    assert!(code(v["regex"].as_str().unwrap()), "{v}");
    assert_eq!(v["streamed"], v["regex"], "greedy: streamed equals whole");
    assert_eq!(v["refused"], 400, "{v}");
    let tgi = v["tgi"].as_str().unwrap().as_bytes();
    assert!(
        tgi.len() == 4
            && tgi[..2].iter().all(u8::is_ascii_lowercase)
            && tgi[2..].iter().all(u8::is_ascii_digit),
        "{v}"
    );
}

const CHOICES_SCRIPT: &str = r#"
import json, sys, openai
from text_generation import Client
base = sys.argv[1]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
extra = {"ignore_eos": True}
greedy = client.chat.completions.with_raw_response.create(
    model="tandem", messages=[{"role": "user", "content": "Say hello"}], max_tokens=8, temperature=0, n=4,
    extra_body=extra)
mode = greedy.headers.get("x-tandem-mode")
greedy = greedy.parse()
def sampled(n, seed, temperature=8.0):
    r = client.completions.create(model="tandem", prompt="Once upon a time", max_tokens=10,
                                  temperature=temperature, seed=seed, n=n, extra_body=extra)
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)]
streamed = {}
for chunk in client.completions.create(model="tandem", prompt="Once upon a time", max_tokens=10, temperature=8.0,
                                       seed=5, n=3, stream=True, extra_body=extra):
    for c in chunk.choices:
        streamed[c.index] = streamed.get(c.index, "") + c.text
best = client.completions.create(model="tandem", prompt="Once upon a time", max_tokens=6, temperature=8.0, seed=1,
                                 n=2, best_of=4, logprobs=0, extra_body=extra)
tgi = Client(base).generate("Once upon a time", max_new_tokens=6, do_sample=True, temperature=8.0, best_of=3)
print(json.dumps({
    "mode": mode, "greedy": [c.message.content for c in greedy.choices],
    "greedy_index": [c.index for c in greedy.choices], "greedy_usage": greedy.usage.completion_tokens,
    "sampled": sampled(3, 5), "again": sampled(3, 5), "seed5": sampled(1, 5), "seed6": sampled(1, 6),
    "t1": sampled(4, 11, 1.0), "t1_again": sampled(4, 11, 1.0),
    "streamed": [streamed[i] for i in sorted(streamed)],
    "best": [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in best.choices],
    "best_index": [c.index for c in best.choices], "best_usage": best.usage.completion_tokens,
    "tgi_others": len(tgi.details.best_of_sequences),
}))
"#;

/// `n` and `best_of` through the official clients on a real deployment (the tiny model, whose
/// sharp logits need a high temperature to sample visibly): greedy choices are
/// identical, seeded ones reproduce (choice i is the single request with seed + i, streamed
/// or not), `best_of` returns the likeliest `n`, TGI's `best_of` its other sequences.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_and_best_of_through_the_clients() {
    let v = run_client(CHOICES_SCRIPT).await;
    assert_eq!(v["mode"], "disaggregated", "{v}");
    let greedy = v["greedy"].as_array().unwrap();
    assert_eq!(greedy.len(), 4, "{v}");
    assert!(greedy.iter().all(|g| g == &greedy[0]), "{v}");
    assert_eq!(v["greedy_index"], serde_json::json!([0, 1, 2, 3]));
    assert_eq!(v["greedy_usage"], 32, "{v}");
    assert_eq!(v["sampled"], v["again"], "seeded choices reproduce");
    assert_eq!(v["t1"], v["t1_again"], "at temperature 1 too");
    assert_eq!(v["t1"].as_array().unwrap().len(), 4);
    assert_eq!(
        v["sampled"][0], v["seed5"][0],
        "choice 0 is the seed's request"
    );
    assert_eq!(v["sampled"][1], v["seed6"][0], "choice 1 is seed + 1's");
    assert_ne!(v["sampled"][0], v["sampled"][1], "{v}");
    assert_eq!(
        v["streamed"], v["sampled"],
        "streamed choices equal the whole ones"
    );
    let best: Vec<f64> = serde_json::from_value(v["best"].clone()).unwrap();
    assert_eq!(best.len(), 2);
    assert!(best[0] >= best[1], "best first: {v}");
    assert_eq!(v["best_index"], serde_json::json!([0, 1]));
    assert_eq!(v["best_usage"], 24, "all four generated count: {v}");
    assert_eq!(v["tgi_others"], 2, "{v}");
}

const PROMPT_LOGPROBS_SCRIPT: &str = r#"
import json, sys, openai
from text_generation import Client
base = sys.argv[1]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
prompt = "Once upon a time"
first = client.completions.create(model="tandem", prompt=prompt, max_tokens=1, temperature=0, logprobs=0)
t0 = first.choices[0].logprobs.tokens[0]
echo = client.completions.create(model="tandem", prompt=prompt + t0, max_tokens=3, temperature=0, echo=True,
                                 logprobs=2, extra_body={"ignore_eos": True})
lp = echo.choices[0].logprobs
vllm = client.completions.create(model="tandem", prompt=prompt, max_tokens=1, temperature=0,
                                 extra_body={"prompt_logprobs": 3})
plp = vllm.choices[0].prompt_logprobs
tgi = Client(base).generate(prompt, max_new_tokens=2, decoder_input_details=True)
print(json.dumps({
    "t0_logprob": first.choices[0].logprobs.token_logprobs[0],
    "echo_text": echo.choices[0].text, "echo_tokens": "".join(lp.tokens), "echo_first": lp.token_logprobs[0],
    "echo_first_top": lp.top_logprobs[0], "echo_logprobs": lp.token_logprobs,
    "prompt_len": vllm.usage.prompt_tokens, "vllm_len": len(plp), "vllm_first": plp[0],
    "vllm_ranked": all(min(e["rank"] for e in entry.values()) == 1 and len(entry) >= 3 for entry in plp[1:]),
    "vllm_logprobs": [max(e["logprob"] for e in entry.values()) <= 0.0 for entry in plp[1:]],
    "tgi_prefill": [[t.text, t.logprob] for t in tgi.details.prefill],
}))
"#;

/// Prompt logprobs through the official clients on a real (disaggregated) deployment: the
/// echoed legacy object covers the prompt then the completion (the first prompt token
/// without a logprob); a prompt token's logprob is the one the sampler reported when that
/// token was generated; vLLM's `prompt_logprobs` and TGI's `decoder_input_details` agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_logprobs_through_the_clients() {
    let v = run_client(PROMPT_LOGPROBS_SCRIPT).await;
    assert_eq!(v["echo_tokens"], v["echo_text"], "{v}");
    assert!(
        v["echo_first"].is_null() && v["echo_first_top"].is_null(),
        "{v}"
    );
    let prompt_len = v["prompt_len"].as_u64().unwrap() as usize;
    let echo: Vec<Option<f64>> = serde_json::from_value(v["echo_logprobs"].clone()).unwrap();
    // The echoed prompt is this prompt plus t0: its last prompt token is t0.
    let t0 = echo[prompt_len].unwrap();
    let sampled = v["t0_logprob"].as_f64().unwrap();
    assert!((t0 - sampled).abs() < 1e-5, "{t0} vs {sampled}: {v}");
    assert_eq!(v["vllm_len"].as_u64().unwrap() as usize, prompt_len);
    assert!(v["vllm_first"].is_null());
    assert_eq!(v["vllm_ranked"], true, "{v}");
    let tgi = v["tgi_prefill"].as_array().unwrap();
    assert_eq!(tgi.len(), prompt_len, "{v}");
    assert!(tgi[0][1].is_null());
    for (i, entry) in tgi.iter().enumerate().skip(1) {
        let want = echo[i].unwrap();
        assert!((entry[1].as_f64().unwrap() - want).abs() < 1e-5, "{v}");
    }
}
