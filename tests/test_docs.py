"""The README and docs/*.md, run: every command and code block shown to a user works as written.

A small collector reads the fenced blocks of README.md and docs/*.md. Each block is one of:

- marked ``<!-- not run: REASON -->`` on the line before it (GPUs, remote servers, hours of running):
  its ``segfuse`` lines are still parsed by the real CLI, flags and values, without running anything;
- a sample output: marked ``<!-- output of: COMMAND -->``, or starting with ``$ COMMAND``. The test runs
  the command and finds the sample in what it prints, ``…`` standing for any text (timings). A generated
  answer is matched by its shape only (legend, summary fields, finish reason): greedy answers differ between
  CPUs, so the sample's text is one machine's and no test compares it;
- a shell, Python, YAML (llm's model list) or TOML (server config) block, which the tests below run,
  against one shared ``segfuse serve`` where it needs a server.

Small limits are the test's, not the docs': one item (``--limit 1``), a few tokens, one thread
(``SEGFUSE_THREADS=1``), its own port and output folders. Inline commands (``segfuse ...`` in prose and
tables) are parsed by the CLI too, and the README's one-line commands for other tools (curl, llm,
lm_eval) run against the shared server. A block no rule covers fails: run it here, or mark it.

docs/design.md's map of the package is checked both ways: every module it names exists, and it names every
module.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import typer.main

from lm_eval_cli import run_lm_eval
from segfuse import models as catalogue
from segfuse.bench.common.processes import SegfuseServer, free_port, running, wait_until_serving

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ENV = {
    **{k: v for k, v in os.environ.items() if k != "SEGFUSE_API_KEY"},
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
    "SEGFUSE_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "NO_COLOR": "1",
}
DOC_SERVER = ("127.0.0.1:8000", "localhost:8000")  # where the docs' server listens: the shared one's port here
# The shared server: the one docs/evaluation.md starts in the background for lm-eval (the README's and
# docs/server.md's clients need no more), with the test's limits.
SHARED_SERVE = ["segfuse", "serve", "--prefix-cache-cells", "0", "--max-concurrent", "1"]
LIMITS = ["--threads", "1", "--max-tokens", "16"]

NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")
OUTPUT_OF = re.compile(r"<!--\s*output of:\s*(.+?)\s*-->")
FENCE = re.compile(r"^```(\S*)\s*$")


# --------------------------------------------------------------------------- the collector


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    not_run: str | None  # the reason given in the doc
    output_of: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def collect(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with the marker on the line before each (blank lines between)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip, output = NOT_RUN.search(before), OUTPUT_OF.search(before)
        blocks.append(
            Block(
                path,
                i + 1,
                opening.group(1),
                "\n".join(lines[i + 1 : end]),
                skip.group(1) if skip else None,
                output.group(1) if output else None,
            )
        )
        i = end + 1
    return blocks


def inline_code(path: Path) -> list[str]:
    """The `code spans` of a Markdown file outside its fenced blocks, markdown table escapes undone."""
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return [span.replace("\\|", "|") for span in re.findall(r"`([^`\n]+)`", text)]


BLOCKS = [b for path in DOCS for b in collect(path)]


def shell_commands(text: str) -> list[str]:
    """The command lines of a shell block: continuations joined as the shell does, comments cut."""
    return [line for line in (strip_comment(raw).strip() for raw in text.replace("\\\n", "").splitlines()) if line]


def strip_comment(line: str) -> str:
    """`line` before a `#` that starts a word outside quotes (`remote:URL#name` keeps its #)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, ""
    return list(lexer)


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of a line (split at |, &&, ;, &), redirections and their targets dropped."""
    out, current, tokens = [], [], iter(words(line))
    for token in tokens:
        if token in ("|", "&&", ";", "&", "||"):
            out.append(current)
            current = []
        elif token in (">", ">>", "<"):
            next(tokens, None)
        else:
            current.append(token)
    return [c for c in [*out, current] if c]


def env_and_argv(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading NAME=value words as the environment, the rest as the command."""
    env = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
        name, value = argv[0].split("=", 1)
        env[name] = value
        argv = argv[1:]
    return env, argv


def program(argv: list[str]) -> str:
    return Path(argv[0]).name if argv else ""


# --------------------------------------------------------------------------- the CLI, parsed without running


@cache
def cli() -> Any:
    """The CLI as a click group (typer's own copy of click: reached through the objects, never imported)."""
    from segfuse.cli import app

    return typer.main.get_command(app)


def parse_cli(argv: list[str], reference: bool = False) -> None:
    """Parse `segfuse ARGS` as the CLI does, run nothing: an unknown flag or a bad value raises.

    A `reference` (a command named in prose: `segfuse calibrate`, `segfuse serve --config`) may leave
    out its arguments and an option's value; what it does name must still exist."""
    from segfuse.cli.flags import NONE_PREFIX, PREFIX, _plain
    from segfuse.options import FusionOptions

    command = cli()
    parent = command.context_class(command, info_name="segfuse")
    args = list(argv[1:])
    while hasattr(command, "commands") and args and args[0] in command.commands:  # a group: its subcommand
        command, args = command.commands[args[0]], args[1:]
    if "--help" in args:  # the help exists for every command: check the rest
        args.remove("--help")
    try:
        ctx = command.make_context(command.name or "", args, parent=parent)
    except Exception as exc:
        if type(exc).__name__ == "Exit" and getattr(exc, "exit_code", 1) == 0:  # an eager flag: --version
            return
        if reference and (type(exc).__name__ == "MissingParameter" or "requires an argument" in str(exc)):
            return
        raise
    fusion = {k[len(PREFIX) :]: _plain(v) for k, v in ctx.params.items() if k.startswith(PREFIX) and v is not None}
    fusion.update({k[len(NONE_PREFIX) :]: None for k, v in ctx.params.items() if k.startswith(NONE_PREFIX) and v})
    if fusion:
        FusionOptions.build(**fusion)


def segfuse_lines() -> Iterator[tuple[str, list[str], bool]]:
    """Every `segfuse ...` command the docs show: in blocks (run or not) and inline."""
    for block in BLOCKS:
        first = block.text.splitlines()[0] if block.text else ""
        if block.lang == "bash":
            lines = shell_commands(block.text)
        elif block.lang == "":  # a sample output: the command that prints it
            lines = [block.output_of] if block.output_of else [first[2:]] if first.startswith("$ ") else []
        else:
            lines = []
        for line in lines:
            for argv in simple_commands(line):
                if program(env_and_argv(argv)[1]) == "segfuse":
                    yield block.name, env_and_argv(argv)[1], False
    for path in DOCS:
        for span in inline_code(path):
            if re.match(r"(\S*/)?segfuse \S", span) or "| segfuse " in span:
                for argv in simple_commands(span):
                    if program(argv) == "segfuse":
                        yield f"{path.relative_to(ROOT)} `{span}`", argv, True


def test_every_segfuse_command_in_the_docs_parses():
    """Flags and values the docs name, the CLI takes (`--accept-margin none`, `--gate none`, ...)."""
    seen, failures = 0, []
    for where, argv, inline in segfuse_lines():
        seen += 1
        try:
            parse_cli(argv, reference=inline)
        except Exception as exc:  # click's usage errors and FusionOptions' InvalidRequestError alike
            message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
            failures.append(f"{where}: {shlex.join(argv)}\n    {message}")
    assert seen > 40, seen  # the collector finds the docs' commands
    assert not failures, "\n".join(failures)


# Flags the docs name in passing that belong to other programs (vLLM, SGLang, lm-eval, llm, llama-cpp-python, the GPU check).
OTHER_PROGRAMS_FLAGS = {
    "--apply_chat_template": "lm_eval",
    "--include_path": "lm_eval",
    "--tasks": "lm_eval",
    "--batch_size": "lm_eval",
    "--schema": "llm",
    "--cache": "llama_cpp.server",
    "--enable-prefix-caching": "vllm",
    "--max-logprobs": "vllm",
    "--served-model-name": "vllm",
    "--dtype": "vllm",
    "--disable-radix-cache": "sglang",
    "--budget": "segfuse.bench.gpu.check",  # the GPU check's check.py (docs/deploy.md)
    "--small": "segfuse.bench.gpu.check",
    "--device": "segfuse.bench.gpu.check",
    "--no-deps-download": "segfuse.bench.gpu.pack",
}


def cli_flags() -> dict[str, list[list[str]]]:
    """Every long flag of the CLI, with the commands (as argv prefixes) that take it."""
    flags: dict[str, list[list[str]]] = {}

    def walk(command: Any, path: list[str]) -> None:
        for param in command.params:
            for flag in [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]:
                if flag.startswith("--"):
                    flags.setdefault(flag, []).append(path)
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])

    walk(cli(), ["segfuse"])
    return flags


def flag_spans() -> Iterator[tuple[str, str, str | None]]:
    """`--flag`, `--flag VALUE`, `--a/--b` written inline in the docs: (where, flag, value or None)."""
    for path in DOCS:
        for span in inline_code(path):
            parts = span.split("/") if re.fullmatch(r"--[a-z-]+(/--[a-z-]+)+", span) else [span]
            for part in parts:
                m = re.fullmatch(r"(--[a-z][a-z0-9_-]*)(?:[ =](\S+))?", part)
                if m:
                    yield f"{path.relative_to(ROOT)} `{span}`", m.group(1), m.group(2)


def test_every_flag_the_docs_name_is_taken():
    """An inline `--flag` is a flag of some command; with a value (`--accept-margin none`; each of the
    alternatives of `--score a|b`; UPPERCASE placeholders aside), some command that has it accepts it."""
    flags, failures, seen = cli_flags(), [], 0
    for where, flag, value in flag_spans():
        seen += 1
        if flag not in flags:
            if flag not in OTHER_PROGRAMS_FLAGS:
                failures.append(f"{where}: no command takes {flag}")
            continue
        for alternative in (value or "").split("|"):
            if not alternative or any(c.isupper() for c in alternative) or "…" in alternative:
                continue
            errors = []
            for command in flags[flag]:
                try:
                    parse_cli([*command, flag, alternative], reference=True)
                    break
                except Exception as exc:
                    errors.append(exc.format_message() if hasattr(exc, "format_message") else str(exc))
            else:
                failures.append(f"{where}: {flag} {alternative}: {errors[0]}")
    assert seen > 50, seen
    assert not failures, "\n".join(failures)


def test_the_parser_refuses_what_the_cli_refuses():
    """The check above can fail: a flag the CLI lacks, a value it refuses."""
    with pytest.raises(Exception, match="No such option"):
        parse_cli(["segfuse", "generate", "--no-such-flag", "x"])
    with pytest.raises(Exception, match="not a number or none"):
        parse_cli(["segfuse", "generate", "--accept-margin", "lots", "x"])
    with pytest.raises(Exception, match="gate"):
        parse_cli(["segfuse", "generate", "--gate", "-1", "x"])
    parse_cli(["segfuse", "generate", "--accept-margin", "none", "--gate", "None", "x"])
    parse_cli(["segfuse", "generate", "--no-accept-margin", "--no-gate", "x"])


def test_make_targets_and_extras_the_docs_name_exist():
    """`make X` and `pip install '.[X]'` lines name real targets and extras (the install itself is this
    test environment's, made by `make install`)."""
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    lines = [line for b in BLOCKS if b.lang == "bash" for line in shell_commands(b.text)]
    lines += [span for path in DOCS for span in inline_code(path)]
    makes = pips = 0
    for line in lines:
        for argv in simple_commands(line):
            if program(argv) == "make":
                makes += 1
                assert all(a in targets for a in argv[1:] if "=" not in a), line
            elif program(argv) == "pip" and "install" in argv:
                for word in argv:
                    for group in re.findall(r"\[([a-z,]+)\]", word):
                        pips += 1
                        assert set(group.split(",")) <= extras, line
    assert makes and pips


# --------------------------------------------------------------------------- running blocks


def models_ready() -> None:
    missing = [n for n in catalogue.DEFAULT_MODELS if not catalogue.is_ready(catalogue.CATALOGUE[n])]
    if missing:
        pytest.fail(f"models not prepared: {missing}; run `make models`", pytrace=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[SegfuseServer]:
    """The docs' `segfuse serve` (no key, port 8000 there; a free port here), shared by every block."""
    models_ready()
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "serve.log"
    args = [str(BIN / "segfuse"), *SHARED_SERVE[1:], "--port", str(port), *LIMITS]
    with running(args, log, signal.SIGINT, 20, env=ENV) as process:  # SIGINT: uvicorn's graceful shutdown
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(process, f"{url}/health", 300, log, ok=healthy)
        yield SegfuseServer(url, "", log, process)


def healthy(response) -> bool:
    return response.status_code == 200 and response.json().get("status") == "ok"


def at(server: SegfuseServer, text: str) -> str:
    """`text` with the docs' server address replaced by the shared server's."""
    for address in DOC_SERVER:
        text = text.replace(address, server.url.removeprefix("http://"))
    return text


def override(argv: list[str], flag: str, value: str) -> list[str]:
    """`argv` with `flag value` set: replaced where given, appended where not."""
    if flag in argv:
        i = argv.index(flag)
        return [*argv[: i + 1], value, *argv[i + 2 :]]
    return [*argv, flag, value]


def run(argv: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT, timeout: float = 600) -> str:
    """Run a command; fail with its output unless it exits 0; return stdout and stderr together."""
    done = subprocess.run(
        argv,
        cwd=cwd,
        env={**ENV, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}:\n{done.stdout[-4000:]}"
    return done.stdout


def executable(name: str) -> str:
    return str(BIN / name) if (BIN / name).exists() else name


def limited(argv: list[str], tmp: Path, server: SegfuseServer | None) -> list[str]:
    """A docs command with the test's limits: one item, a few tokens, one thread, its own folders and port."""
    name, args = program(argv), argv[1:]
    evaluates = name in ("lm_eval", "segfuse-lm-eval") or (
        name == "segfuse" and args[:1] == ["eval"] and "--report" not in args
    )
    assert not evaluates or "--limit" in args, (
        f"`{shlex.join(argv)}` as written runs every item of its task (hours): give it a --limit"
    )
    args = [tmp / a if a.startswith("runs/") else a for a in args]
    args = [str(a) for a in args]
    if name == "segfuse" and evaluates:
        args = override(override(override(args, "--limit", "1"), "--max-tokens", "8"), "--threads", "1")
        args.append("--no-progress")
    elif name in ("lm_eval", "segfuse-lm-eval"):
        args = override(override(args, "--limit", "1"), "--gen_kwargs", "max_gen_toks=8")
        if server is not None:
            args = [at(server, a) for a in args]
    elif name == "curl":
        args = ["-sS", "--fail-with-body", "--max-time", "300", *[at(server, a) for a in args]]
    elif name == "llm":
        args = [*args, "-o", "max_tokens", "8"]
    return [executable(name), *args]


def run_shell_block(block: Block, tmp: Path, request: pytest.FixtureRequest) -> list[str]:
    """Every command of a shell block, each as written plus the test's limits; returns their outputs."""
    outputs = []
    for line in shell_commands(block.text):
        for argv in simple_commands(line):
            env, argv = env_and_argv(argv)
            name = program(argv)
            if name == "pip":
                continue  # the install is this environment's (test_make_targets_and_extras_the_docs_name_exist)
            if argv[:2] == ["segfuse", "serve"]:
                outputs.append(serve_once(block, line, argv, tmp))
                continue
            needs_server = name == "curl" or any(a in line for a in DOC_SERVER)
            server = request.getfixturevalue("server") if needs_server else None
            assert name in ("segfuse", "segfuse-lm-eval", "lm_eval", "curl", "llm"), (
                f"{block.name}: the test does not know how to run `{line}`: teach it, or mark the block "
                "<!-- not run: reason -->"
            )
            outputs.append(run(limited(argv, tmp, server), env=env))
    return outputs


def serve_once(block: Block, line: str, argv: list[str], tmp: Path) -> str:
    """`segfuse serve ...` as written: in the background (`&`) it is the shared server; else it must start."""
    if line.rstrip().endswith("&"):
        assert argv == SHARED_SERVE, f"{block.name}: the shared server runs {shlex.join(SHARED_SERVE)}"
        return ""
    port = str(free_port())
    args = override([str(BIN / "segfuse"), *argv[1:], *LIMITS], "--port", port)
    if "--config" in args:  # the docs' own config file: the TOML block beside it
        [toml] = [b for b in BLOCKS if b.path == block.path and b.lang == "toml"]
        config = tmp / args[args.index("--config") + 1]
        config.write_text(toml.text)
        args = override(args, "--config", str(config))
    log = tmp / f"serve-{port}.log"
    with running(args, log, signal.SIGINT, 20, env=ENV) as process:
        wait_until_serving(process, f"http://127.0.0.1:{port}/health", 300, log, ok=healthy)
    return log.read_text()


LEGEND = re.compile(r"^■ ")  # the line naming the members, before the answer
STATS = re.compile(r"^\d+ rounds? · ")  # the summary line that follows the answer
NUMBER = re.compile(r"(?<![\w.-])\d+(?:\.\d+)?(?![\w-])")  # a number, not a digit of a name


def literal(text: str) -> str:
    """A pattern for `text`, whitespace aside (any run of it, or none), `…` matching any text."""
    return ".*?".join(r"\s*".join(map(re.escape, part.split())) for part in text.split("…"))


def stats_shape(text: str) -> str:
    """A pattern for a summary line: its fields, names and finish reason as written, its numbers any number,
    except the token count of an answer the budget cut (`finish: length`: the budget fixes it)."""
    flat = " ".join(text.split())
    cut = "finish: length" in flat
    pieces = re.split(f"({NUMBER.pattern} tokens|{NUMBER.pattern})", flat)
    return r"\s*".join(
        literal(piece)
        if i % 2 == 0 or (cut and piece.endswith(" tokens"))
        else NUMBER.pattern + (r"\s*tokens" if piece.endswith(" tokens") else "")
        for i, piece in enumerate(pieces)
    )


def sample_pattern(sample: str) -> str:
    """A generation's sample by its shape: the text before the legend and the legend as written, the answer
    any text (greedy answers differ between CPUs: the text is one machine's), the summary by its fields
    (`stats_shape`), the lines after it as written. Any other sample: as written, `…` matching any text."""
    lines = sample.splitlines()
    legend = next((i for i, line in enumerate(lines) if LEGEND.match(line)), None)
    stats = next((i for i, line in enumerate(lines) if STATS.match(line)), None)
    if legend is None or stats is None or stats <= legend:
        return literal(sample)
    end = next(i for i in range(stats, len(lines)) if "finish:" in lines[i]) + 1
    head, answer = literal("\n".join(lines[: legend + 1])), r"\S.*?"
    summary, tail = stats_shape("\n".join(lines[stats:end])), literal("\n".join(lines[end:]))
    return r"\s*".join(part for part in (head, answer, summary, tail) if part)


def sample_matches(sample: str, output: str) -> bool:
    """The sample (by its shape, `sample_pattern`) is in the output, whitespace aside."""
    return re.search(sample_pattern(sample), " ".join(output.split()), flags=re.S) is not None


def test_a_generation_sample_is_matched_by_its_shape_not_its_text():
    """Another CPU's greedy answer of the same shape matches; another finish reason, or another token count
    where the budget fixes it, does not."""
    sample = (
        "question: Why?\n■ a  ■ b\nThe sky is blue because of Rayleigh scattering.\n"
        "8 rounds · 64 tokens · … tok/s · first segment … s · total … s · 48 member calls (6.0/round) ·\n"
        "wins: a 3, b-0.5b 5 · finish: length\nhint as written"
    )
    other = (
        "question: Why?\n■ a  ■ b\nBecause of refraction, which is a process\n"
        "7 rounds · 64 tokens · 9.1 tok/s · first segment 0.2 s · total 7.0 s · 42 member calls (6.0/round) · "
        "wins: a 4, b-0.5b 3 · finish: length\nhint as written\n"
    )
    assert sample_matches(sample, other)
    assert not sample_matches(sample, other.replace("finish: length", "finish: stop"))
    assert not sample_matches(sample, other.replace("64 tokens", "60 tokens"))
    assert not sample_matches(sample, other.replace("hint as written", "another hint"))
    assert not sample_matches(sample, other.replace("wins: a 4", "wins: c 4"))
    assert sample_matches("plain … output", "some plain 42 output")


RUNNABLE = [b for b in BLOCKS if b.not_run is None]


@pytest.mark.models
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.name for b in RUNNABLE])
def test_block_runs_as_written(block: Block, tmp_path: Path, request: pytest.FixtureRequest):
    models_ready()
    first = block.text.splitlines()[0] if block.text else ""
    if block.output_of or first.startswith("$ "):
        command = block.output_of or first[2:]
        sample = block.text if block.output_of else "\n".join(block.text.splitlines()[1:])
        output = run(limited(words(command), tmp_path, None))
        assert sample_matches(sample, output), f"{block.name}: `{command}` no longer prints the sample:\n{output}"
    elif first == "src/segfuse/":  # the layout: every file and folder it names exists
        named = re.findall(r"^  (\S+)", block.text, flags=re.M)
        for name in named:
            assert (ROOT / "src" / "segfuse" / name).exists(), f"{block.name}: {name} is not in src/segfuse"
    elif block.lang == "bash":
        run_shell_block(block, tmp_path, request)
    elif block.lang == "python":
        needs_server = any(a in block.text for a in DOC_SERVER)
        code = at(request.getfixturevalue("server"), block.text) if needs_server else block.text
        (tmp_path / "block.py").write_text(code)
        assert run([sys.executable, str(tmp_path / "block.py")], cwd=tmp_path).strip()
    elif block.lang == "yaml" and "model_id:" in block.text:  # llm's extra-openai-models.yaml
        server = request.getfixturevalue("server")
        (tmp_path / "extra-openai-models.yaml").write_text(at(server, block.text))
        model = re.search(r"model_id:\s*(\S+)", block.text).group(1)
        answer = run(
            [executable("llm"), "-m", model, "Say hi.", "-o", "max_tokens", "8"], env={"LLM_USER_PATH": str(tmp_path)}
        )
        assert answer.strip()
    elif block.lang == "toml" and "[server]" in block.text:  # `segfuse serve --config` reads it
        from segfuse.config import build_config

        (tmp_path / "segfuse.toml").write_text(block.text)
        build_config(tmp_path / "segfuse.toml")
    else:
        pytest.fail(
            f"{block.name}: no rule runs a `{block.lang or 'plain'}` block like this: teach the test, "
            "or mark it <!-- not run: reason -->"
        )


PACKAGE = ROOT / "src" / "segfuse"
DESIGN = ROOT / "docs" / "design.md"
INIT_FILES = ("__init__.py", "__main__.py")  # a package's own files: the folder's name stands for them


def design_names() -> list[str]:
    """The files and folders docs/design.md names: its `code` spans that are a path (`engine/loop.py`,
    `backends/ray/`), and the first column of its layout block (the fenced block that starts `src/segfuse/`)."""
    spans = [s for s in inline_code(DESIGN) if re.fullmatch(r"[\w/]+\.py|[\w/]+/", s)]
    [layout] = [b for b in BLOCKS if b.path == DESIGN and b.text.startswith("src/segfuse/")]
    return spans + re.findall(r"^  (\S+)", layout.text, flags=re.M)


def package_paths() -> list[str]:
    """Every file and folder under src/segfuse, relative to it (`backends/ray/loop.py`, `backends/ray`)."""
    return [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*") if "__pycache__" not in p.parts]


def test_every_module_the_design_names_exists():
    """docs/design.md draws the house: every file or folder it names in `code` is in src/segfuse (named from the
    package root, or from a folder the text is about: `chat/planning.py` is server/chat/planning.py)."""
    files = package_paths()
    named = design_names()
    assert len(named) > 40
    missing = [
        s
        for s in named
        if s.rstrip("/") not in ("src", "src/segfuse")
        and not (s.startswith("tests/") and (ROOT / s).exists())  # the section on the tests names their files
        and not any(f == s.removeprefix("segfuse/").rstrip("/") or f.endswith("/" + s.rstrip("/")) for f in files)
    ]
    assert not missing, f"docs/design.md names modules that are not in src/segfuse (nor tests/): {missing}"


def modules_to_name() -> list[str]:
    """What docs/design.md must name: every Python module under src/segfuse but `__init__.py` and `__main__.py`,
    and every folder that holds one (`backends/ray/`; a folder is written with its slash). Not modules, so
    not required: the web page's static assets (server/static/) and lm-eval's task files (YAML)."""
    modules = [f for f in package_paths() if f.endswith(".py") and f.rsplit("/", 1)[-1] not in INIT_FILES]
    folders = sorted({f.rsplit("/", 1)[0] + "/" for f in package_paths() if f.endswith(".py") and "/" in f})
    return sorted(modules) + folders


def names_module(span: str, module: str, everything: list[str]) -> bool:
    """Whether the `code` span names `module` (a path relative to src/segfuse; a folder ends with `/`): its
    whole path (`backends/ray/loop.py`, `segfuse/echo.py`), or a tail of it (`ray/loop.py`, `jobs.py`,
    `chat/`) that no other file or folder under src/segfuse ends with. So `echo.py` names src/segfuse/echo.py
    alone, and `member.py`, or `ray/`, names nothing: write `backends/ray/member.py`, `server/ray/`."""
    span = span.removeprefix("src/").removeprefix("segfuse/").rstrip("/")
    path = module.rstrip("/")
    if span == path:
        return True
    if not path.endswith("/" + span):
        return False
    return not any(other != path and (other == span or other.endswith("/" + span)) for other in everything)


def test_every_module_is_named_in_the_design():
    """The other direction: docs/design.md, the newcomer's map, names every module and folder of the package
    (`modules_to_name`), matched by `names_module`; a module added without a word on the map fails here."""
    everything = package_paths()
    spans = set(design_names())
    unnamed = [m for m in modules_to_name() if not any(names_module(s, m, everything) for s in spans)]
    assert not unnamed, (
        f"docs/design.md does not name these modules of src/segfuse: {unnamed}. Name each in `code` by its path "
        "(or a tail only it has), with a few words of what it is for, in the section of the house it belongs to "
        "(a list of the small ones is fine)"
    )


def test_a_module_is_named_by_its_path_or_a_tail_only_it_has():
    """`names_module` on a small package: a whole path always names; a tail names only where it is unique."""
    everything = ["echo.py", "server/jobs.py", "backends/ray", "backends/ray/member.py", "server/ray", "b/echo.py"]
    assert names_module("echo.py", "echo.py", everything)
    assert not names_module("echo.py", "b/echo.py", everything)  # echo.py is the root's module too
    assert names_module("jobs.py", "server/jobs.py", everything) and names_module("segfuse/echo.py", "echo.py", [])
    assert names_module("ray/member.py", "backends/ray/member.py", everything)
    assert not names_module("member.py", "backends/ray/member.py", [*everything, "remote/member.py"])
    assert not names_module("ray/", "backends/ray/", everything)  # server/ray ends with ray too
    assert names_module("backends/ray/", "backends/ray/", everything)
    assert not names_module("obs.py", "server/jobs.py", everything)  # a tail is whole names, not characters


def test_blocks_not_run_say_why():
    """Blocks the test does not run are few, and each gives its reason."""
    skipped = [b for b in BLOCKS if b.not_run is not None]
    assert all(len(b.not_run) > 10 for b in skipped), [b.name for b in skipped]
    assert len(skipped) < len(BLOCKS)


# --------------------------------------------------------------------------- the README's one-liners


def readme_one_liners() -> list[str]:
    """The commands of the README's "Use it from" table (its "one line" column) for other tools, where they
    leave nothing to fill in (the Python lines end in `messages=[...]`)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### Use it from", 1)[1].split("\n#", 1)[0]
    cells = [re.split(r"(?<!\\)\|", row)[2] for row in section.splitlines() if row.startswith("| ")]
    spans = [m.group(1).replace("\\|", "|") for cell in cells if (m := re.search(r"`([^`]+)`", cell))]
    return [s for s in spans if re.match(r"(curl|llm|lm_eval) ", s) and "..." not in s and "…" not in s]


@pytest.mark.models
@pytest.mark.timeout(1200)
def test_readme_one_liners_run(server, tmp_path):
    lines = readme_one_liners()
    assert {program(words(s)) for s in lines} == {"curl", "llm", "lm_eval"}, lines
    for line in lines:
        argv = words(line)
        env = {"LLM_USER_PATH": str(tmp_path)} if program(argv) == "llm" else {}
        output = run(limited(argv, tmp_path, server), env=env)
        if program(argv) == "curl":
            assert json.loads(output)["choices"][0]["text"]
        elif program(argv) == "lm_eval":  # a generation task, or a multiple-choice one (log-likelihoods)
            assert ("segfuse_gsm8k" in output and "exact_match" in output) or (
                "segfuse_bigbench" in output and "acc_norm" in output
            ), output[-2000:]
        else:
            assert output.strip()


# --------------------------------------------------------------------------- what the CLI says of itself


def help_text(*args: str) -> str:
    """`segfuse ARGS --help`, wide, box drawing and line breaks flattened."""
    text = run([executable("segfuse"), *args, "--help"], env={"COLUMNS": "240"})
    return " ".join(text.replace("│", " ").split())


@pytest.mark.slow
def test_help_tells_the_truth():
    assert "(over the config file's [defaults] table)" in help_text("serve")
    assert "1.0 at temperature 0, else 0.9" in help_text("eval")  # what eval runs record
    generate = help_text("generate")
    assert "--gate FLOAT|none" in generate and "--accept-margin FLOAT|none" in generate


def test_none_is_a_value_in_toml_and_llm_options(tmp_path):
    from segfuse.config import build_config

    (tmp_path / "segfuse.toml").write_text('[defaults]\ngate = "none"\naccept_margin = "None"\n')
    defaults = build_config(tmp_path / "segfuse.toml").fusion_defaults()
    assert defaults.gate is None and defaults.accept_margin is None
    from segfuse.llm_plugin import Segfuse

    options = Segfuse.Options(gate="none", accept_margin="NONE")
    assert (options.gate, options.accept_margin) == ("none", "none")
    with pytest.raises(Exception, match="gate"):
        Segfuse.Options(gate="never")


def test_calibrate_table_keeps_settings_apart_at_80_columns():
    from rich.console import Console

    from segfuse.cli.calibrate import calibration_table
    from segfuse.eval.calibrate import DEFAULT_GRID, Setting

    settings = [Setting("leader alone", 20, 40, 0, 0, 1.0, 20)]
    settings += [Setting(spec, 21, 40, 2, 1, 1.2 + i / 10, 20) for i, spec in enumerate(DEFAULT_GRID)]
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(calibration_table("gsm8k", settings, settings[2]))
    rows = [line for line in console.export_text().splitlines() if line.count("│") > 2]
    assert all(line.endswith("│") and len(line) <= 80 for line in rows)  # nothing cut at the right edge
    first_column = "".join(line.split("│")[1] for line in rows)
    assert "".join(first_column.split()) == "".join(
        (s.spec + (" ← chosen" if s is settings[2] else "")).replace(" ", "") for s in settings
    )


@pytest.mark.models
@pytest.mark.timeout(900)
def test_segfuse_lm_eval_refuses_unknown_model_args():
    done = run_lm_eval("segfuse-lm-eval", "segfuse", "system=default,max_tokns=8", "segfuse_gsm8k", 1, env=ENV)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "unknown model_args for the segfuse model: max_tokns" in done.stderr and "max_tokens" in done.stderr


@pytest.mark.models
@pytest.mark.timeout(900)
def test_token_array_prompts_are_the_leaders_tokens_and_others_a_clear_refusal(server):
    import httpx

    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "Once upon a time"}, timeout=60).json()["tokens"]
    for prompt in (ids, [ids, ids[:2]]):
        reply = httpx.post(f"{server.api}/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=300)
        assert reply.status_code == 200, reply.text
    for prompt, why in (([10**8], "is not in"), (7, "prompt"), ([[]], "empty")):
        reply = httpx.post(f"{server.api}/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=60)
        assert 400 <= reply.status_code < 500
        assert why in reply.json()["error"]["message"], reply.text


@pytest.mark.models
@pytest.mark.timeout(1200)
def test_bench_runs_to_its_table_naming_its_systems(tmp_path):
    """`make bench` (`segfuse bench`, i.e. `segfuse bench speed`) with a short answer and one repetition: the
    table, the JSON, the systems. (No users at once: test_bench_local times two.)"""
    args = ["--lengths", "12", "--reps", "1", "--users", "0", "--no-rss", "--out", str(tmp_path)]
    printed = run(
        [executable("segfuse"), "bench", "speed", *args],
        env={"COLUMNS": "240"},
    )
    report = json.loads((tmp_path / "bench.json").read_text())
    plain = report["systems"]["plain fusion"]
    assert plain["gate"] is None and plain["accept_margin"] is None
    assert report["systems"]["default (leader alone)"]["accept_margin"] == 0
    entry = report["lengths"]["12"]
    assert entry["fusion_tokens"]["median"] == entry["default_tokens"]["median"] == 12
    assert entry["floor"]["median"] > 0 and entry["leader_alone"]["median"] > 0
    assert "plain fusion: window=10, gate=none, accept_margin=none" in " ".join(printed.split())
    assert "default (leader alone)" in printed
