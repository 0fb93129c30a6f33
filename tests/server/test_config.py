"""One config: every field of ServerConfig (limits included) is a flag with its default in the help;
every subcommand takes --log-level; errors are counted by kind and logged; the reply is timed in one
place (what a reply reports as server_seconds is what the step metric recorded)."""
import argparse
import dataclasses
import logging
import subprocess
import sys

import grpc
import pytest

from maskd import cli
from maskd.server import Limits, MaskServer, ServerConfig
from maskd.server.config import flag_names, from_flags
from maskd.specs import GrammarSpec
from maskd.v1 import maskd_pb2 as pb
from maskd.v1 import maskd_pb2_grpc as pb_grpc


def subparsers(parser, path=()):
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not actions:
        yield path, parser
    for action in actions:
        for name, child in action.choices.items():
            yield from subparsers(child, (*path, name))


def test_every_limit_is_a_flag_and_reaches_the_config():
    parser = cli.build_parser()
    flags = flag_names(ServerConfig)
    argv = ["serve"]
    expected = {}
    for f in dataclasses.fields(Limits):
        flag = next(k for k, v in flags.items() if v == ("limits", f.name))
        value = (getattr(Limits(), f.name) or 1) * 2
        argv += [flag, str(value)]
        expected[f.name] = value
    cfg = from_flags(ServerConfig, parser.parse_args(argv))
    assert dataclasses.asdict(cfg.limits) == expected
    assert cfg.limits != Limits()


def test_every_help_shows_defaults_and_every_subcommand_takes_log_level():
    parser = cli.build_parser()
    seen = []
    for path, sub in subparsers(parser):
        text = sub.format_help()
        assert "--log-level" in text, path
        seen.append(" ".join(path))
    assert {"serve", "conformance", "demo", "bench serve", "cluster up", "cluster status"} <= set(seen)
    serve = dict(subparsers(parser))[("serve",)].format_help()
    serve = serve[serve.index("options:"):]
    for flag, default in (("--port", "50051"), ("--max-tokens-per-step", "4096"), ("--row-dict-size", "256"),
                          ("--compile-timeout", "30.0")):
        line = " ".join(serve[serve.index(f"  {flag} "):].split())   # the help text, unwrapped
        assert f"(default: {default})" in line[:200], flag


def test_log_level_from_the_flag_the_environment_and_garbage():
    env = {"MASKD_LOG_LEVEL": "shouting", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "maskd.cli", "serve", "--port", "0", "--tokenizer", "nope:x"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode != 0 and "unknown log level 'shouting'" in done.stderr and "MASKD_LOG_LEVEL" in done.stderr
    done = subprocess.run([sys.executable, "-m", "maskd.cli", "serve", "--log-level", "loud"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "invalid choice: 'loud'" in done.stderr
    done = subprocess.run([sys.executable, "-m", "maskd.cli", "serve", "-v", "--port", "0", "--tokenizer", "nope:x"],
                          capture_output=True, text=True, timeout=60)   # -v is a flag of every subcommand
    assert done.returncode != 0 and "unknown tokenizer" in done.stderr


def test_errors_are_counted_by_kind_and_logged_and_the_reply_is_timed_once(caplog):
    with MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1, compile_threads=1)) as server, \
            grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.MaskServiceStub(ch)
        with caplog.at_level(logging.INFO, logger="maskd"), pytest.raises(grpc.RpcError):
            stub.RegisterGrammar(pb.RegisterGrammarRequest(
                spec=GrammarSpec.from_dict({"lark": "start: nowhere"}).to_proto(), wait=True))
        assert any("does not compile" in r.getMessage() for r in caplog.records)
        spec = GrammarSpec.from_dict({"regex": "[0-9]+"}).to_proto()
        reqs = [pb.StepRequest(seqs=[pb.SeqStep(seq_id="a", step=0, spec=spec)]),
                pb.StepRequest(seqs=[pb.SeqStep(seq_id="nobody", step=3)]),
                pb.StepRequest(seqs=[pb.SeqStep(seq_id="a", step=1, tokens=[10 ** 7])])]
        replies = list(stub.Session(iter(reqs)))
        reg = server.metrics.registry
        errors = {kind: reg.get_sample_value("maskd_errors_total", {"kind": kind})
                  for kind in ("compile_error", "not_found", "invalid_argument")}
        assert errors == {"compile_error": 1.0, "not_found": 1.0, "invalid_argument": 1.0}
        recorded = reg.get_sample_value("maskd_step_seconds_sum")
        assert reg.get_sample_value("maskd_step_seconds_count") == 3
        assert recorded == pytest.approx(sum(r.server_seconds for r in replies), rel=1e-9)


def test_json_schema_mode_is_checked():
    import pytest

    from maskd.server.config import ConfigError, ServerConfig
    assert ServerConfig().json_schema_mode == "complete"
    with pytest.raises(ConfigError, match="--json-schema-mode must be one of strict, complete"):
        ServerConfig(json_schema_mode="lenient").check()


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Limits)])
def test_every_limit_refuses_garbage_naming_its_flag(field, capsys):
    """0 or a negative value is a ConfigError naming the flag; a word is an argparse error."""
    from maskd.server.config import ConfigError
    flag = next(k for k, v in flag_names(ServerConfig).items() if v == ("limits", field))
    for bad in (0, -3):
        with pytest.raises(ConfigError, match=f"{flag} must be > 0"):
            Limits(**{field: bad}).check()
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", flag, "lots"])
    assert flag in capsys.readouterr().err


def test_compile_nice_is_checked():
    import pytest

    from maskd.server.config import ConfigError, ServerConfig
    assert ServerConfig().compile_nice == 19
    ServerConfig(compile_nice=0).check()
    for bad in (-1, 20):
        with pytest.raises(ConfigError, match=r"--compile-nice must be in \[0, 19\]"):
            ServerConfig(compile_nice=bad).check()
