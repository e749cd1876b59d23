"""The mutation check's list (tests/mutation.py) still applies to the code as it is: every edit's text occurs
exactly once in its file, and every test it names exists. Running the mutants is by hand (see the README)."""

import pytest

import mutation


@pytest.mark.parametrize("mutant", mutation.MUTANTS, ids=lambda x: x.name)
def test_mutant_applies(mutant):
    text = (mutation.ROOT / mutant.file).read_text()
    assert mutation.mutated(mutant, text) != text


def test_named_tests_exist():
    for mutant in mutation.MUTANTS:
        for node in mutant.tests:
            path, _, name = node.partition("::")
            text = (mutation.ROOT / path).read_text()
            assert not name or f"def {name}(" in text, f"{mutant.name}: no test {node}"


def test_names_are_unique():
    names = [x.name for x in mutation.MUTANTS]
    assert len(names) == len(set(names))
