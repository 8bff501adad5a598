"""Optimizer names, hyperparameters and their validation (no math here).

Workers validate ``kv.set_optimizer(...)`` with this module before anything is sent, so a typo
fails at once on the caller's line; servers validate again on receipt, because a server never
trusts a client. The update rules themselves live in :mod:`kvstore.server.optimizers`.

Hyperparameters follow MXNet's names and defaults:

==========  ==================================================================================
``sgd``     ``learning_rate=0.01, momentum=0.0, nesterov=False, momentum_every=1, wd=0.0,
            rescale_grad=1.0, clip_gradient=None``
``adam``    ``learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.0,
            rescale_grad=1.0, clip_gradient=None``
``dcasgd``  ``learning_rate=0.01, momentum=0.0, lamda=0.04, wd=0.0, rescale_grad=1.0,
            clip_gradient=None``
==========  ==================================================================================

``lr`` is accepted as an alias of ``learning_rate``. ``momentum_every`` (an int >= 1) is not
MXNet's: with ``momentum_every=N > 1`` (``nesterov=True`` only) the servers run delayed Nesterov
(Liu et al. 2024), which applies the momentum once every N updates of a chunk and plain steps in
between. ``lamda`` (MXNet's spelling) scales ``dcasgd``'s delay compensation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.errors import OptimizerError, did_you_mean

Check = Callable[[str, str, Any], Any]


def _number(opt: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:  # numpy scalars
            import numpy as np  # noqa: PLC0415

            if isinstance(value, np.integer | np.floating):
                value = float(value)
            else:
                raise TypeError
        except TypeError:
            raise OptimizerError(
                f"optimizer {opt!r}: {name} must be a number, got {type(value).__name__} {value!r}"
            ) from None
    value = float(value)
    if not math.isfinite(value):
        raise OptimizerError(f"optimizer {opt!r}: {name} must be finite, got {value!r}")
    return value


def _non_negative(opt: str, name: str, value: Any) -> float:
    value = _number(opt, name, value)
    if value < 0:
        raise OptimizerError(f"optimizer {opt!r}: {name} must be >= 0, got {value!r}")
    return value


def _positive(opt: str, name: str, value: Any) -> float:
    value = _number(opt, name, value)
    if not value > 0:
        raise OptimizerError(f"optimizer {opt!r}: {name} must be > 0, got {value!r}")
    return value


def _unit_interval(opt: str, name: str, value: Any) -> float:
    value = _number(opt, name, value)
    if not 0 <= value < 1:
        raise OptimizerError(f"optimizer {opt!r}: {name} must be in [0, 1), got {value!r}")
    return value


def _any_finite(opt: str, name: str, value: Any) -> float:
    return _number(opt, name, value)


def _optional_positive(opt: str, name: str, value: Any) -> float | None:
    if value is None:
        return None
    return _positive(opt, name, value)


def _count(opt: str, name: str, value: Any) -> int:
    """An int >= 1 (numpy integers too); bools and floats are refused, even 2.0, because a
    count that is not a whole number is a mistake, not a rounding matter."""
    if isinstance(value, bool) or not isinstance(value, int):
        import numpy as np  # noqa: PLC0415

        if not isinstance(value, np.integer):
            raise OptimizerError(
                f"optimizer {opt!r}: {name} must be an int, got {type(value).__name__} {value!r}"
            )
        value = int(value)
    if value < 1:
        raise OptimizerError(f"optimizer {opt!r}: {name} must be >= 1, got {value!r}")
    return value


def _boolean(opt: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise OptimizerError(
            f"optimizer {opt!r}: {name} must be True or False, got {type(value).__name__}"
        )
    return value


# name -> (default, check), per optimizer
_PARAMS: dict[str, dict[str, tuple[Any, Check]]] = {
    "sgd": {
        "learning_rate": (0.01, _non_negative),
        "momentum": (0.0, _unit_interval),
        "nesterov": (False, _boolean),
        "momentum_every": (1, _count),
        "wd": (0.0, _non_negative),
        "rescale_grad": (1.0, _any_finite),
        "clip_gradient": (None, _optional_positive),
    },
    "adam": {
        "learning_rate": (0.001, _non_negative),
        "beta1": (0.9, _unit_interval),
        "beta2": (0.999, _unit_interval),
        "epsilon": (1e-8, _positive),
        "wd": (0.0, _non_negative),
        "rescale_grad": (1.0, _any_finite),
        "clip_gradient": (None, _optional_positive),
    },
    "dcasgd": {
        "learning_rate": (0.01, _non_negative),
        "momentum": (0.0, _unit_interval),
        "lamda": (0.04, _non_negative),
        "wd": (0.0, _non_negative),
        "rescale_grad": (1.0, _any_finite),
        "clip_gradient": (None, _optional_positive),
    },
}

_ALIASES = {"lr": "learning_rate"}


def optimizer_names() -> list[str]:
    """Names of the server-side optimizers."""
    return sorted(_PARAMS)


@dataclass(frozen=True)
class OptimizerSpec:
    """A validated optimizer choice: its name and every hyperparameter (defaults filled in).

    Attributes:
        name: ``"sgd"``, ``"adam"`` or ``"dcasgd"``.
        params: all hyperparameters, as sent on the wire.
    """

    name: str
    params: dict[str, Any]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{self.name}({args})"

    def __getitem__(self, name: str) -> Any:
        return self.params[name]


def make_optimizer_spec(name: Any, params: dict[str, Any] | None = None) -> OptimizerSpec:
    """Validate an optimizer name and hyperparameters.

    Raises:
        OptimizerError: unknown optimizer (the message lists the known ones), unknown
            hyperparameter (the message lists the accepted ones), or a bad value; an unknown
            name gets the closest known one suggested.
    """
    if not isinstance(name, str):
        raise OptimizerError(f"expected str for optimizer name, got {type(name).__name__}")
    schema = _PARAMS.get(name.lower())
    if schema is None:
        known = optimizer_names()
        raise OptimizerError(
            f"unknown optimizer {name!r}{did_you_mean((name,), known)}; "
            f"available: {', '.join(known)}"
        )
    name = name.lower()
    given = dict(params or {})
    for alias, canonical in _ALIASES.items():
        if alias in given:
            if canonical in given:
                raise OptimizerError(f"optimizer {name!r}: give {canonical} or {alias}, not both")
            given[canonical] = given.pop(alias)
    unknown = set(given) - set(schema)
    if unknown:
        names = sorted(unknown)
        raise OptimizerError(
            f"optimizer {name!r} has no hyperparameter(s) {names}"
            f"{did_you_mean(names, [*schema, *_ALIASES])}; accepted: {', '.join(sorted(schema))}"
        )
    values = {}
    for param, (default, check) in schema.items():
        values[param] = check(name, param, given.get(param, default))
    _check_combination(name, values)
    return OptimizerSpec(name=name, params=values)


def _check_combination(name: str, values: dict[str, Any]) -> None:
    """Refuse hyperparameters that are valid one by one but not together."""
    if name == "sgd" and values["momentum_every"] > 1 and not values["nesterov"]:
        raise OptimizerError(
            f"optimizer 'sgd': momentum_every={values['momentum_every']} needs nesterov=True "
            f"(delayed Nesterov applies Nesterov momentum once every momentum_every updates)"
        )
