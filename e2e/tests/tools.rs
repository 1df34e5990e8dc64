//! Tool calling through the real `openai` client on a real (disaggregated) deployment of the
//! tiny model: `tool_choice` `required` and named, streamed and whole, over 200 requests
//! whose arguments all validate against their function's schema (`jsonschema`); the whole
//! loop (call, result fed back as a `tool` message, answer); `auto` replies that hold no
//! well-formed call come back as content, never an error; TGI's own client's chat with a
//! named tool, whole and streamed.

use tandem_e2e::{Deployment, DeploymentSpec, run_python_client};

const TOOLS_SCRIPT: &str = r#"
import json, sys, jsonschema, openai
from concurrent.futures import ThreadPoolExecutor
client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
weather = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
search = {"type": "object", "additionalProperties": False, "required": ["query"],
          "properties": {"query": {"type": "string", "maxLength": 16},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}}}
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": weather}},
         {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": search}}]
schemas = {"get_weather": weather, "search": search}
ask = [{"role": "user", "content": "What is the weather in Paris?"}]

def check(calls, named=None):
    assert calls, "no tool calls"
    for c in calls:
        assert c["id"].startswith("call_"), c
        assert c["type"] == "function", c
        assert named is None or c["function"]["name"] == named, c
        jsonschema.validate(json.loads(c["function"]["arguments"]), schemas[c["function"]["name"]])
    return len(calls)

def whole(i, choice, parallel):
    r = client.chat.completions.create(model="tandem", messages=ask, tools=tools, tool_choice=choice,
                                       parallel_tool_calls=parallel, max_tokens=400, temperature=1.0, seed=i)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", r
    assert m.content is None, m
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    n = check([c.model_dump() for c in m.tool_calls], named)
    assert parallel or n == 1, m
    return n

def streamed(i, choice, parallel):
    calls, finish = {}, None
    for chunk in client.chat.completions.create(model="tandem", messages=ask, tools=tools, tool_choice=choice,
                                                parallel_tool_calls=parallel, max_tokens=400, temperature=1.0,
                                                seed=i, stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        assert not d.content, d
        for t in d.tool_calls or []:
            c = calls.setdefault(t.index, {"id": None, "type": None, "function": {"name": "", "arguments": ""}})
            c["id"] = t.id or c["id"]
            c["type"] = t.type or c["type"]
            if t.function:
                c["function"]["name"] += t.function.name or ""
                c["function"]["arguments"] += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop", finish
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    return check([calls[k] for k in sorted(calls)], named)

jobs = []
for i in range(200):
    choice = ["required", {"type": "function", "function": {"name": "get_weather"}},
              {"type": "function", "function": {"name": "search"}}][i % 3]
    jobs.append((streamed if i % 2 else whole, i, choice, i % 4 != 3))
with ThreadPoolExecutor(8) as pool:
    counts = list(pool.map(lambda j: j[0](*j[1:]), jobs))

# The loop: the model is made to call, the result goes back, the model answers.
first = client.chat.completions.create(model="tandem", messages=ask, tools=tools, tool_choice="required",
                                       max_tokens=400, temperature=0)
call = first.choices[0].message.tool_calls[0]
loop = ask + [first.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
answer = client.chat.completions.create(model="tandem", messages=loop, tools=tools, max_tokens=24, temperature=0)
answer_streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
    model="tandem", messages=loop, tools=tools, max_tokens=24, temperature=0, stream=True) if c.choices)
# `auto` on a model that writes no well-formed call: content, whatever it writes.
autos = [client.chat.completions.create(model="tandem", messages=ask, tools=tools, max_tokens=48,
                                        temperature=1.0, seed=s).choices[0] for s in range(8)]
# TGI's own client: its chat sends `model: "tgi"` and a bare function name as tool_choice.
from text_generation import Client
from text_generation.types import Message, Tool
tgi = Client(sys.argv[1]).chat(messages=[Message(role="user", content="Weather in Paris?")],
                               tools=[Tool(**t) for t in tools], tool_choice="get_weather", max_tokens=400, seed=1)
tgi_calls = check(tgi.choices[0].message.tool_calls, "get_weather")
# ... and its streams: chunks in its shape (a role in every delta, one call object).
tgi_args = ""
for chunk in Client(sys.argv[1]).chat(messages=[Message(role="user", content="Weather in Paris?")],
                                      tools=[Tool(**t) for t in tools], tool_choice="get_weather",
                                      max_tokens=400, seed=2, stream=True):
    if chunk.choices and chunk.choices[0].delta.tool_calls:
        tgi_args += chunk.choices[0].delta.tool_calls.function.arguments
jsonschema.validate(json.loads(tgi_args), weather)
tgi_text = "".join(c.choices[0].delta.content or "" for c in Client(sys.argv[1]).chat(
    messages=[Message(role="user", content="Say hello")], max_tokens=8, seed=3, stream=True) if c.choices)
try:
    client.chat.completions.create(model="tandem", messages=ask, tools=tools,
                                   tool_choice={"type": "function", "function": {"name": "nope"}})
    refused = None
except openai.BadRequestError as e:
    refused = e.status_code
print(json.dumps({"requests": len(counts), "calls": sum(counts), "max_calls": max(counts),
                  "loop_call": call.function.name, "answer": answer.choices[0].message.content,
                  "answer_finish": answer.choices[0].finish_reason, "answer_streamed": answer_streamed,
                  "autos": [[a.finish_reason, a.message.content is not None] for a in autos],
                  "refused": refused, "tgi_calls": tgi_calls, "tgi_text": tgi_text}))
"#;

/// The goals' check: 200 forced calls (required and named, streamed and whole, parallel or
/// not) all validate; the tool loop runs unchanged through the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_client_tool_loop_with_forced_calls_that_always_validate() {
    let dep = Deployment::start(&DeploymentSpec::default()).await.unwrap();
    let v = run_python_client(TOOLS_SCRIPT, dep.url("")).await;
    assert_eq!(v["requests"], 200, "{v}");
    assert!(v["calls"].as_u64().unwrap() >= 200, "{v}");
    assert!(
        ["get_weather", "search"].contains(&v["loop_call"].as_str().unwrap()),
        "{v}"
    );
    assert!(v["answer"].is_string(), "{v}");
    assert_eq!(
        v["answer"], v["answer_streamed"],
        "greedy: streamed equals whole"
    );
    for auto in v["autos"].as_array().unwrap() {
        assert!(
            ["stop", "length", "tool_calls"].contains(&auto[0].as_str().unwrap()),
            "{v}"
        );
    }
    assert_eq!(v["refused"], 400, "{v}");
    assert_eq!(v["tgi_calls"], 1, "{v}");
    assert!(!v["tgi_text"].as_str().unwrap().is_empty(), "{v}");
}
