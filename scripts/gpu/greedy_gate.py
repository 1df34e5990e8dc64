"""Greedy outputs of two routers side by side (run by on-device.sh on the GPU machine).

Usage: greedy_gate.py DISAGGREGATED_URL AGGREGATED_URL [N]

Sends N prompts (default 16) with temperature 0 to both routers, checks that the first ran
disaggregated and the second aggregated, and prints how many completions are identical token
for token. On a GPU the two paths may run the prompt with different SM shares (and so
different cuBLAS kernels), which can flip a near-tie in bf16; mismatches are printed with
the position of the first difference rather than hidden. Exits 1 if any request failed.
Standard library only (the GPU machine has no network).
"""

import json
import sys
import urllib.request


def complete(base, prompt):
    body = json.dumps(
        {"prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(
        base + "/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.load(r)
    return out["choices"][0]["text"], out["usage"]["tandem"]


def main():
    disagg, agg = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    same, failed = 0, 0
    for i in range(n):
        prompt = " ".join(f"w{(i * 31 + j * 7) % 97}" for j in range(20 + 37 * i))
        try:
            a, a_usage = complete(disagg, prompt)
            b, b_usage = complete(agg, prompt)
        except Exception as e:  # report and go on: one failure must not hide the rest
            print(f"prompt {i}: request failed: {e}")
            failed += 1
            continue
        modes = (a_usage["mode"], b_usage["mode"])
        if modes != ("disaggregated", "aggregated"):
            print(f"prompt {i}: modes {modes}, expected disaggregated then aggregated")
            failed += 1
            continue
        if a == b:
            same += 1
        else:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            print(f"prompt {i}: differs at character {at} (transport {a_usage['transport']})")
    print(f"greedy gate: {same}/{n} identical, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
