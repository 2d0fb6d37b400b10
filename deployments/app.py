"""The application builder named by ray_config.yaml: `deployments.app:build_app`."""

from __future__ import annotations

from ray.serve import Application

from deployments.config import AppConfig
from deployments.coordinator import Coordinator
from deployments.workers import Draft, Target

__all__ = ["AppConfig", "build_app"]


def build_app(args: dict | None = None) -> Application:
    """The Coordinator bound to a Draft and a Target pool, from the `args:` of the app."""
    config = AppConfig.model_validate(args or {})
    return Coordinator.options(**config.coordinator_options).bind(
        Draft.options(**config.draft_options).bind(config.draft.model_dump(), config.cache_dir),
        Target.options(**config.target_options).bind(config.target.model_dump(), config.cache_dir),
        config.model_dump(exclude={"coordinator_options", "draft_options", "target_options"}),
    )
