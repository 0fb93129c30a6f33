"""``maskd bench {engines,serve,wire,profile,e2e,vllm,tools}``: registered by maskd.cli through add_parser(sub).

Heavy imports (matplotlib, torch, xgrammar) happen inside the modes, so this module imports
with the server extra alone and the subcommand is always listed.
"""
from __future__ import annotations

import argparse
import os
import sys

from maskd_tools.bench import common

MODES = ("engines", "serve", "burst", "wire", "profile", "e2e", "vllm", "tools")


def _common_args(p: argparse.ArgumentParser, mode: str) -> None:
    p.add_argument("--data", default=str(common.default_data_dir()),
                   help="folder of MaskBench files (default: ../shared/maskbench-dev next to the repository "
                        "when present, else the built-in sample)")
    p.add_argument("--tokenizer", default="deepseek-v4", help="tokenizer spec (as for maskd serve)")
    p.add_argument("--limit", type=int, default=None,
                   help="use N MaskBench files, evenly spaced over the sorted file names (default: all; "
                        "--quick picks a small N)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the JSON report here")
    p.add_argument("--out", default=os.path.join("out", f"bench-{mode}"),
                   help=f"output folder for {mode}.json, {mode}.md and the PNG plots (default: out/bench-{mode})")
    p.add_argument("--quick", action="store_true", help="a size that finishes in about a minute on 2 cores")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                   help="server mask-fill threads (= the in-process baseline's threads)")


def _server_args(p: argparse.ArgumentParser, default_server: str) -> None:
    p.add_argument("--target", default=None, help="HOST:PORT of a running maskd server (default: start one)")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="how long --target may take to answer its health check before the run gives up")
    p.add_argument("--server", choices=("embedded", "subprocess"), default=default_server,
                   help="how to start the server when --target is not given: in this process on a free "
                        "loopback port, or `maskd serve --port 0` in a child process")


def _pin_arg(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument("--pin", default=default, metavar="S+W",
                   help="run the server as a child process on S cores of its own and this process (the simulated "
                        "worker and the in-process baselines) on the next W, e.g. 1+1"
                        + (f" (default {default}; 'none' turns it off)" if default else ""))


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: engines, serve, wire, profile, e2e, vllm, tools",
                           description="maskd benchmarks; each mode writes JSON, a markdown table and PNG plots")
    modes = bench.add_subparsers(dest="bench_mode", required=True)

    p = modes.add_parser("engines", help="MaskBench TTFM / TBM: in-process llguidance vs xgrammar")
    _common_args(p, "engines")
    p.add_argument("--engines", default="llguidance,xgrammar",
                   help="comma-separated: llguidance, xgrammar, maskd-complete (maskd's llguidance engine in "
                        "complete JSON-schema mode, with its document checks)")
    p.add_argument("--xgrammar-timeout", type=float, default=None,
                   help="seconds per xgrammar compile before the schema is skipped (default 60; --quick 10)")
    p.add_argument("--xgrammar-threads", type=int, default=None,
                   help="xgrammar compile threads (default: --threads)")
    p.set_defaults(func=_run_mode("engines"))

    p = modes.add_parser("serve", help="a simulated GPU worker's decode loop through maskd")
    _common_args(p, "serve")
    _server_args(p, "embedded")
    p.add_argument("--batch-sizes", default="1,16,64,256", help="comma-separated batch sizes")
    p.add_argument("--forward-ms", type=float, default=20.0, help="simulated forward pass per decode step")
    p.add_argument("--steps", type=int, default=None,
                   help="measured decode steps per batch size and phase (default 200; --quick 20)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured steps first (default 3; --quick 2)")
    p.add_argument("--memory-sequences", type=int, default=None,
                   help="live sequences opened for the memory figure (default 1000; 0 skips it)")
    p.add_argument("--seed", type=int, default=0, help="shuffles the instance order")
    _pin_arg(p, None)
    p.set_defaults(func=_run_mode("serve"))

    p = modes.add_parser("burst", help="the worker's wait for rows while another session registers fresh "
                                       "schemas (a compile burst), beside the same loop in process")
    _common_args(p, "burst")
    _pin_arg(p, "1+1")
    p.add_argument("--batch", type=int, default=64, help="sequences decoded per step")
    p.add_argument("--forward-ms", type=float, default=20.0, help="simulated forward pass per decode step")
    p.add_argument("--decode-schemas", type=int, default=48, help="schemas whose instances the worker decodes")
    p.add_argument("--fresh", type=int, default=200, help="fresh schemas registered in the burst (the next ones)")
    p.add_argument("--concurrency", type=int, default=8, help="registers in flight at once during the burst")
    p.add_argument("--steps-before", type=int, default=100, help="measured decode steps before the burst")
    p.add_argument("--steps-after", type=int, default=50, help="decode steps after the burst ends")
    p.add_argument("--json-schema-mode", choices=("strict", "complete"), default="complete",
                   help="the server's JSON-schema mode (default complete, the server's default)")
    p.add_argument("--profile", type=float, default=0.0, metavar="SECONDS",
                   help="py-spy over the server for the burst's first SECONDS (0: no profile)")
    p.set_defaults(func=_run_mode("burst"))

    p = modes.add_parser("e2e", help="tokens/s of a simulated engine loop: unstructured, in-process llguidance "
                                     "(critical path, overlapped) and maskd")
    _common_args(p, "e2e")
    _pin_arg(p, "1+1")
    p.add_argument("--batch-sizes", default=None, help="comma-separated batch sizes (default 64,256)")
    p.add_argument("--forward-ms", default=None,
                   help="comma-separated simulated forward passes, ms (default 10,20,40; --quick 20)")
    p.add_argument("--steps", type=int, default=None,
                   help="measured decode steps per mode, batch size and forward pass (default 150; --quick 40)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured steps first (default 10; --quick 5)")
    p.add_argument("--modes", default="unstructured,inprocess-critical,inprocess-overlapped,maskd",
                   help="comma-separated modes to run (the ratios need unstructured); maskd-drafts: grammar drafts "
                        "with a stated verification-cost model; maskd-opportunistic: sample first, the server checks "
                        "(see maskd_tools.bench.e2e)")
    p.add_argument("--drafts", type=int, default=4, help="maskd-drafts: drafts asked per slot and step (default 4)")
    p.add_argument("--saturation-tokens", type=int, default=256,
                   help="maskd-drafts cost model: tokens per forward pass up to which a pass costs one decode step "
                        "(default 256)")
    p.add_argument("--off-grammar", type=float, default=0.05,
                   help="maskd-opportunistic: share of unmasked samples the grammar refuses (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="shuffles the instance order")
    p.set_defaults(func=_run_mode("e2e"))

    p = modes.add_parser("vllm", help="tokens/s, TTFT and ITL in a real vLLM CPU engine: unconstrained, vLLM's "
                                      "guidance and xgrammar backends, maskd (make vllm-setup first)")
    _common_args(p, "vllm")
    from maskd_tools.bench.vllm import add_arguments
    add_arguments(p)
    p.set_defaults(func=_run_mode("vllm"), threads=1)

    p = modes.add_parser("tools", help="time until the first row of a tool-calling request (10 / 50 / 200 tools): "
                                       "whole compiles in process, maskd cold, cached, all but one known")
    from maskd_tools.bench.tools import add_arguments as add_tools_arguments
    add_tools_arguments(p)
    p.set_defaults(func=_run_mode("tools"))

    p = modes.add_parser("wire", help="bytes per mask row: per encoding and as sent")
    _common_args(p, "wire")
    _server_args(p, "embedded")
    p.add_argument("--batch-sizes", default="64", help="comma-separated batch sizes (sequences per stream)")
    p.add_argument("--max-rows", type=int, default=None,
                   help="stop a batch size after this many rows (default: all instances; --quick 3000)")
    p.add_argument("--seed", type=int, default=0, help="shuffles the instance order")
    p.set_defaults(func=_run_mode("wire"))

    p = modes.add_parser("profile", help="py-spy over the server's step path at batch 256")
    _common_args(p, "profile")
    p.add_argument("--batch", type=int, default=256, help="sequences per step")
    p.add_argument("--duration", type=float, default=None, help="seconds of sampling (default 20; --quick 8)")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=25, help="entries to list")
    p.add_argument("--gil", action="store_true", help="only samples holding the GIL (py-spy --gil)")
    p.add_argument("--pipelined", action="store_true",
                   help="drive the server with step_async and a --forward-ms sleep instead of back-to-back steps")
    p.add_argument("--forward-ms", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run_mode("profile"))


def _run_mode(mode: str):
    def run(args) -> int:
        import importlib

        from maskd_tools import progress
        from maskd_tools.conformance import load_suite

        prog = f"maskd bench {mode}"
        module = importlib.import_module(f"maskd_tools.bench.{mode}")
        check_args = getattr(module, "check_args", None)
        if check_args is not None:
            check_args(args)   # garbage flags refused, named, before any data or tokenizer loads
        try:
            load_suite(args.data, args.limit)
        except (FileNotFoundError, ValueError) as exc:
            sys.exit(f"{prog}: {exc}")
        try:
            common.placement_from(args)
        except ValueError as exc:
            sys.exit(f"{prog}: {exc}")
        from maskd.server.tokenizers import TokenizerError, load_tokenizer
        try:
            load_tokenizer(args.tokenizer)   # cached for the run
        except TokenizerError as exc:
            sys.exit(f"{prog}: {exc}")
        if getattr(args, "target", None):
            from maskd_client import MaskClientError
            from maskd_client.health import SERVING, check
            try:
                status = check(args.target, connect_timeout_s=args.connect_timeout)
            except MaskClientError as exc:
                sys.exit(f"{prog}: {exc}")
            if status != SERVING:
                sys.exit(f"{prog}: {args.target} answers but is not serving (health {status})")
        report = module.run(args, log=progress.say)
        print(f"maskd bench {mode}: wrote {os.path.join(args.out, mode + '.json')}, {mode}.md and plots"
              + (f"; JSON also at {args.json_out}" if args.json_out else ""))
        return 1 if report.get("failed") else 0
    return run
