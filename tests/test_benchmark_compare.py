"""`benchmarks.compare --only`: the methods it names, in that order; an unknown one refused."""

import argparse

import pytest

from benchmarks.common import pick_methods
from benchmarks.compare import objectives_at


def test_only_keeps_the_named_methods_in_the_order_given():
    methods = objectives_at(2)
    picked = pick_methods(methods, "rloo-k2,tb-k2", argparse.ArgumentParser())
    assert list(picked) == ["rloo-k2", "tb-k2"]
    assert pick_methods(methods, None, argparse.ArgumentParser()) is methods


def test_an_unknown_method_is_refused_in_one_line_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        pick_methods(objectives_at(2), "tb-k3", argparse.ArgumentParser(prog="compare"))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--only: unknown tb-k3; choose from tb-k2, tb-plain-k2" in error
