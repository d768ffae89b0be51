"""EngineOptions: one spelling and one default per option in the resource, `specdeploy plan` and
`engine serve`; the older spellings still parse, unshown."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from specdeploy.cli import build_parser
from specdeploy.engine.planner.cli import PLAN_OPTIONS
from specdeploy.engine.planner.options import (DEFAULTS, EngineOptions, default_context_length, flag, option,
                                               options_from_args, resource_fields)
from specdeploy.engine.planner.plan import Limits, SpecSettings

CRD = Path(__file__).resolve().parents[3] / "manifests" / "crd" / "specdeploy.dev_specdecodedeployments.yaml"
COMMANDS = {"plan": ["plan", "--target", "t"], "serve": ["engine", "serve", "--target", "t"]}


def subcommand(argv: list[str]):
    """The argparse parser of `specdeploy plan` or `specdeploy engine serve`."""
    parser = build_parser()
    for word in argv[:-2]:
        parser = next(a for a in parser._actions if a.choices and word in a.choices).choices[word]
    return parser


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("old", "new"), [("--steps", "--num-steps"), ("--draft-tokens", "--num-draft-tokens")])
def test_an_older_spelling_parses_to_the_same_value_and_is_not_shown(command, old, new):
    argv = COMMANDS[command]
    name = new.removeprefix("--").replace("-", "_")
    old_args = build_parser().parse_args([*argv, old, "5"])
    assert getattr(old_args, name) == getattr(build_parser().parse_args([*argv, new, "5"]), name) == 5
    help_text = subcommand(argv).format_help()
    assert new in help_text and old not in help_text.replace(new, "")


@pytest.mark.parametrize("command", COMMANDS)
def test_left_out_the_older_spelling_keeps_the_default(command):
    args = build_parser().parse_args(COMMANDS[command])
    assert args.num_steps == (DEFAULTS.num_steps if command == "plan" else None)
    assert args.num_draft_tokens is None


def test_both_commands_spell_the_plans_options_alike():
    for command in COMMANDS.values():
        flags = {s for a in subcommand(command)._actions for s in a.option_strings}
        assert {flag(name) for name in PLAN_OPTIONS} <= flags


def test_serve_leaves_the_shared_options_unset_and_they_resolve_to_the_defaults():
    args = build_parser().parse_args(COMMANDS["serve"])
    assert all(getattr(args, name) is None for name in PLAN_OPTIONS)
    assert options_from_args(args) == DEFAULTS
    given = build_parser().parse_args([*COMMANDS["serve"], "--num-steps", "4", "--no-prefix-cache"])
    assert options_from_args(given) == EngineOptions(num_steps=4, prefix_cache=False)


def test_the_planners_defaults_are_the_options():
    assert (SpecSettings().num_steps, SpecSettings().topk, SpecSettings().num_draft_tokens) == (
        DEFAULTS.num_steps, DEFAULTS.topk, DEFAULTS.num_steps + 1)
    assert (Limits().max_running_requests, Limits().context_length) == (
        DEFAULTS.max_running_requests, DEFAULTS.context_length)


@pytest.mark.parametrize(("config", "expected"), [
    ({"max_position_embeddings": 4096}, 4096),
    ({"max_position_embeddings": 131072}, 8192),
    ({"text_config": {"max_position_embeddings": 2048}}, 2048),
    ({}, 8192),
    ({"max_position_embeddings": True}, 8192),
])
def test_the_default_context_length_is_capped_at_the_targets_maximum(config, expected):
    assert default_context_length(config) == expected
    assert "max_position_embeddings when smaller" in option("context_length").help


def test_the_resources_defaults_are_the_options():
    crd = yaml.safe_load(CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    fields = resource_fields()
    assert set(fields) == {f for f in vars(DEFAULTS)}
    for name, where in fields.items():
        section, key = where.split(".")
        schema = spec[section]["properties"][key]
        assert schema.get("default") == getattr(DEFAULTS, name), where


def test_the_operator_docs_table_is_the_options():
    script = Path(__file__).resolve().parents[3] / "hack" / "options-table.py"
    spec = importlib.util.spec_from_file_location("options_table", script)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    doc = table.DOC.read_text()
    assert table.rendered(doc) == doc, "docs/operator.md: run hack/options-table.py"
    assert "`engine.contextLength` | `--context-length`" in doc
