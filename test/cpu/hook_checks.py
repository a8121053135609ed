"""Checks every AROUND hook of ours must pass against the installed SGLang."""
import importlib
import inspect

from sglang_h20 import compat


def assert_hook_takes_upstreams_parameters(target: str, hook) -> None:
    """`target` resolves in the installed SGLang, and `hook` takes `original` and then exactly its parameters
    (names and defaults): SGLang's HookRegistry passes the call through as made."""
    assert compat.check_target(target) == (True, target)
    module, _, name = target.rpartition(".")
    up = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    ours = list(inspect.signature(hook).parameters.values())[1:]  # after `original`
    assert [(p.name, p.default) for p in ours] == [(p.name, p.default) for p in up.values()], target
