"""The server's configuration: one ``ServerConfig`` with its ``Limits`` nested.

Every command-line flag of ``maskd serve`` and ``maskd cluster up`` is derived from these fields
(``add_flags`` / ``from_flags``): the flag name, type, default and help text come from the field,
so a limit exists once and can always be set. The Helm chart's values are checked against the
same fields by the chart tests.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, TypeVar

from maskd.rowcodec import DEFAULT_DICT_SIZE
from maskd.specs import JSON_SCHEMA_MODES

BACKENDS = ("llguidance", "xgrammar")
LOG_LEVELS = ("debug", "info", "warning", "error")

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the flag."""


def setting(default: Any = dataclasses.MISSING, *, help: str, flag: str | None = None, cli: bool = True,
            choices: tuple | None = None, factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field that is also a command-line flag (``flag`` overrides the derived name)."""
    meta = {"help": help, "flag": flag, "cli": cli, "choices": choices}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class Limits:
    """What the server, a tenant, a stream, a request and a grammar may use. A request over a limit
    gets RESOURCE_EXHAUSTED naming the flag."""

    max_streams: int = setting(256, help="concurrent Session streams of the server")
    max_streams_per_tenant: int = setting(128, help="concurrent Session streams of one authenticated tenant")
    max_sequences: int = setting(131072, help="live sequences of the server")
    max_sequences_per_tenant: int = setting(65536, help="live sequences of one authenticated tenant")
    max_sequences_per_session: int = setting(65536, help="live sequences one session may hold")
    max_row_buffers_per_session: int = setting(
        6, help="row buffers a session's ring may grow to while sequences step in turns (e.g. pipeline "
                "micro-batches); past it kept rows are packed (CPU instead of memory); 6 never grows")
    max_message_bytes: int = setting(64 << 20, help="largest request message, bytes")
    max_tokens_per_request: int = setting(262144, help="tokens and draft tokens one step message may carry")
    max_tokens_per_step: int = setting(4096, help="tokens one sequence may carry in one step (restores go in parts)")
    max_draft_tokens: int = setting(16, help="draft tokens one sequence may carry in one step")
    max_rows_per_step: int = setting(8192, help="mask rows one step message may ask for")
    max_grammar_bytes: int = setting(1 << 20, help="largest grammar source, bytes")
    max_grammar_depth: int = setting(128, help="deepest nesting of a JSON grammar source (objects, arrays)")
    compile_timeout_s: float = setting(30.0, flag="--compile-timeout", help="seconds one grammar may compile")
    max_compiles_queued: int = setting(4096, help="grammars waiting to compile on the server")
    max_compiles_queued_per_tenant: int = setting(256, help="grammars of one tenant waiting to compile")
    max_compiles_running_per_tenant: int | None = setting(
        None, help="compiles of one tenant running at once (default: compile threads - 1, at least 1)")
    idle_timeout_s: float = setting(600.0, flag="--idle-timeout",
                                    help="seconds a Session stream may stay silent before the server ends it")
    slow_step_s: float = setting(0.02, flag="--slow-step",
                                 help="seconds from a step's arrival to its encoded reply past which the step is "
                                      "logged (WARNING, with its phases; at most one line a second) and counted "
                                      "in maskd_slow_steps")

    def check(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and value <= 0:
                raise ConfigError(f"{flag_name(f)} must be > 0, not {value}")


@dataclasses.dataclass
class ServerConfig:
    """Everything a maskd server is started with."""

    host: str = setting("127.0.0.1", help="address the gRPC port (and the metrics port) binds")
    port: int = setting(50051, help="gRPC port (0: a free one)")
    tokenizer: str = setting("deepseek-v4", help="deepseek-v4, qwen2.5, qwen3.6, cl100k, hf:PATH, tiktoken:PATH "
                                                 "or a Hugging Face model id")
    backend: str = setting("llguidance", help="grammar engine: llguidance or xgrammar")
    json_schema_mode: str = setting("complete", choices=JSON_SCHEMA_MODES,
                                    help="strict: a JSON schema the grammar cannot enforce whole is refused; "
                                         "complete: the grammar is the closest relaxation and each finished "
                                         "document is checked by a JSON Schema validator before EOS")
    allow_hub_download: bool = setting(False, help="let a tokenizer given as a Hugging Face model id download "
                                                   "from the hub (otherwise: the local cache only)")
    logits_width: int | None = setting(None, help="the model's logits width when it exceeds the vocabulary")
    threads: int | None = setting(None, help="mask-fill threads (default: the CPUs of this machine, or of the "
                                             "worker actor)")
    compile_threads: int = setting(2, help="grammar compile threads")
    cache_entries: int = setting(1024, help="compiled grammars kept in the local cache")
    cache_bytes: int = setting(1 << 30, help="bytes of compiled grammars kept in the local cache")
    compile_nice: int = setting(19, help="CPU priority (nice, 0-19) of compiles and of loading their results: 19 "
                                         "(the lowest) leaves the step path its core whatever compiles; 0 "
                                         "compiles at the server's own priority (for a server sharing its "
                                         "cores with processes that keep them busy)")
    compile_isolation: str = setting("process", choices=("process", "thread"),
                                     help="compile in worker processes (a crash or a runaway compile costs only "
                                          "that grammar) or in threads of the server (no isolation)")
    row_dict_size: int = setting(DEFAULT_DICT_SIZE,
                                 help="rows each stream's row dictionary keeps for DICT_REF (0: off)")
    metrics_port: int | None = setting(None, help="Prometheus /metrics port (0: a free one; unset: no endpoint)")
    metrics_host: str | None = setting(None, help="address the metrics port binds (default: --host)")
    tls_cert: str | None = setting(None, help="PEM certificate chain; with --tls-key the gRPC port serves TLS")
    tls_key: str | None = setting(None, help="PEM private key")
    auth_token_env: str = setting("MASKD_AUTH_TOKEN", help="environment variable holding the bearer token "
                                                          "clients must send (unset or empty: no auth)")
    auth_token: str | None = setting(None, cli=False, help="the bearer token itself (programmatic use)")
    auth_tokens_file: str | None = setting(None, help="tenants' bearer tokens: 'TENANT TOKEN' per line, '#' "
                                                      "comments; reloaded on SIGHUP")
    tls_client_ca: str | None = setting(None, help="PEM CA bundle: clients must present a certificate it signed "
                                                   "(mTLS); its common name is the tenant")
    allow_plaintext_auth: bool = setting(False, help="accept bearer tokens on a plaintext port that is not loopback")
    drafts_sync_s: float = setting(2.0, flag="--drafts-sync", help="in a cluster: seconds between exchanges of "
                                   "grammar drafts' counts with the cluster's store")
    drain_delay_s: float = setting(2.0, flag="--drain-delay", help="seconds after SIGTERM during which health "
                                   "says NOT_SERVING but the port still answers (load balancers see the drain)")
    drain_grace_s: float = setting(10.0, flag="--drain-grace", help="seconds open streams get to finish after the "
                                                                     "drain delay")
    limits: Limits = setting(help="", factory=Limits)

    def check(self) -> None:
        """Raises ConfigError naming the flag when a value cannot work."""
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}; available: {', '.join(BACKENDS)}")
        if self.json_schema_mode not in JSON_SCHEMA_MODES:
            raise ConfigError(f"--json-schema-mode must be one of {', '.join(JSON_SCHEMA_MODES)}, "
                              f"not {self.json_schema_mode!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], not {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be in [0, 65535], not {self.metrics_port}")
        for name in ("threads", "compile_threads", "cache_entries"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, not {value}")
        if not 0 <= self.compile_nice <= 19:
            raise ConfigError(f"--compile-nice must be in [0, 19], not {self.compile_nice}")
        if not self.drafts_sync_s > 0:
            raise ConfigError(f"--drafts-sync must be > 0 seconds, not {self.drafts_sync_s}")
        if self.row_dict_size < 0:
            raise ConfigError(f"--row-dict-size must be >= 0, not {self.row_dict_size}")
        if self.logits_width is not None and self.logits_width < 1:
            raise ConfigError(f"--logits-width must be at least 1, not {self.logits_width}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS)")
        if self.drain_delay_s < 0 or self.drain_grace_s < 0:
            raise ConfigError("--drain-delay and --drain-grace must be >= 0")
        if self.cache_bytes < 1:
            raise ConfigError(f"--cache-bytes must be at least 1, not {self.cache_bytes}")
        if (self.resolved_auth_token() or self.auth_tokens_file) and not self.tls_cert \
                and not self.allow_plaintext_auth and not is_loopback(self.host):
            raise ConfigError(f"bearer tokens on the plaintext port {self.host}:{self.port} would travel in the "
                              "clear: serve TLS (--tls-cert/--tls-key), bind loopback, or pass "
                              "--allow-plaintext-auth")
        self.limits.check()

    @property
    def fill_threads(self) -> int:
        return self.threads or max(1, os.cpu_count() or 1)

    @property
    def metrics_bind_host(self) -> str:
        return self.metrics_host or self.host

    def resolved_auth_token(self) -> str | None:
        """The token clients must send: ``auth_token``, else the variable ``auth_token_env`` names."""
        if self.auth_token:
            return self.auth_token
        return (os.environ.get(self.auth_token_env) or None) if self.auth_token_env else None


def is_loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# -- flags derived from fields -------------------------------------------------------------------
def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _dest(f: dataclasses.Field) -> str:
    return flag_name(f)[2:].replace("-", "_")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _scalar(annotation: Any) -> tuple[type, bool]:
    """(scalar type, optional) of an annotation such as ``int``, ``str | None``."""
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"unsupported annotation {annotation}")
        return rest[0], True
    return annotation, False


def _walk(cls: Any) -> typing.Iterator[tuple[dataclasses.Field, Any, tuple[str, ...]]]:
    """Every flag field of a config class, nested dataclasses included, with its path."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            for inner, inner_kind, path in _walk(kind):
                yield inner, inner_kind, (f.name, *path)
        elif f.metadata.get("cli", True):
            yield f, kind, (f.name,)


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        obj = getattr(obj, name)
    return obj


def add_flags(parser: argparse.ArgumentParser | Any, defaults: Any, *, skip: tuple[str, ...] = ()) -> None:
    """Adds one flag per field of the config object ``defaults`` (nested configs included); the
    flag's default is that object's value, so a caller can start from other defaults."""
    seen: set[str] = set()
    for f, kind, path in _walk(type(defaults)):
        if f.name in skip:
            continue
        name = flag_name(f)
        if name in seen:
            raise TypeError(f"two config fields map to the flag {name}")
        seen.add(name)
        scalar, _ = _scalar(kind)
        default = _get(defaults, path)
        kwargs: dict[str, Any] = {"default": default, "dest": _dest(f), "help": f.metadata.get("help") or " "}
        if scalar is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = scalar
            kwargs["metavar"] = {int: "N", float: "SECONDS" if f.name.endswith("_s") else "X"}.get(scalar, "TEXT")
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
            kwargs.pop("metavar", None)
        parser.add_argument(name, **kwargs)


def from_flags(cls: type[T], args: argparse.Namespace, *, base: T | None = None) -> T:
    """The config object the flags describe (fields without a flag keep ``base``'s values)."""
    obj = base if base is not None else cls()
    return _replace(obj, args)


def _replace(obj: Any, args: argparse.Namespace) -> Any:
    hints = _hints(type(obj))
    changes = {}
    for f in dataclasses.fields(obj):
        if dataclasses.is_dataclass(hints[f.name]):
            changes[f.name] = _replace(getattr(obj, f.name), args)
        elif f.metadata.get("cli", True) and hasattr(args, _dest(f)):
            changes[f.name] = getattr(args, _dest(f))
    return dataclasses.replace(obj, **changes)


def flag_names(cls: type) -> dict[str, tuple[str, ...]]:
    """Flag -> field path, for tools that check other descriptions (the chart) against the config."""
    return {flag_name(f): path for f, _, path in _walk(cls)}
