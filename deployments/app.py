"""The application builder named by ray_config.yaml: `deployments.app:build_app`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from ray.serve import Application

from deployments.coordinator import Coordinator, CoordinatorConfig
from deployments.workers import Draft, RunnerConfig, Target


class AppConfig(BaseModel):
    """The `args:` block of the application in ray_config.yaml."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str = "specdec-qwen2.5-coder"
    num_speculative_tokens: int = Field(4, ge=0, le=16)
    cache_dir: str | None = None  # where the default pair is converted; None = ~/.cache/specdec
    draft: RunnerConfig = RunnerConfig(model="default-draft")
    target: RunnerConfig = RunnerConfig(model="default-target")
    # Serve deployment options (num_replicas, autoscaling_config, ray_actor_options, ...) for
    # Python callers of build_app; a Serve config file sets these in its `deployments:` list.
    coordinator_options: dict = {}
    draft_options: dict = {}
    target_options: dict = {}
    draft_retry_timeout_s: float = 30.0


def build_app(args: dict | None = None) -> Application:
    config = AppConfig.model_validate(args or {})
    draft_cfg = config.draft.model_copy(update={"cache_dir": config.draft.cache_dir or config.cache_dir})
    target_cfg = config.target.model_copy(update={"cache_dir": config.target.cache_dir or config.cache_dir})
    coordinator_cfg = CoordinatorConfig(
        served_model_name=config.served_model_name,
        draft_model=config.draft.model,
        target_model=config.target.model,
        cache_dir=config.cache_dir,
        num_speculative_tokens=config.num_speculative_tokens,
        draft_retry_timeout_s=config.draft_retry_timeout_s,
    )
    return Coordinator.options(**config.coordinator_options).bind(
        Draft.options(**config.draft_options).bind(draft_cfg.model_dump()),
        Target.options(**config.target_options).bind(target_cfg.model_dump()),
        coordinator_cfg.model_dump(),
    )
