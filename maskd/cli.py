"""The ``maskd`` command: serve, health, cluster, and the development tools (bench, demo, ...).

This module is the top of the import graph: it dispatches to the server (``maskd.server``), the
cluster (``maskd_cluster``) and the development tools (``maskd_tools``, a distribution of their own
that the runtime wheel and the image do not ship), importing each only when its subcommand runs (or
registers). Where one cannot be imported, its subcommands stay listed and say what to install.
Every subcommand takes ``--log-level`` (and ``-v``); every help shows the defaults.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys

import maskd

log = logging.getLogger("maskd.cli")


@dataclasses.dataclass(frozen=True)
class _Provider:
    """Where optional subcommands come from: the import package, what it is, how to install it."""

    package: str
    what: str
    install: str


_TOOLS = _Provider("maskd_tools", "the maskd-tools package",
                   "pip install ./tools from a checkout of the maskd repository (make setup installs it into "
                   ".venv); the runtime package and the image do not ship maskd's development tools")
_CLUSTER = _Provider("maskd_cluster", "the cluster extra", "pip install 'maskd[cluster]'")
# Subcommands whose modules live elsewhere or carry extra dependencies register themselves:
# (module, the subcommands it adds, where it comes from).
_OPTIONAL = (("maskd_tools.conformance", ("conformance",), _TOOLS), ("maskd_tools.demo", ("demo",), _TOOLS),
             ("maskd_tools.tiny_model", ("tiny-model",), _TOOLS), ("maskd_tools.real_model", ("real-model",), _TOOLS),
             ("maskd_tools.bench.cli", ("bench",), _TOOLS), ("maskd_tools.soak", ("soak", "chaos"), _TOOLS),
             ("maskd_cluster.cli", ("cluster",), _CLUSTER))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """The default in every help line (unless the text already says it), and room for flag names."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS, False) or not action.option_strings:
            return text
        return super()._get_help_string(action) or text


def _add_serve(sub) -> None:
    from maskd.server.config import ServerConfig, add_flags

    p = sub.add_parser("serve", help="run a maskd gRPC server", formatter_class=HelpFormatter,
                       description="A maskd gRPC server: MaskService with health checks, metrics and a "
                                   "graceful drain on SIGTERM.")
    add_flags(p, ServerConfig())
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from maskd.server.app import start_or_exit
    from maskd.server.config import ServerConfig, from_flags

    server = start_or_exit(from_flags(ServerConfig, args))
    # What start-up loaded (tokenizer, engine, gRPC) lives as long as the process: out of the
    # collector's sight, a full collection walks ~1.5k objects instead of ~52k (bench serve at
    # batch 256: full-collection pauses 55 ms in all, 22 ms at most -> 16 ms, 15 ms).
    import gc
    gc.freeze()
    # SIGUSR1 writes every thread's stack to stderr (a server that hangs says where)
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    server.serve_forever(on_ready=lambda: print(
        f"maskd serving on {server.address}" +
        (f", metrics on {server.config.metrics_bind_host}:{server.metrics_port}/metrics"
         if server.metrics_port else ""), flush=True))
    return 0


def _add_health(sub) -> None:
    p = sub.add_parser("health", help="ask a maskd server (or directory) whether it serves; exit 0 when it does",
                       formatter_class=HelpFormatter,
                       description="The standard grpc.health.v1 check, for container health checks and "
                                   "scripts: exit 0 SERVING, 1 answering but not serving, 2 unreachable.")
    p.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of the server or directory")
    p.add_argument("--service", default="", help="health service name ('' is the whole server; "
                                                  "maskd.v1.MaskService turns NOT_SERVING while draining)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="connect deadline (refused connections are retried until then)")
    p.add_argument("--tls", action="store_true", help="speak TLS (system trust roots unless --tls-ca)")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="trust roots for --tls")
    p.set_defaults(func=cmd_health)


def cmd_health(args) -> int:
    from maskd_client import MaskClientError
    from maskd_client.health import SERVING, Unreachable, check

    roots = None
    if args.tls_ca:
        try:
            with open(args.tls_ca, "rb") as f:
                roots = f.read()
        except OSError as exc:
            sys.exit(f"maskd health: cannot read --tls-ca {args.tls_ca}: {exc.strerror or exc}")
    try:
        status = check(args.target, service=args.service, connect_timeout_s=args.timeout,
                       tls=args.tls, root_certs=roots)
    except Unreachable as exc:
        print(f"maskd health: {exc}", file=sys.stderr)
        return 2
    except MaskClientError as exc:
        print(f"maskd health: {exc}", file=sys.stderr)
        return 1
    print(f"{args.target} {status}")
    return 0 if status == SERVING else 1


# -- options every subcommand takes ---------------------------------------------------------------
def _add_common(parser: argparse.ArgumentParser) -> None:
    """--log-level and -v on a parser and every subparser below it."""
    from maskd.server.config import LOG_LEVELS

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if subs:
        for action in subs:
            for child in action.choices.values():
                _add_common(child)
        return
    parser.formatter_class = HelpFormatter
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                        help="log level (default: $MASKD_LOG_LEVEL, else warning)")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="-v: info, -vv: debug (--log-level wins; default: neither)")


def _log_level(args) -> str | None:
    if getattr(args, "log_level", None):
        return args.log_level
    verbose = getattr(args, "verbose", 0)
    return {0: None, 1: "info"}.get(verbose, "debug")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="maskd", description="maskd: a distributed token-mask server for "
                                     "constrained LLM decoding", formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"maskd {maskd.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_health(sub)
    for module, commands, provider in _OPTIONAL:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:   # not installed here: listed all the same, saying what to install
            for command in commands:
                _add_unavailable(sub, command, provider, exc)
            continue
        mod.add_parser(sub)
    _add_common(parser)
    return parser


def _add_unavailable(sub, command: str, provider: _Provider, exc: ImportError) -> None:
    """A subcommand whose module cannot be imported: whatever follows it, it says what to install."""
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    if missing:
        ours = missing == provider.package or missing.startswith(provider.package + ".")
        need = provider.what if ours else missing
        why = "" if ours else f" ({provider.what} brings it)"   # the package is there, a dependency is not
        message = f"maskd {command} needs {need}, which is not installed here{why}: {provider.install}"
        summary = f"not installed here: needs {need}"
    else:   # installed, but it does not load (a stale or partial install)
        message = f"maskd {command} cannot be loaded ({exc}): {provider.install}"
        summary = "cannot be loaded here"

    def unavailable(args) -> int:
        sys.exit(message)

    p = sub.add_parser(command, add_help=False, help=f"({summary})")
    p.set_defaults(func=unavailable, unavailable=True)


def main(argv: list[str] | None = None) -> int:
    from maskd.server.logs import configure

    parser = build_parser()
    # parse_args, except that a subcommand that is not installed takes any arguments (its --help
    # and flags included) and says what to install instead of refusing them
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "unavailable", False):
        parser.error("unrecognized arguments: " + " ".join(extra))
    try:
        configure(_log_level(args))
    except ValueError as exc:
        sys.exit(f"maskd: {exc}")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
