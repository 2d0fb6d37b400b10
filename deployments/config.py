"""The application's configuration: one tree, every field defined once, defaults here.

    AppConfig                      the `args:` of the application in ray_config.yaml
    ├── CoordinatorConfig fields   served_model_name, num_speculative_tokens, retries
    ├── cache_dir                  where the default pair is converted (all deployments)
    ├── draft:  RunnerConfig       how the Draft pool loads and runs its model
    ├── target: RunnerConfig       the same for the Target pool
    └── *_options                  Serve deployment options, for Python callers of build_app

`AppConfig` extends `CoordinatorConfig`, so the coordinator's fields stay at the top of
`args:` (as the README documents them); `build_app` hands the Coordinator the whole tree
(it needs both model names and the cache folder) and each pool its own `RunnerConfig` plus
`cache_dir`. Constants shared with the core (default K, the cache bound) come from specdec.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specdec.params import DEFAULT_NUM_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS
from specdec.runner import DEFAULT_MAX_CACHE_TOKENS


class RunnerConfig(BaseModel):
    """How one pool loads and runs its model (the `draft` / `target` args in ray_config.yaml)."""

    model_config = ConfigDict(extra="forbid")

    model: str  # "default-draft" / "default-target", a local folder, or a hub id
    # Weight format: bfloat16, float32, float16 (FBGEMM fp16 GEMM, fp32 compute; x86 CPUs),
    # int8 (weight-only, per output channel, bf16 compute), w8a8 (int8 weights and per-row
    # int8 activations through FBGEMM; x86 CPUs) or auto: the fastest of them for this pool's
    # calls, measured on the machine at load (w8a8 for drafts only: it changes activations).
    dtype: str = "auto"
    device: str = "cpu"
    max_cache_tokens: int = DEFAULT_MAX_CACHE_TOKENS  # KV cache bound, over all sequences held
    num_threads: int | None = None  # torch threads; None = every core of the machine
    max_batch_size: int = 16  # calls one forward pass takes at most (deployments.workers.CallBatcher)
    batch_wait_timeout_s: float = 0.002
    # Ranks of one replica (heads and MLP sharded, KV cache by head). The deployment's
    # placement_group_bundles must hold one bundle per rank; rank i runs in bundle i.
    tensor_parallel_size: int = Field(1, ge=1)
    # Matmul kernels that the load-time calibration found bitwise batch-invariant on this
    # machine (the attention is invariant in both modes), so a position's numbers depend
    # neither on the rest of the batch nor on how many positions are fed together: seeded
    # output stays identical under load, across K and after a re-prefill.
    batch_invariant: bool = False
    # Draft only: propose among this many token ids (the lowest ids, most frequent first in
    # byte-level BPE vocabularies, plus the special tokens); None: the whole vocabulary.
    # Exact either way (the target's distribution is what comes out); a smaller vocabulary
    # head makes each draft step cheaper and accepts a little less. docs/ARCHITECTURE.md.
    proposal_vocab: int | None = Field(None, ge=1)
    # Passes (and loading) hold the node's cores alone, so a draft pass and a target pass
    # never share them (deployments.node_cores). None: on for CPU pools, off for GPUs; set
    # false for a CPU pool that has cores of its own (num_threads, CPU affinity).
    exclusive_cores: bool | None = None

    def takes_turns_on_cores(self) -> bool:
        if self.exclusive_cores is not None:
            return self.exclusive_cores
        return self.device.split(":")[0] == "cpu"


class CoordinatorConfig(BaseModel):
    """What the Coordinator decides: the served name, default K, and how long it retries."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str = "specdec-qwen2.5-coder"
    # Default K (with adaptive_k: the largest K a round may use); a request may set its own
    # (0 = target-only), which is then used as is.
    num_speculative_tokens: int = Field(DEFAULT_NUM_SPECULATIVE_TOKENS, ge=0, le=MAX_SPECULATIVE_TOKENS)
    # K per round from each request's own acceptance and the pools' measured costs
    # (specdec/k_policy.py), for requests that do not set num_speculative_tokens.
    adaptive_k: bool = True
    # The cost table adaptive K uses: {draft_ms, target_rows, target_ms, draft_row_ms}. None: from
    # the pools' calibrations when the coordinator starts. Pin it to make standard-mode seeded
    # texts reproducible across deployments and machines (drafter-invariant texts are anyway).
    k_costs: dict | None = None
    # The sampling mode of requests that do not set drafter_invariant. True: Gumbel-coupled,
    # a seed gives the request's target-only text for any K, draft or load, so adaptive K
    # may also weigh load (K = 0 where a busy, compute-bound replica cannot gain). False:
    # standard rejection sampling, which accepts a little more but whose seeded text depends
    # on the K sequence, so K may never follow load. docs/benchmark.md measures both.
    drafter_invariant: bool = True
    # A lost draft replica: standard-mode requests retry (another replica, or the
    # replacement Serve starts) for up to this long, then run target-only rounds; that keeps
    # a seeded text unchanged whenever a replica is back in time. Drafter-invariant requests
    # go target-only at once: their text does not depend on the draft at all.
    draft_retry_timeout_s: float = 30.0
    target_retry_timeout_s: float = 120.0  # a lost target replica: retry this long, then fail
    retry_backoff_s: float = 0.5


class AppConfig(CoordinatorConfig):
    """The `args:` block of the application in ray_config.yaml."""

    cache_dir: str | None = None  # where the default pair is converted; None = ~/.cache/specdec
    draft: RunnerConfig = RunnerConfig(model="default-draft")
    target: RunnerConfig = RunnerConfig(model="default-target")
    # Serve deployment options (num_replicas, autoscaling_config, ray_actor_options, ...) for
    # Python callers of build_app; a Serve config file sets these in its `deployments:` list.
    coordinator_options: dict = {}
    draft_options: dict = {}
    target_options: dict = {}

    @field_validator("target")
    @classmethod
    def _target_scores_every_token(cls, target: RunnerConfig) -> RunnerConfig:
        if target.proposal_vocab is not None:
            raise ValueError("proposal_vocab is a draft setting: the target scores every token "
                             "(remove it from target:)")
        return target
