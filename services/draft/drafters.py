"""The one registry that chooses a drafter implementation by name.

Every implementation is listed here, explicitly; each imports only the base types
(specdec.draft.base), never this module. The base types are re-exported for callers that take a
drafter from here.
"""
from __future__ import annotations

from specdec.core.errors import InvalidRequest
from specdec.draft import eagle_drafter, jacobi, layer_skip, model_drafter, ngram, tree_drafter
from specdec.draft.base import DraftConfig, Drafter, DrafterFactory, DraftSession  # noqa: F401 (re-exported)

# name (the request's `drafter` field) -> factory; a factory returns None when the configuration
# cannot serve that drafter (no draft model configured, ...).
REGISTRY: dict[str, DrafterFactory] = {
    "model": model_drafter.build,
    "ngram": ngram.build,
    "eagle": eagle_drafter.build,
    "jacobi": jacobi.build_jacobi,
    "lookahead": jacobi.build_lookahead,
    "layer_skip": layer_skip.build,
}


# name -> factory of a drafter built over others (sharing their model); None when it cannot be.
DERIVED = {
    "tree": tree_drafter.derive,
    "eagle_tree": eagle_drafter.derive,
}

# Every drafter name there is, built or derived: what `--drafter` may name (specdec/cli_common.py
# describes each, and tests/test_cli.py checks the two agree).
NAMES: tuple[str, ...] = tuple(sorted((*REGISTRY, *DERIVED)))


def build_drafters(config: DraftConfig) -> dict[str, Drafter]:
    """Every registered drafter this configuration can serve, by name."""
    built = {name: factory(config) for name, factory in REGISTRY.items()}
    drafters = {name: d for name, d in built.items() if d is not None}
    for name, derive in DERIVED.items():
        if (d := derive(drafters, config)) is not None:
            drafters[name] = d
    return drafters


def pick(drafters: dict[str, Drafter], name: str) -> Drafter:
    try:
        return drafters[name]
    except KeyError:
        raise InvalidRequest(f"unknown drafter {name[:64]!r}; this worker serves {sorted(drafters)}") from None
