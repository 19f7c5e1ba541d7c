"""The gateway under a standard load tool: guidellm against ``python -m swarm.api`` on the local
3-server SmolLM2-135M swarm, at concurrency 1, 4 and 16 (issue #27, figure "Gateway load").

    make bench-gateway          # installs guidellm into its own venv first (see the Makefile)
    python -m benchmarks.gateway_load --guidellm PATH/TO/guidellm --concurrency 1 4 16

guidellm (vLLM project's load generator) sends its synthetic prompts (``--prompt-tokens`` each,
from its own seeded text source, tokenized with the model's tokenizer) to ``/v1/completions``,
streamed, with ``max_tokens`` = ``--output-tokens`` and ``ignore_eos``, as many at once as the
concurrency level, and reports output tokens/s, time to first token and inter-token latency. The
benchmark adds ``temperature: 0`` to its requests (guidellm's ``extras``), so that afterwards every
completed request can be sent again alone and must give exactly the same text (token-identical:
same greedy tokens, same count): concurrent sessions batched on the servers must not change
anyone's tokens. Writes benchmarks/results/gateway_load.json and the scenario guidellm ran beside
it (guidellm's own report, with every request's text, goes to test-artifacts/bench-gateway/).

guidellm is not a test dependency (it pins its own versions of shared libraries, and needs
torch); ``make bench-gateway`` puts it in a venv that sees this environment's packages
(``--system-site-packages``), so the project's own stay as they are.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from protocol.models import ensure_smollm2_checkpoint
from swarm.local import LocalSwarm

MODEL = "smollm2-135m"
SERVER_ARGS = ["--torch-threads", "1", "--log-level", "WARNING", "--update-period", "5"]
RESULTS = Path("benchmarks/results")


def scenario(
    target: str, tokenizer: str, levels: list[int], requests: int, prompt_tokens: int, output_tokens: int, report: Path
) -> dict[str, Any]:
    """guidellm's scenario file: one concurrent benchmark per level, ``requests`` requests each."""
    return {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": target,
                "model": MODEL,
                "request_format": "/v1/completions",
                "extras": {"body": {"temperature": 0}},
                "timeout": 600,
            },
            "profile": {"kind": "concurrent", "streams": levels[0]},
            "data": [{"kind": "synthetic_text", "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}],
            "tokenizer": {"kind": "hf_auto", "model": tokenizer},
            "constraints": [{"kind": "max_requests", "count": requests}],
            "outputs": [{"kind": "json", "path": str(report)}],
        },
        "benchmarks": [{"profile.streams": level} for level in levels],
    }


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def completed_requests(benchmark: dict[str, Any]) -> list[dict[str, Any]]:
    requests = benchmark.get("requests", {})
    return requests.get("successful", requests.get("completed", [])) if isinstance(requests, dict) else []


def stat(benchmark: dict[str, Any], name: str, field: str) -> float:
    """A figure of guidellm's report: ``metrics[name]['successful' or 'completed'][field]``."""
    metric = benchmark["metrics"][name]
    metric = metric.get("successful", metric.get("completed", metric))
    value = metric
    for key in field.split("."):
        value = value[key]
    return float(value)


def summarize(benchmark: dict[str, Any], level: int) -> dict[str, Any]:
    return {
        "concurrency": level,
        "requests": len(completed_requests(benchmark)),
        "output_tokens_per_s": stat(benchmark, "output_tokens_per_second", "mean"),
        "ttft_ms_p50": stat(benchmark, "time_to_first_token_ms", "percentiles.p50"),
        "ttft_ms_p95": stat(benchmark, "time_to_first_token_ms", "percentiles.p95"),
        "itl_ms_p50": stat(benchmark, "inter_token_latency_ms", "percentiles.p50"),
        "itl_ms_p95": stat(benchmark, "inter_token_latency_ms", "percentiles.p95"),
    }


def replay(url: str, request: dict[str, Any]) -> bool:
    """The same request alone, not streamed: the same text as under load?"""
    args = request["request_args"]
    body = dict((json.loads(args) if isinstance(args, str) else args)["body"])
    body.pop("stream", None), body.pop("stream_options", None)
    alone = post(f"{url}/completions", body)
    return alone["choices"][0]["text"] == request["output"] and (
        request.get("output_metrics", {}).get("text_tokens") in (None, alone["usage"]["completion_tokens"])
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guidellm", default=shutil.which("guidellm") or "guidellm", help="the guidellm executable")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--out", default=str(RESULTS / "gateway_load.json"))
    args = p.parse_args()
    if not Path(args.guidellm).exists() and not shutil.which(args.guidellm):
        raise SystemExit(f"guidellm not found ({args.guidellm}): run `make bench-gateway`, which installs it")
    RESULTS.mkdir(parents=True, exist_ok=True)
    logs = Path("test-artifacts/bench-gateway")  # guidellm's full report (every request's text) stays out of git
    logs.mkdir(parents=True, exist_ok=True)
    report_path = logs / "guidellm.json"
    scenario_path = Path(args.out).with_name("gateway_load_scenario.json")
    with LocalSwarm(MODEL, 3, server_args=SERVER_ARGS, log_dir=str(logs)) as swarm:
        url = swarm.start_api(0)
        spec = scenario(
            url.removesuffix("/v1"),
            str(ensure_smollm2_checkpoint()),
            args.concurrency,
            args.requests,
            args.prompt_tokens,
            args.output_tokens,
            report_path,
        )
        scenario_path.write_text(json.dumps(spec, indent=2))
        began = time.perf_counter()
        subprocess.run(
            [args.guidellm, "run", "--scenario", str(scenario_path), "--disable-console-interactive"], check=True
        )
        load_time = time.perf_counter() - began
        report = json.loads(report_path.read_text())
        rows, identical, replayed = [], 0, 0
        for benchmark, level in zip(report["benchmarks"], args.concurrency):
            rows.append(summarize(benchmark, level))
            for request in completed_requests(benchmark):
                replayed += 1
                identical += replay(url, request)
    result = {
        "model": MODEL,
        "servers": 3,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "levels": rows,
        "replayed": replayed,
        "identical_alone": identical,
        "load_seconds": round(load_time, 1),
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        f"{'concurrency':>11} {'requests':>8} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p95':>9} "
        f"{'ITL p50':>8} {'ITL p95':>8}"
    )
    for r in rows:
        print(
            f"{r['concurrency']:>11} {r['requests']:>8} {r['output_tokens_per_s']:>9.1f} {r['ttft_ms_p50']:>7.0f}ms "
            f"{r['ttft_ms_p95']:>7.0f}ms {r['itl_ms_p50']:>6.0f}ms {r['itl_ms_p95']:>6.0f}ms"
        )
    print(f"token-identical to the same request alone: {identical}/{replayed}")
    if identical != replayed:
        raise SystemExit("some requests under load differ from the same request alone")


if __name__ == "__main__":
    main()
