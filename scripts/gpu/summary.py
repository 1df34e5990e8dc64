"""The GPU run's one-line verdict: reads the JSON lines that the steps of run-steps.sh left in
their logs (gpu_bench, gpu_ipc_check, torch_bench.py, torch_static.py) and prints one JSON line
with the ratios the GPU issue's goals are written in, the raw figures beside them. A figure
whose step did not run (or did not get that far) is null. Usage: summary.py LOG_FOLDER"""
import json
import os
import sys


def json_lines(path):
    """Every JSON object printed on a line of its own in `path`, in order."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path, errors="replace") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{") and line.endswith("}"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return out


def merged(path):
    d = {}
    for obj in json_lines(path):
        d.update(obj)
    return d


def dig(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d


def ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def main():
    logs = sys.argv[1]
    bench = merged(os.path.join(logs, "bench.log"))
    ipc = merged(os.path.join(logs, "ipc.log"))
    eager = merged(os.path.join(logs, "torch.log"))
    static = merged(os.path.join(logs, "torchs.log"))
    l8 = bench.get("dummy Llama-3.1-8B", {})
    eager8 = eager.get("Llama-3.1-8B", {})
    prefill = dig(l8, "prefill", "t2048", "tok_s")
    b1 = dig(l8, "decode_ms", "c512_b1", "ms")
    b1_floor = dig(l8, "decode_ms", "c512_b1", "floor_ms")
    b128 = dig(l8, "decode_ms", "c512_b128", "ms")
    out = {
        "prefill_vs_matmul_peak": dig(l8, "prefill", "t2048", "vs_matmul_peak"),
        "prefill_vs_torch_eager": ratio(prefill, eager8.get("prefill_tok_s")),
        "prefill_vs_torch_sdpa_flash": ratio(prefill, static.get("prefill_sdpa_flash_t2048_tok_s")),
        "decode_b1_vs_read_floor": ratio(b1, b1_floor),
        "decode_b1_vs_torch_compiled": ratio(b1, static.get("decode_compiled_c512_b1_ms")),
        "decode_b128_step_ms": b128,
        "decode_b128_vs_torch_eager_throughput": ratio(eager8.get("decode_b128_ms"), b128),
        "decode_b128_vs_torch_compiled": ratio(b128, static.get("decode_compiled_c512_b128_ms")),
        "ipc_vs_local_copy": ratio(ipc.get("ipc_scattered_gb_s"), ipc.get("local_gb_s")),
        "raw": {
            "matmul_tflops": bench.get("bf16_matmul_tflops"),
            "read_gb_s": bench.get("read_bandwidth_gb_s"),
            "copy_gb_s": bench.get("copy_bandwidth_gb_s"),
            "prefill_2048_tok_s": prefill,
            "torch_eager_prefill_2048_tok_s": eager8.get("prefill_tok_s"),
            "torch_sdpa_flash_prefill_2048_tok_s": static.get("prefill_sdpa_flash_t2048_tok_s"),
            "decode_b1_ms": b1,
            "decode_b1_floor_ms": b1_floor,
            "torch_compiled_b1_ms": static.get("decode_compiled_c512_b1_ms"),
            "torch_eager_b128_ms": eager8.get("decode_b128_ms"),
            "torch_compiled_b128_ms": static.get("decode_compiled_c512_b128_ms"),
            "ipc_scattered_gb_s": ipc.get("ipc_scattered_gb_s"),
            "ipc_consecutive_gb_s": ipc.get("ipc_consecutive_gb_s"),
            "local_copy_gb_s": ipc.get("local_gb_s"),
        },
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
