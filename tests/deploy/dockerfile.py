"""A small reader of the repository's Dockerfile: stages, their ARG defaults, ENV, COPY and RUN lines
(continuations joined), enough for tests to replay the recipe outside a container builder."""
from __future__ import annotations

import dataclasses
import pathlib
import re
import shlex

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


@dataclasses.dataclass
class Stage:
    name: str
    base: str                                   # an image, or the name of an earlier stage
    args: dict[str, str] = dataclasses.field(default_factory=dict)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    copies: list[tuple[str | None, list[str], str]] = dataclasses.field(default_factory=list)  # (from, srcs, dest)
    runs: list[str] = dataclasses.field(default_factory=list)
    cmd: list[str] = dataclasses.field(default_factory=list)
    healthcheck: list[str] = dataclasses.field(default_factory=list)
    user: str | None = None


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) per instruction, comments dropped and continuation lines joined."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _env_pairs(rest: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in shlex.split(rest))


def parse(text: str | None = None) -> tuple[dict[str, str], dict[str, Stage]]:
    """(global ARG defaults, stages by name in order)."""
    text = DOCKERFILE.read_text() if text is None else text
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for word, rest in instructions(text):
        if word == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert m, rest
            base = re.sub(r"\$\{(\w+)\}", lambda v: global_args.get(v.group(1), v.group(0)), m.group(1))
            stage = Stage(m.group(2) or f"stage{len(stages)}", base)
            if base in stages:   # a stage on an earlier one inherits its ENV (not its ARGs)
                stage.env.update(stages[base].env)
                stage.user = stages[base].user
            stages[stage.name] = stage
        elif word == "ARG":
            name, _, default = rest.partition("=")
            (stage.args if stage else global_args)[name] = default.strip('"')
        elif stage is None:
            continue
        elif word == "ENV":
            stage.env.update(_env_pairs(rest))
        elif word == "RUN":
            stage.runs.append(rest)
        elif word == "COPY":
            parts = shlex.split(rest)
            source = next((p.split("=", 1)[1] for p in parts if p.startswith("--from=")), None)
            paths = [p for p in parts if not p.startswith("--")]
            stage.copies.append((source, paths[:-1], paths[-1]))
        elif word == "CMD":
            stage.cmd = _exec_form(rest)
        elif word == "HEALTHCHECK":
            stage.healthcheck = _exec_form(rest.split(" CMD ", 1)[1])
        elif word == "USER":
            stage.user = rest
    return global_args, stages


def _exec_form(rest: str) -> list[str]:
    import json
    return json.loads(rest)


def chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built on, the root first."""
    out = []
    while name in stages:
        out.append(stages[name])
        name = stages[name].base
    return out[::-1]


def effective(stages: dict[str, Stage], name: str) -> Stage:
    """A target's CMD, HEALTHCHECK and USER, as inherited along its chain."""
    merged = Stage(name, "")
    for s in chain(stages, name):
        merged.cmd = s.cmd or merged.cmd
        merged.healthcheck = s.healthcheck or merged.healthcheck
        merged.user = s.user or merged.user
        merged.env.update(s.env)
        merged.copies += s.copies
    return merged
