"""Refusals name the actual problem, the HOP, and the line of the user's code: two aliased inputs,
an output aliasing an input, a mutation of outer state torch_ext cannot replay."""
import pytest
import torch
import torch._dynamo
from torch.utils.checkpoint import checkpoint

# HOP tracing is where torch versions differ most: these run on every CI torch, never sharded.
pytestmark = pytest.mark.every_version

region = torch.compiler.nested_compile_region


@region
def two_inputs(x, y):
    return torch.cos(x @ y.t()), torch.sin(y)


def aliased_inputs(x):
    return two_inputs(x, x.view(1, 8))  # LINE: aliased inputs


@region
def scales_in_place(x):
    return x.mul_(2)


def output_aliases_input(x):
    return scales_in_place(x.clone()) + 1  # LINE: output aliases input


def checkpoint_appends(x):
    seen = []

    def body(t):
        seen.append(t.sin())
        return t.cos()

    return checkpoint(body, x, use_reentrant=False) + seen[0]  # LINE: checkpoint side effect


def _error(fn, x):
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(fn, backend="eager", fullgraph=True)(x)
    return str(info.value)


def _line_of(marker):
    import inspect

    source = inspect.getsource(inspect.getmodule(_line_of)).splitlines()
    return next(i for i, line in enumerate(source, 1) if f"# LINE: {marker}" in line)


def test_aliased_inputs_are_named_as_such(installed):
    message = _error(aliased_inputs, torch.randn(1, 8))
    assert "torch_ext: invoke_subgraph inputs alias each other" in message
    assert "output aliases" not in message  # issue 50: the headline named outputs
    assert f"line {_line_of('aliased inputs')}" in message


def test_output_aliasing_an_input_is_named_as_such(installed):
    message = _error(output_aliases_input, torch.randn(4))
    assert "torch_ext: invoke_subgraph output aliases an input" in message
    assert f"line {_line_of('output aliases input')}" in message


def test_outer_mutation_in_a_checkpoint_is_refused_naming_it(installed):
    # torch refuses it too (its checkpoint recomputes the body in backward): the same refusal.
    message = _error(checkpoint_appends, torch.randn(4))
    assert "side effect" in message.lower() or "mutating a variable" in message.lower()
    assert f"line {_line_of('checkpoint side effect')}" in message
