"""The serving options ``dsaindex serve``, ``runtime generate`` and ``runtime quality`` share
(pipelines/commands/serving_options.py): each command shows every one of them as declared there (flags,
default, help, type and range), and refuses a bad value of one with the same message, before anything
loads, so the runtime commands measure what a server would serve.
"""

import dataclasses

import pytest
import typer

from dsaindex.pipelines.commands import serving_options
from dsaindex.runtime.settings import DecodeSettings
from helpers import run_cli

COMMANDS = (("serve",), ("runtime", "generate"), ("runtime", "quality"))
# a command's own option under a shared name, where it means something else there
OWN = {"runtime generate": {"artifacts",  # one pq bundle; --ivf-artifacts names the ivf one
                            "prefill_chunk"}}  # none feeds the prompt at once, not the server's chunk
NOT_TAKEN = {"runtime generate": {"tracking_uri"}}


def _declarations() -> dict[str, typer.models.OptionInfo]:
    """The shared declarations by parameter name (``CANDIDATES`` -> ``candidates``)."""
    return {name.lower(): value for name, value in vars(serving_options).items()
            if isinstance(value, typer.models.OptionInfo)}


def _options(path: tuple[str, ...]) -> dict:
    from dsaindex.cli import app

    cmd = typer.main.get_command(app)
    for part in path:
        cmd = cmd.commands[part]
    return {param.name: param for param in cmd.params}


def _shown(param) -> tuple:
    """What ``--help`` shows of an option and how it parses: flags, default, help, type and range (typer wraps
    each command's callback apart: the bound checks are compared by what they refuse, below)."""
    return (tuple(param.opts), tuple(param.secondary_opts), param.default, param.required, param.help,
            param.multiple, param.is_flag, param.type_descriptor.annotation, param.min, param.max)


def test_the_commands_show_each_shared_option_as_declared():
    declared = _declarations()
    assert {"candidates", "prefilter", "recall_target", "exact_below", "ivf_budget", "ivf_recall_target",
            "prefill_chunk", "topk", "device", "basis", "allow_other_weights", "tracking_uri", "model",
            "artifacts"} <= set(declared)
    seen: dict[str, dict[str, tuple]] = {}
    for path in COMMANDS:
        command, options = " ".join(path), _options(path)
        for name, declaration in declared.items():
            if name in NOT_TAKEN.get(command, ()):
                assert name not in options, (command, name)
                continue
            assert name in options, f"`dsaindex {command}` lacks the shared option {name}"
            if name in OWN.get(command, ()):
                continue
            param = options[name]
            assert param.help == declaration.help, (command, name)
            if declaration.default is not ...:
                assert param.default == declaration.default, (command, name, param.default)
            seen.setdefault(name, {})[command] = _shown(param)
    for name, by_command in seen.items():
        assert len(set(by_command.values())) == 1, (name, by_command)
    assert {"runtime quality", "serve", "runtime generate"} == set(seen["candidates"])
    assert {"runtime quality", "serve"} == set(seen["prefill_chunk"])


def test_the_defaults_are_the_settings_fields():
    fields = {f.name: f.default for f in dataclasses.fields(DecodeSettings)}
    declared = _declarations()
    for name in ("candidates", "prefilter", "stage1", "recall_target", "exact_below", "long_prefix"):
        assert declared[name].default == fields[name], name


@pytest.mark.parametrize("bad, needle", [
    (["--candidates", "16", "--prefilter", "auto"], "--prefilter `auto` chooses each layer's stage 1"),
    (["--candidates", "lots"], "--candidates 'lots' is neither a positive count nor `auto`"),
    (["--prefilter", "0"], "--prefilter '0' is neither a positive factor nor `auto`"),
    (["--topk", "0"], "--topk"),
    (["--exact-below", "-1"], "--exact-below"),
    (["--ivf-budget", "0"], "--ivf-budget"),
    (["--recall-target", "1.5"], "--recall-target"),
    (["--long-prefix", "double"], "--long-prefix 'double' is not a rule for C past the measured prefixes"),
    (["--stage1", "bits"], "--stage1 'bits' is not a stage 1"),
])
def test_the_commands_refuse_a_bad_serving_option_alike_before_loading(tmp_path, bad, needle):
    missing = str(tmp_path / "no-bundle")  # nothing is read: the option is refused first
    problems = set()
    for path in COMMANDS:
        proc = run_cli(*path, "-m", "preset:no-such-model", "-a", missing, *bad, "--device", "cpu")
        assert proc.returncode == 2, (path, proc.stderr)
        line = proc.stderr.strip().splitlines()[0]
        assert line.startswith("error:") and needle in line and "Traceback" not in proc.stderr, (path, line)
        problems.add(line.split(" Fix: ")[0])
    assert len(problems) == 1, problems


def test_parse_decode_takes_the_text_forms():
    assert serving_options.parse_decode("auto", None, 0.9) == DecodeSettings(candidates="auto", recall_target=0.9)
    got = serving_options.parse_decode(" 64", "8", 0.99, exact_below=512, direct_upto=0)
    assert got == DecodeSettings(candidates=64, prefilter=8, recall_target=0.99, exact_below=512, direct_upto=0)
    assert serving_options.parse_decode("AUTO", "auto", 0.99).prefilter == "auto"
    assert serving_options.parse_decode("auto", None, 0.99, stage1=" Folds").stage1 == "folds"
