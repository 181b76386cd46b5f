"""One definition of every serving default and every ``DSAINDEX_*`` variable (runtime/settings.py).

The checks read the settings classes and the environment table, never a copy of a value: a command option
named like a settings field must default to that field's default; a library signature that still takes
such a parameter with a default must take the same one; the engine plugins read the environment only
through the table; the engines' READMEs show the table as :func:`environment_markdown` writes it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from dsaindex.coarse import PREFILTER
from dsaindex.errors import DsaIndexError
from dsaindex.runtime.settings import (
    ENGINES,
    ENVIRONMENT,
    DecodeSettings,
    PrefillSettings,
    ServeSettings,
    engine_settings,
    environment_markdown,
)

ROOT = Path(__file__).resolve().parent.parent
FIELDS = {f.name: f.default for kind in (DecodeSettings, PrefillSettings)
          for f in dataclasses.fields(kind)}
FIELDS |= {f.name: f.default for f in dataclasses.fields(ServeSettings)
           if f.default is not dataclasses.MISSING}


def _commands():
    import typer

    from dsaindex.cli import app

    root = typer.main.get_command(app)
    for path in (("serve",), ("runtime", "generate"), ("runtime", "check"), ("bench", "decode"), ("eval", "pq"),
                 ("bench", "frontier")):
        cmd = root
        for part in path:
            cmd = cmd.commands[part]
        yield " ".join(path), cmd


# benchmarks and evaluation sweep C themselves: there it is a measurement's setting, not a serving default
# the benches' stage 1: a comma list of the stage 1s to time (or measure), not one served choice
NOT_SERVING = {"bench decode": {"candidates", "prefilter", "exact_below", "pq_from"},
               "eval pq": {"candidates", "prefilter"}, "bench frontier": {"candidates", "prefilter", "stage1"},
               "bench paged": {"stage1"}}


def test_command_options_default_to_the_settings_fields():
    checked = 0
    for path, cmd in _commands():
        for param in cmd.params:
            if param.name not in FIELDS or param.name in NOT_SERVING.get(path, ()):
                continue
            want, got = FIELDS[param.name], param.default
            # options that also take `auto` are text: compare as the user reads them
            assert got == want or str(got) == str(want), (path, param.name, got, want)
            checked += 1
    assert checked >= 15, checked  # the decode/prefill/serve options of five commands


def test_library_signatures_default_to_the_settings_fields():
    from dsaindex.runtime.paged_select import PagedCacheSelector
    from dsaindex.runtime.pq_batch import PQDecodeGroup
    from dsaindex.runtime.transformers_adapter import RuntimeSelection, greedy_agreement
    from dsaindex.train.pq_job import evaluate_bundle_warm
    from dsaindex.train.warm_cache import warm_window_recall

    checked = 0
    for fn in (RuntimeSelection.__init__, greedy_agreement, PQDecodeGroup.__init__, PagedCacheSelector.__init__,
               warm_window_recall, evaluate_bundle_warm):
        for name, param in inspect.signature(fn).parameters.items():
            # the measured values; a group's own switches (direct_upto=0: the cached path) are the caller's to set
            if name in ("prefilter", "filter_width", "recall_target") and \
                    param.default is not inspect.Parameter.empty and param.default is not None:
                # a signature that takes a count of C takes the factor a count gets (prefilter None: with C)
                want = DecodeSettings(candidates=1).prefilter if name == "prefilter" else FIELDS[name]
                assert param.default == want, (fn.__qualname__, name, param.default, want)
                checked += 1
    assert checked >= 6, checked


def test_served_index_takes_typed_settings_not_loose_keywords():
    from dsaindex.runtime.serving import ServedIndex, serve_index

    assert list(inspect.signature(ServedIndex.__init__).parameters) == [
        "self", "model", "codecs", "routers", "settings", "reuse", "device"]
    assert "settings" in inspect.signature(serve_index).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(serve_index).parameters.values())


def test_flat_keywords_route_to_their_group_and_unknown_ones_are_refused():
    s = ServeSettings.of(candidates="auto", prefilter="auto", ivf_budget=4096, slots=3, filter_width=1.0)
    assert s.decode.candidates == "auto" and s.decode.prefilter == "auto" and s.decode.filter_width == 1.0
    assert s.prefill.ivf_budget == 4096 and s.slots == 3
    assert ServeSettings.of() == ServeSettings()
    with pytest.raises(TypeError, match="candidate"):
        ServeSettings.of(candidate=5)
    with pytest.raises(DsaIndexError, match="chooses each layer's stage 1 together with its C"):
        DecodeSettings(candidates=2048, prefilter="auto")
    assert DecodeSettings(candidates="4096", prefilter="8") == DecodeSettings(candidates=4096, prefilter=8)


def test_engines_read_the_one_table():
    env = {"DSAINDEX_ARTIFACTS": " /b ", "DSAINDEX_CANDIDATES": "auto", "DSAINDEX_PREFILTER": "auto",
           "DSAINDEX_RECALL_TARGET": "0.99", "DSAINDEX_ALLOW_OTHER_WEIGHTS": "yes"}
    for engine in ENGINES:
        s = engine_settings(engine, env)
        assert (s.artifacts, s.candidates, s.prefilter, s.recall_target, s.allow_other_weights) == \
               ("/b", "auto", "auto", 0.99, True)
        # unset: each field takes the table's default: C and stage 1 chosen per layer from the bundle's recall
        bare = engine_settings(engine, {})
        assert bare.artifacts is None and bare.decode(2048).candidates == "auto"
        assert bare.decode(2048).prefilter == "auto" and bare.recall_target == DecodeSettings().recall_target
        # a count given by hand: stage 1 at the runtime's factor unless set
        fixed = engine_settings(engine, {"DSAINDEX_CANDIDATES": "4096"})
        assert fixed.decode(2048).candidates == 4096
        assert fixed.decode(2048).prefilter == DecodeSettings(candidates=4096).prefilter == PREFILTER
        # C grows past the bundle's measured prefixes unless told to stay
        assert bare.long_prefix == "grow" and engine_settings(engine, {"DSAINDEX_LONG_PREFIX": " Fixed "}).long_prefix \
            == "fixed"
    assert engine_settings("sglang", {}).basis == "hadamard" and engine_settings("vllm", {}).basis == "raw"
    for name, bad, said in (("DSAINDEX_CANDIDATES", "lots", "neither a positive count nor `auto`"),
                            ("DSAINDEX_PREFILTER", "-2", "neither a positive factor nor `auto`"),
                            ("DSAINDEX_RECALL_TARGET", "99", "not a recall between 0 and 1"),
                            ("DSAINDEX_ALLOW_OTHER_WEIGHTS", "maybe", "not a yes/no value"),
                            ("DSAINDEX_BASIS", "rotated", "not a key basis"),
                            ("DSAINDEX_LONG_PREFIX", "double", "not a rule for C past the measured prefixes")):
        with pytest.raises(DsaIndexError, match=re.escape(said)) as err:
            engine_settings("vllm", {name: bad})
        assert name in err.value.problem and name in err.value.fix
    with pytest.raises(DsaIndexError, match="DSAINDEX_PREFILTER `auto` chooses"):
        engine_settings("sglang", {"DSAINDEX_CANDIDATES": "4096", "DSAINDEX_PREFILTER": "auto"})


def _plugin_sources() -> list[Path]:
    return sorted(p for e in ENGINES for p in (ROOT / "engines" / e / f"dsaindex_{e}").rglob("*.py"))


def test_plugins_read_no_environment_variable_of_their_own():
    """Only the table reads ``DSAINDEX_*``: no ``os.environ`` / ``os.getenv`` in the plugins' code."""
    for path in _plugin_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno} reads the environment itself")


def test_every_variable_named_in_the_engines_is_in_the_table():
    declared = {v.name for v in ENVIRONMENT}
    assert len(declared) == len(ENVIRONMENT)  # each declared once
    for path in _plugin_sources() + [ROOT / "engines" / e / "README.md" for e in ENGINES]:
        named = set(re.findall(r"DSAINDEX_[A-Z0-9_]+[A-Z0-9]", path.read_text()))
        assert named <= declared, (path.relative_to(ROOT), sorted(named - declared))


def test_engine_readmes_show_the_generated_table():
    block = re.compile(r"<!-- settings table: generated from dsaindex.runtime.settings.ENVIRONMENT -->\n(.*?)"
                       r"<!-- end of settings table -->", re.S)
    for engine in ENGINES:
        text = (ROOT / "engines" / engine / "README.md").read_text()
        found = block.search(text)
        assert found, f"engines/{engine}/README.md has no generated settings table"
        assert found.group(1) == environment_markdown(), f"engines/{engine}/README.md: regenerate the table"
