"""The generic registry every extension point uses (environments, rollout backends, loggers): registration,
duplicate refusal naming both places, lookup errors naming the known entries and the entry-point group,
and entry-point plugins loaded once, by name or all at once."""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint

import pytest

from assay.core.errors import AssayError, UnknownEnvironmentError
from assay.core.registry import Registry, qualname

Factory = Callable[[int], int]
GROUP = "assay.test_registry"
PLUGINS = '''
def double(x):
    return 2 * x


def triple(x):
    return 3 * x


NOT_CALLABLE = 7
'''


def _adopt(registry: Registry[Factory], ep: EntryPoint, obj: object) -> None:
    if not callable(obj):
        raise registry.plugin_error(ep, "must name a function")
    adopted.append(ep.name)
    registry.add(ep.name, obj)


adopted: list[str] = []


@pytest.fixture
def plugins(monkeypatch, tmp_path):
    """A module of plugin factories on sys.path, imported afresh by each test."""
    (tmp_path / "assay_registry_plugins.py").write_text(PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "assay_registry_plugins", raising=False)
    adopted.clear()
    return [EntryPoint(name, f"assay_registry_plugins:{attr}", GROUP) for name, attr in
            (("double", "double"), ("triple", "triple"))]


def _registry(plugins: list[EntryPoint] | None = None) -> Registry[Factory]:
    return Registry("widget", "widgets", GROUP, _adopt).copy(plugins=plugins or [])


def _inc(x: int) -> int:
    return x + 1


def test_a_registered_entry_is_found_by_name():
    reg = _registry()

    @reg.register("inc")
    def inc(x: int) -> int:
        return x + 1

    assert reg.get("inc") is inc and reg.get("inc")(1) == 2
    assert reg.names() == ["inc"] and reg.entries() == {"inc": inc} and reg.origin("inc") == qualname(inc)


def test_registering_another_object_under_a_taken_name_names_both_places():
    reg = _registry()
    reg.add("inc", _inc)
    reg.add("inc", _inc)  # the same object again (a module imported twice): no clash
    with pytest.raises(AssayError) as e:
        reg.add("inc", lambda x: x + 1)
    assert str(e.value) == (f"widget 'inc' is registered twice ({__name__}._inc and {__name__}."
                            "test_registering_another_object_under_a_taken_name_names_both_places.<locals>.<lambda>); "
                            "rename one")
    assert reg.get("inc") is _inc  # the refused one did not replace it


def test_a_clash_says_the_registry_s_own_fix():
    reg = Registry("environment", "environments", GROUP, _adopt, fix="bump the version or rename one").copy(plugins=[])
    reg.add("toy@1", _inc)
    with pytest.raises(AssayError, match=r"'toy@1' is registered twice .*; bump the version or rename one$"):
        reg.add("toy@1", abs, origin="elsewhere.Toy")


@pytest.mark.parametrize("name", ["", " inc", "inc "])
def test_a_blank_or_padded_name_is_refused_at_once(name):
    with pytest.raises(AssayError, match="a widget needs a non-empty name without surrounding spaces"):
        _registry().register(name)


def test_an_unknown_name_lists_the_known_ones_and_the_entry_point_group(plugins):
    reg = _registry(plugins)
    reg.add("inc", _inc)
    with pytest.raises(AssayError) as e:
        reg.get("quadruple")
    assert str(e.value) == ("unknown widget 'quadruple'; known widgets: double, inc, triple (a plugin adds one "
                            "through the 'assay.test_registry' entry-point group)")
    assert "assay_registry_plugins" not in sys.modules  # listing the plugins imports none of them


def test_an_unknown_name_raises_the_registry_s_error_type():
    reg = Registry("environment", "environments", GROUP, _adopt, unknown=UnknownEnvironmentError).copy(plugins=[])
    with pytest.raises(UnknownEnvironmentError, match="known environments: none"):
        reg.get("arith")


def test_a_plugin_is_loaded_by_name_once_when_first_looked_up(plugins):
    reg = _registry(plugins)
    assert reg.names() == ["double", "triple"] and adopted == []
    assert reg.get("double")(4) == 8 and reg.get("double")(5) == 10
    assert adopted == ["double"]  # once, and the other plugin not at all


def test_load_all_adopts_every_plugin_once(plugins):
    reg = _registry(plugins)
    reg.load_all()
    reg.load_all()
    assert adopted == ["double", "triple"] and sorted(reg.entries()) == ["double", "triple"]


def test_a_broken_plugin_is_named_and_keeps_failing(plugins):
    broken = EntryPoint("broken", "no_such_module_xyz:f", GROUP)
    reg = _registry([*plugins, broken])
    for _ in range(2):  # not marked loaded after a failure: it fails loudly again, never vanishes
        with pytest.raises(AssayError, match=r"widget plugin 'broken' \(no_such_module_xyz:f\) failed to load: "
                                             "No module named 'no_such_module_xyz'"):
            reg.load_all()
    with pytest.raises(AssayError, match="failed to load"):
        reg.get("broken")


def test_a_plugin_naming_the_wrong_kind_of_object_is_refused_by_the_adopter(plugins):
    wrong = EntryPoint("seven", "assay_registry_plugins:NOT_CALLABLE", GROUP)
    reg = _registry([wrong])
    with pytest.raises(AssayError, match=r"widget plugin 'seven' \(assay_registry_plugins:NOT_CALLABLE\) must name a "
                                         "function"):
        reg.get("seven")


def test_a_plugin_that_is_also_registered_by_its_module_is_no_clash(plugins):
    import importlib

    reg = _registry(plugins)
    module = importlib.import_module("assay_registry_plugins")
    reg.add("double", module.double)  # a built-in that its package also declares as an entry point
    reg.load_all()
    assert reg.get("double") is module.double


def test_a_copy_is_a_registry_of_its_own():
    reg = _registry()
    reg.add("inc", _inc)
    scratch = reg.copy()
    scratch.add("dec", lambda x: x - 1)
    assert "dec" in scratch.names() and "dec" not in reg.names() and scratch.get("inc") is _inc
