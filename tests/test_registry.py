"""The plug-in registries: names taken and replaced, the read-only view, errors that list the known
names, plug-ins found through an installed distribution's entry points (``tests/plugins``), and
the evaluation types' names."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dlscale import DlscaleError, registry
from dlscale.data import DataSet
from dlscale.encoding import THRESHOLD_ALGORITHMS, ThresholdAlgorithm, threshold_algorithm
from dlscale.evaluation import BaseEvaluation, Evaluation
from dlscale.nn import losses, model_factory
from dlscale.registry import NameTakenError, PluginImportError, Registry, UnknownNameError

PLUGINS = Path(__file__).parent / "plugins"


@pytest.fixture
def restored() -> Iterator[None]:
    """Registries are process-wide: put back what each held before the test."""
    saved = {kind: dict(registry.get(kind).view) for kind in registry.KINDS}
    yield
    for kind, entries in saved.items():
        kept = registry.get(kind)._entries  # the view is read-only; the registry's own dict is not
        kept.clear()
        kept.update(entries)


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch, restored: None) -> Iterator[None]:
    """The example plug-in distribution, installed (on ``sys.path``) for one test."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    yield
    sys.modules.pop("dlscale_example_plugin", None)


class Widget:
    def __init__(self, size: int = 1) -> None:
        self.size = size


class Gadget(Widget):
    pass


# -- the registry itself --------------------------------------------------------------------------
def test_a_taken_name_is_refused_unless_clobbered() -> None:
    widgets = Registry("widget", Widget)
    widgets.register("a", Widget)
    widgets.register("a", Widget)  # the same object again: nothing changes
    with pytest.raises(NameTakenError, match=r"widget 'a' is already registered as .*Widget.*clobber=True") as info:
        widgets.register("a", Gadget)
    assert isinstance(info.value, ValueError) and isinstance(info.value, DlscaleError)
    assert widgets.view["a"] is Widget
    widgets.register("a", Gadget, clobber=True)
    assert widgets.view["a"] is Gadget


def test_the_view_is_read_only_and_live() -> None:
    widgets = Registry("widget", Widget)
    view = widgets.view
    with pytest.raises(TypeError):
        view["a"] = Widget  # type: ignore[index]
    with pytest.raises(TypeError):
        del view["a"]  # type: ignore[attr-defined]
    widgets.register("a", Widget)
    assert dict(view) == {"a": Widget}


def test_an_unknown_name_lists_the_known_ones() -> None:
    widgets = Registry("widget", Widget, "garden widget")
    widgets.register("b", Gadget)
    widgets.register("a", Widget)
    with pytest.raises(UnknownNameError, match=r"unknown garden widget 'c'; known: a, b \(.*'dlscale\.widget'") as info:
        widgets.resolve("c")
    assert isinstance(info.value, ValueError) and isinstance(info.value, DlscaleError)
    assert widgets.names() == ["a", "b"]


def test_resolve_makes_classes_and_passes_instances_through() -> None:
    widgets = Registry("widget", Widget)
    shared = Widget(7)
    widgets.register("plain", Widget)
    widgets.register("shared", shared)
    made = widgets.resolve("plain", size=3)
    assert type(made) is Widget and made.size == 3
    assert widgets.resolve("shared") is shared
    mine = Gadget()
    assert widgets.resolve(mine) is mine
    with pytest.raises(TypeError, match="keyword arguments"):
        widgets.resolve(mine, size=2)
    with pytest.raises(TypeError, match="an instance; it takes no keyword arguments"):
        widgets.resolve("shared", size=2)
    with pytest.raises(TypeError, match="a widget is a Widget or a registered name, not int"):
        widgets.resolve(3)


def test_only_the_kind_and_string_names_are_registered() -> None:
    widgets = Registry("widget", Widget)
    with pytest.raises(TypeError, match="not a Widget"):
        widgets.register("int", int)
    with pytest.raises(TypeError, match="not a Widget"):
        widgets.register("three", 3)
    with pytest.raises(TypeError, match="non-empty string"):
        widgets.register("", Widget)
    assert not widgets.view


def test_every_kind_has_a_registry() -> None:
    for kind in registry.KINDS:
        assert registry.get(kind).kind == kind and registry.get(kind).group == f"dlscale.{kind}"
    with pytest.raises(UnknownNameError, match="unknown kind of plug-in 'widget'; known: threshold_algorithm"):
        registry.get("widget")


def test_register_in_code(restored: None) -> None:
    class Always(ThresholdAlgorithm):
        def _next(self, sparsity: float, length: int | None) -> float:
            return self._threshold

    registry.register("threshold_algorithm", "always", Always)
    assert THRESHOLD_ALGORITHMS["always"] is Always
    assert threshold_algorithm("always", threshold=0.5).threshold == 0.5
    with pytest.raises(NameTakenError, match="threshold algorithm 'adaptive' is already registered"):
        registry.register("threshold_algorithm", "adaptive", Always)
    assert registry.resolve("threshold_algorithm", "adaptive").__class__.__name__ == "AdaptiveThresholdAlgorithm"


# -- plug-ins from entry points -------------------------------------------------------------------
def test_a_plugin_is_found_by_name(plugins: None) -> None:
    assert "step" not in THRESHOLD_ALGORITHMS
    assert "step" in registry.get("threshold_algorithm").names()  # offered, not yet loaded
    algorithm = threshold_algorithm("step", target=0.1)
    assert type(algorithm).__module__ == "dlscale_example_plugin" and isinstance(algorithm, ThresholdAlgorithm)
    assert [algorithm.update(s) for s in (0.0, 0.5, 0.1)] == [5e-4, 1e-3, 1e-3]
    assert THRESHOLD_ALGORITHMS["step"] is type(algorithm)  # registered once found
    with pytest.raises(UnknownNameError, match="known: adaptive, fixed, step, target_sparsity"):
        threshold_algorithm("stepp")


def test_a_plugin_loss_trains_a_network(plugins: None) -> None:
    from dlscale.nn import Network

    assert losses.resolve("absolute_error") == "absolute_error"
    output, labels = torch.tensor([[1.0, -2.0], [0.5, 0.0]]), torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    assert losses.named_loss("absolute_error", output, labels, None).item() == pytest.approx(1.125)
    network = Network(torch.nn.Linear(2, 2), "absolute_error", lambda p: torch.optim.SGD(p, lr=0.05))
    batch = DataSet(torch.randn(64, 2, generator=torch.Generator().manual_seed(0)), torch.zeros(64, 2))
    before = network.score(batch)
    assert before == pytest.approx(torch.nn.functional.l1_loss(network.output(batch.features), batch.labels).item())
    network.fit(batch, epochs=20)
    assert network.score(batch) < before


def test_a_broken_plugin_names_its_distribution(plugins: None) -> None:
    with pytest.raises(PluginImportError, match=r"loss 'missing' from distribution dlscale-example-plugin") as info:
        losses.resolve("missing")
    assert isinstance(info.value, ImportError) and "dlscale_example_plugin_not_installed:loss" in str(info.value)
    with pytest.raises(UnknownNameError, match="or pass a callable"):
        losses.resolve("hinge")


def test_a_plugin_evaluation_is_found_when_its_json_is_read(plugins: None) -> None:
    text = json.dumps({"type": "ExampleCount", "version": 1, "settings": {}, "accumulated": {"count": 3}})
    restored = BaseEvaluation.from_json(text)
    assert type(restored).__name__ == "ExampleCount" and restored.count == 3
    assert restored.to_json() == text


def test_without_the_plugin_the_name_is_unknown() -> None:
    with pytest.raises(UnknownNameError, match="unknown threshold algorithm 'step'"):
        threshold_algorithm("step")


# -- evaluation types' names ----------------------------------------------------------------------
def test_a_subclass_named_like_a_built_in_keeps_its_own_name(restored: None) -> None:
    class Evaluation(BaseEvaluation):  # the built-in's name, in another module
        def __init__(self) -> None:
            self.n = 0

        def eval(self, labels, predictions, mask=None) -> None:
            self.n += 1

        def _settings(self) -> dict:
            return {}

        def _accumulated(self) -> dict:
            return {"n": self.n}

        def _restore(self, accumulated: dict) -> None:
            self.n = accumulated["n"]

        def _merge(self, other: BaseEvaluation) -> None:
            self.n += other.n  # type: ignore[attr-defined]

        def reset(self) -> None:
            self.n = 0

        def stats(self) -> str:
            return str(self.n)

    mine = Evaluation()
    mine.eval([0], [[1.0, 0.0]])
    assert Evaluation.type_name == f"{__name__}.{Evaluation.__qualname__}"
    assert type(BaseEvaluation.from_json(mine.to_json())) is Evaluation
    builtin = BaseEvaluation.from_json(_builtin_evaluation_json())
    assert type(builtin) is not Evaluation and type(builtin).type_name == "Evaluation"

    with pytest.raises(NameTakenError, match="evaluation type 'Evaluation' is already registered"):

        class Imposter(Evaluation, type_name="Evaluation"):
            pass

    class Counted(Evaluation, type_name="Counted"):
        pass

    assert registry.get("evaluation").view["Counted"] is Counted
    assert type(BaseEvaluation.from_json(Counted().to_json())) is Counted


def test_defining_a_type_again_replaces_it(restored: None) -> None:
    def define() -> type[BaseEvaluation]:
        class Again(Evaluation):
            pass

        return Again

    first, second = define(), define()
    assert first.type_name == second.type_name
    assert registry.get("evaluation").view[second.type_name] is second


def test_abstract_types_are_not_registered(restored: None) -> None:
    before = dict(registry.get("evaluation").view)

    class Partial(BaseEvaluation):
        def eval(self, labels, predictions, mask=None) -> None:
            pass

    assert dict(registry.get("evaluation").view) == before
    with pytest.raises(TypeError, match="abstract"):

        class Named(BaseEvaluation, type_name="Named"):
            pass


def _builtin_evaluation_json() -> str:
    e = Evaluation()
    e.eval([0, 1], [[0.9, 0.1], [0.2, 0.8]])
    return e.to_json()


# -- network factories ----------------------------------------------------------------------------
def test_model_factory_registers_by_qualified_name(restored: None) -> None:
    def define() -> object:
        @model_factory
        def tiny(width: int = 2) -> torch.nn.Module:
            return torch.nn.Linear(width, 1)

        return tiny

    first = define()
    name = f"{__name__}:{first.__qualname__}"
    assert first.factory_name == name and registry.get("model_factory").view[name] is first
    second = define()  # its definition run again
    assert registry.get("model_factory").view[name] is second
