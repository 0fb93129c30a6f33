"""The maskd command line: serve, conformance, demo, bench, cluster."""
from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import sys

SAMPLE_DIR = pathlib.Path(__file__).parent / "samples" / "maskbench"


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="run a maskd gRPC server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--tokenizer", default="deepseek-v4",
                   help="deepseek-v4, qwen2.5, qwen3.6, cl100k, hf:PATH, tiktoken:PATH or a HF model id")
    p.add_argument("--backend", default="llguidance", help="llguidance (default) or xgrammar")
    p.add_argument("--logits-width", type=int, default=None, help="model logits width if padded past the vocabulary")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="mask-fill threads")
    p.add_argument("--compile-threads", type=int, default=2)
    p.add_argument("--compile-timeout", type=float, default=30.0, help="seconds per grammar compile")
    p.add_argument("--cache-entries", type=int, default=1024)
    p.add_argument("--max-streams", type=int, default=256)
    p.add_argument("--max-message-bytes", type=int, default=64 << 20)
    p.add_argument("--max-grammar-bytes", type=int, default=1 << 20)
    p.add_argument("--row-dict-size", type=int, default=None,
                   help="rows each stream's row dictionary keeps for DICT_REF (0: off; default 256)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (off if unset)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key: serve TLS)")
    p.add_argument("--tls-key", default=None, help="PEM private key")
    p.add_argument("--auth-token-env", default="MASKD_AUTH_TOKEN",
                   help="environment variable holding the bearer token clients must send (unset: no auth)")
    p.set_defaults(func=cmd_serve)


def _server_config(args):
    from maskd.server import ServerConfig
    extra = {} if args.row_dict_size is None else {"row_dict_size": args.row_dict_size}
    if args.row_dict_size is not None and args.row_dict_size < 0:
        sys.exit("maskd: --row-dict-size must be >= 0")
    return ServerConfig(**extra, host=args.host, port=args.port, tokenizer=args.tokenizer, backend=args.backend,
                        logits_width=args.logits_width, threads=args.threads,
                        compile_threads=args.compile_threads, compile_timeout_s=args.compile_timeout,
                        cache_entries=args.cache_entries, max_streams=args.max_streams,
                        max_message_bytes=args.max_message_bytes, max_grammar_bytes=args.max_grammar_bytes,
                        metrics_port=args.metrics_port, tls_cert=args.tls_cert, tls_key=args.tls_key,
                        auth_token=os.environ.get(args.auth_token_env) or None)


def _start_server(config):
    """Starts a server or exits with a message a person can act on."""
    from maskd.engines import BACKENDS
    from maskd.server import MaskServer
    from maskd.tokenizers import TokenizerError

    if config.backend not in BACKENDS:
        sys.exit(f"maskd: unknown backend {config.backend!r}; available: {', '.join(BACKENDS)}")
    try:
        return MaskServer(config).start()
    except TokenizerError as exc:
        sys.exit(f"maskd: {exc}")
    except (OSError, RuntimeError, ValueError) as exc:
        sys.exit(f"maskd: cannot start the server: {exc}")


def cmd_serve(args) -> int:
    server = _start_server(_server_config(args))
    print(f"maskd serving on {server.address}" +
          (f", metrics on :{server.metrics_port}/metrics" if server.metrics_port else ""), flush=True)
    server.serve_forever()
    return 0


def _add_conformance(sub) -> None:
    p = sub.add_parser("conformance", help="MaskBench conformance through a maskd server")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="HOST:PORT of a maskd server (or of a cluster directory)")
    where.add_argument("--embedded", action="store_true", help="start a server on a free loopback port")
    where.add_argument("--in-process", action="store_true", help="llguidance in this process, no server")
    p.add_argument("--data", default=str(SAMPLE_DIR), help="folder of MaskBench files (default: built-in sample)")
    p.add_argument("--tokenizer", default="deepseek-v4")
    p.add_argument("--limit", type=int, default=None, help="first N files only")
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="embedded server's fill threads")
    p.add_argument("--json", dest="json_out", default=None, help="write the report here")
    p.set_defaults(func=cmd_conformance)


def cmd_conformance(args) -> int:
    from maskd import conformance

    try:
        suite = conformance.load_suite(args.data, args.limit)
    except (FileNotFoundError, ValueError) as exc:
        sys.exit(f"maskd conformance: {exc}")
    server = None
    if args.in_process:
        report = conformance.run_in_process(args.tokenizer, suite)
    else:
        target = args.target
        if args.embedded:
            from maskd.server import ServerConfig
            server = _start_server(ServerConfig(port=0, tokenizer=args.tokenizer, threads=args.threads))
            target = server.address
        elif _is_directory(target):
            target = f"directory:{target}"
        try:
            report = conformance.run_through_server(target, args.tokenizer, suite, batch=args.batch)
        finally:
            if server is not None:
                server.stop(grace=1.0)
    print(conformance.summary_line(report))
    for item in report["false_accepts"][:20]:
        print(f"  false accept: {item['file']} test {item['test']}")
    for item in report["false_rejects"][:20]:
        print(f"  false reject: {item['file']} test {item['test']}: {item['why'][:200]}")
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 1 if report["false_accepts"] or report["false_rejects"] else 0


def _is_directory(target: str) -> bool:
    """True when the target answers the cluster directory service rather than MaskService."""
    try:
        from maskd_cluster.directory_client import is_directory
    except ImportError:
        return False
    return is_directory(target)


def _add_optional(sub, module: str, name: str) -> None:
    """Subcommands whose modules carry extra dependencies register themselves lazily."""
    import importlib
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    mod.add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="maskd", description="distributed token-mask server")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_conformance(sub)
    _add_optional(sub, "maskd.demo", "demo")
    _add_optional(sub, "maskd.bench.cli", "bench")
    _add_optional(sub, "maskd_cluster.cli", "cluster")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
