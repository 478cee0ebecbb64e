"""Server-wide rule settings from flags or ``TRAINDX_*`` variables, validated before the server starts.

    traindx serve --rule mypkg.rules:LossSpike --rule-param dead_relu.threshold=0.8 --disable-rule step_time_outlier
    TRAINDX_RULES=mypkg.rules:LossSpike TRAINDX_RULE_PARAMS=dead_relu.threshold=0.8 TRAINDX_DISABLE_RULES=... traindx serve
"""

from __future__ import annotations

import os

from .pipeline.engine import Engine, EngineSettings
from .rules import load


def _split(value: str | None) -> list[str]:
    return [x.strip() for x in (value or "").replace(";", ",").split(",") if x.strip()]


def engine_settings(rules: list[str] = (), params: list[str] = (), disabled: list[str] = (), *,
                    env: dict | None = None) -> EngineSettings:
    """Build and check the settings; raise ValueError saying what is wrong."""
    env = os.environ if env is None else env
    rules = [*_split(env.get("TRAINDX_RULES")), *rules]
    params = [*_split(env.get("TRAINDX_RULE_PARAMS")), *params]
    disabled = [*_split(env.get("TRAINDX_DISABLE_RULES")), *disabled]
    settings = EngineSettings(extra_rules=[load(r) for r in rules], disabled=set(disabled))
    for item in params:
        key, eq, value = item.partition("=")
        rule, dot, param = key.strip().partition(".")
        if not eq or not dot or not rule or not param:
            raise ValueError(f"a rule parameter looks like 'rule.param=value', got {item!r}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: the value must be a number") from None
        settings.rule_params.setdefault(rule, {})[param] = number
    Engine(settings)  # fails now, with a clear message, on an unknown rule or parameter
    return settings
