"""The mutation check's list (tests/mutation.py) still applies to the code as it is: every edit's text is found
exactly where it says (once in the project, or after the one definition it names), and every test it names exists.
Running the mutants is by hand (see the README)."""

import pytest

import mutation


TEXTS = mutation.sources(mutation.ROOT)


@pytest.mark.parametrize("mutant", mutation.MUTANTS, ids=lambda x: x.name)
def test_mutant_applies(mutant):
    changed = mutation.mutated(mutant, TEXTS)
    assert changed and all(TEXTS[where] != text for where, text in changed.items())


def test_a_mutant_survives_a_move_and_a_rewrap():
    """The same edit finds its code in another file, wrapped over other lines."""
    edit = mutation.Edit("if (ops.bias_hides) visible = b != -infinity<A>();", "")
    texts = {"a.cuh": "int x;\n", "b.cuh": "    if (ops.bias_hides)\n        visible = b != -infinity<A>();\n"}
    assert mutation.mutated(mutation.Mutant("moved", (edit,), (), ""), texts) == {"b.cuh": "    \n"}
    twice = dict(texts, **{"a.cuh": texts["b.cuh"]})
    with pytest.raises(ValueError, match="occurs 2 times"):
        mutation.mutated(mutation.Mutant("twice", (edit,), (), ""), twice)


def test_named_tests_exist():
    for mutant in mutation.MUTANTS:
        for node in mutant.tests:
            path, _, name = node.partition("::")
            text = (mutation.ROOT / path).read_text()
            assert not name or f"def {name}(" in text, f"{mutant.name}: no test {node}"


def test_names_are_unique():
    names = [x.name for x in mutation.MUTANTS]
    assert len(names) == len(set(names))
