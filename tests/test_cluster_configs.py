"""The Serve configs (ray_config.yaml, configs/gpu_llama3_70b.yaml, the RayService's
serveConfigV2) and the cluster shapes around them (cluster/aws_gpu_cluster.yaml,
cluster/kuberay/*.yaml): parsed, validated with Ray's own schemas and the application's
AppConfig, and checked against each other (names, resources, replica ranges, one copy of
the GPU Serve config). No Ray instance is started.

Longer than 300 lines because every config and cluster file is checked against
the others here, in one place.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.app import AppConfig, build_app
from deployments.workers import RunnerConfig

ROOT = Path(__file__).resolve().parent.parent
CPU_CONFIG = ROOT / "ray_config.yaml"
GPU_CONFIG = ROOT / "configs" / "gpu_llama3_70b.yaml"
LAUNCHER = ROOT / "cluster" / "aws_gpu_cluster.yaml"
RAYSERVICE = ROOT / "cluster" / "kuberay" / "rayservice.yaml"
KUBE_MODELS = ROOT / "cluster" / "kuberay" / "models.yaml"

POOLS = {"Coordinator", "Draft", "Target"}
CUSTOM = {"Draft": "draft_node", "Target": "target_node"}
HAS_TP_FIELD = "tensor_parallel_size" in RunnerConfig.model_fields


def load(path: Path):
    return yaml.safe_load(path.read_text())


def rayservice() -> dict:
    return load(RAYSERVICE)


def serve_configs() -> dict[str, dict]:
    return {
        "ray_config.yaml": load(CPU_CONFIG),
        "configs/gpu_llama3_70b.yaml": load(GPU_CONFIG),
        "rayservice serveConfigV2": yaml.safe_load(rayservice()["spec"]["serveConfigV2"]),
    }


SERVE_CONFIG_IDS = list(serve_configs())


@pytest.fixture(params=SERVE_CONFIG_IDS)
def serve_config(request) -> dict:
    return serve_configs()[request.param]


def the_app(config: dict) -> dict:
    (app,) = config["applications"]
    return app


def deployments_of(config: dict) -> dict[str, dict]:
    return {d["name"]: d for d in the_app(config)["deployments"]}


def app_args_without_tp(args: dict) -> dict:
    """The args with `tensor_parallel_size` dropped while RunnerConfig lacks it;
    unchanged once the field exists."""
    if HAS_TP_FIELD:
        return args
    out = json.loads(json.dumps(args))
    for pool in ("draft", "target"):
        out.get(pool, {}).pop("tensor_parallel_size", None)
    return out


# ---- every YAML parses ------------------------------------------------------------------------


def test_every_yaml_file_loads():
    paths = [CPU_CONFIG, *sorted((ROOT / "configs").glob("*.yaml")), *sorted((ROOT / "cluster").rglob("*.yaml"))]
    assert {GPU_CONFIG, LAUNCHER, RAYSERVICE, KUBE_MODELS} <= set(paths)
    for path in paths:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, path


# ---- Serve configs: Ray's schema, the application's args, its deployments ---------------------


def test_serve_config_passes_rays_schema(serve_config):
    schema = ServeDeploySchema.model_validate(serve_config)
    (app,) = schema.applications
    assert app.import_path == "deployments.app:build_app"
    assert {d.name for d in app.deployments} == POOLS


def test_app_args_validate_with_app_config(serve_config):
    args = the_app(serve_config)["args"]
    config = AppConfig.model_validate(app_args_without_tp(args))
    assert config.draft.model and config.target.model
    assert config.draft.device == config.target.device


def test_tensor_parallel_size_is_a_runner_config_field():
    """The GPU profile's `target.tensor_parallel_size` must be accepted by AppConfig."""
    if not HAS_TP_FIELD:
        pytest.xfail("RunnerConfig has no tensor_parallel_size yet")
    config = AppConfig.model_validate(the_app(load(GPU_CONFIG))["args"])
    assert config.target.tensor_parallel_size == 4
    assert AppConfig.model_validate(the_app(load(CPU_CONFIG))["args"]).target.tensor_parallel_size == 1


def test_deployment_options_apply_to_the_applications_deployments(serve_config):
    """The config names exactly the deployments build_app creates, and Serve accepts each
    override on them (this runs Serve's own checks, e.g. that the replica actor's
    resources fit in bundle 0 of its placement group)."""
    from ray.serve._private.build_app import build_app as build_serve_app

    app = the_app(serve_config)
    built = build_serve_app(build_app(app_args_without_tp(app["args"])), name=app["name"])
    by_name = {d.name: d for d in built.deployments}
    assert set(by_name) == POOLS and built.ingress_deployment_name == "Coordinator"
    schema = ServeDeploySchema.model_validate(serve_config).applications[0]
    for dep in schema.deployments:
        options = dep.model_dump(exclude_unset=True)
        options.pop("name")
        applied = by_name[dep.name].options(**options)
        if "placement_group_bundles" in options:
            assert applied._replica_config.placement_group_bundles == options["placement_group_bundles"]


def test_each_pool_scales_on_its_own_and_drains_gracefully(serve_config):
    deps = deployments_of(serve_config)
    for name in POOLS:
        dep = deps[name]
        auto = dep.get("autoscaling_config")
        assert auto, f"{name} has no autoscaling_config"
        assert "num_replicas" not in dep
        assert 1 <= auto["min_replicas"] <= auto["max_replicas"]
        assert dep.get("graceful_shutdown_timeout_s", 0) >= 30, name


def test_gpu_profile_shapes():
    config = load(GPU_CONFIG)
    args = the_app(config)["args"]
    deps = deployments_of(config)
    draft, target, coord = deps["Draft"], deps["Target"], deps["Coordinator"]
    assert "70B" in args["target"]["model"] and "8B" in args["draft"]["model"]
    assert args["draft"]["device"] == args["target"]["device"] == "cuda"
    assert args["target"]["dtype"] == args["draft"]["dtype"] == "bfloat16"
    # Target: TP=4, one GPU per bundle, all on one node, rank 0 (the replica) in bundle 0.
    tp = args["target"]["tensor_parallel_size"]
    bundles = target["placement_group_bundles"]
    assert tp == 4 == len(bundles)
    assert all(b["GPU"] == 1 for b in bundles)
    assert target["placement_group_strategy"] == "STRICT_PACK"
    assert target["ray_actor_options"]["num_gpus"] == 1
    assert target["ray_actor_options"]["resources"] == {"target_node": 1}
    assert bundles[0].get("target_node") == 1
    # Draft: one GPU on a draft node. Coordinator: CPU only.
    assert draft["ray_actor_options"]["num_gpus"] == 1
    assert draft["ray_actor_options"]["resources"] == {"draft_node": 1}
    assert "placement_group_bundles" not in draft
    assert coord["ray_actor_options"].get("num_gpus", 0) == 0
    assert not coord["ray_actor_options"].get("resources")
    # The pools scale over different ranges.
    assert draft["autoscaling_config"]["max_replicas"] > 1
    assert target["autoscaling_config"]["max_replicas"] > 1


def test_cpu_default_stays_on_cpu():
    config = load(CPU_CONFIG)
    args = the_app(config)["args"]
    assert args["draft"]["device"] == args["target"]["device"] == "cpu"
    assert args["draft"]["model"] == "default-draft" and args["target"]["model"] == "default-target"
    for dep in deployments_of(config).values():
        assert dep["ray_actor_options"].get("num_gpus", 0) == 0
        assert not dep["ray_actor_options"].get("resources")


# ---- one copy of the GPU Serve config ----------------------------------------------------------


def test_rayservice_serves_exactly_the_gpu_profile():
    from cluster.render import rendered

    manifest = rayservice()
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    assert yaml.safe_load(manifest["spec"]["serveConfigV2"]) == load(GPU_CONFIG)
    # Verbatim, comments included: `python -m cluster.render` leaves the file unchanged.
    assert rendered() == RAYSERVICE.read_text(), "run: python -m cluster.render"


def test_launcher_deploys_the_gpu_profile_file():
    config = load(LAUNCHER)
    commands = " ".join(config["head_start_ray_commands"])
    assert "serve deploy ~/specdec/configs/gpu_llama3_70b.yaml" in commands
    assert config["file_mounts"]["~/specdec"] == "."  # the repository, from its root


# ---- the clusters provide what the deployments request -----------------------------------------


def replica_demand(dep: dict) -> tuple[list[dict], str]:
    """The bundles one replica needs and how they are placed."""
    if dep.get("placement_group_bundles"):
        return dep["placement_group_bundles"], dep.get("placement_group_strategy", "PACK")
    opts = dep.get("ray_actor_options", {})
    bundle = {"CPU": opts.get("num_cpus", 1), "GPU": opts.get("num_gpus", 0), **opts.get("resources", {})}
    return [bundle], "STRICT_PACK"


def per_node(bundles: list[dict], strategy: str, node: dict) -> int:
    """How many replicas one node of this type holds (0: it cannot hold one)."""
    assert strategy in ("STRICT_PACK", "PACK"), "only single-node replicas are checked"
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            need[key] = need.get(key, 0) + value
    counts = [int(node.get(key, 0) // value) for key, value in need.items() if value > 0]
    return min(counts) if counts else 0


def check_cluster_fits(node_types: dict[str, dict], head_type: str, serve_config: dict) -> dict:
    """node_types: {name: {resources, min_workers, max_workers}}. Returns {pool: node type}."""
    head = node_types[head_type]["resources"]
    assert head.get("GPU", 0) == 0, "the head should hold no GPU"
    assert not set(head) & set(CUSTOM.values()), "the head must not look like a draft/target node"
    placed = {}
    for name, dep in deployments_of(serve_config).items():
        bundles, strategy = replica_demand(dep)
        auto = dep["autoscaling_config"]
        custom = CUSTOM.get(name)
        if custom is None:  # the coordinator: CPU only, it fits on the head
            assert per_node(bundles, strategy, head) >= 1, f"{name} does not fit on the head"
            continue
        hosts = {t: spec for t, spec in node_types.items() if spec["resources"].get(custom)}
        assert len(hosts) == 1, f"{name}: exactly one node type should offer {custom}: {hosts}"
        ((node_type, spec),) = hosts.items()
        fit = per_node(bundles, strategy, spec["resources"])
        assert fit >= 1, f"{name} replica {bundles} does not fit a {node_type} node {spec['resources']}"
        assert spec["max_workers"] * fit >= auto["max_replicas"], f"{node_type}: too few nodes for {name}"
        assert spec["min_workers"] * fit >= auto["min_replicas"], f"{node_type}: min_workers < {name} min_replicas"
        # Nothing else may take this node type's GPUs.
        gpus = sum(b.get("GPU", 0) for b in bundles) * fit
        assert gpus == spec["resources"].get("GPU", 0), f"{node_type}: {spec['resources']} vs {gpus} GPUs used"
        placed[name] = node_type
    return placed


def test_launcher_is_valid_for_ray_and_fits_the_gpu_profile():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(load(LAUNCHER))
    validate_config(config)  # Ray's cluster-launcher schema
    assert config["provider"]["type"] == "aws"
    types = config["available_node_types"]
    placed = check_cluster_fits(types, config["head_node_type"], load(GPU_CONFIG))
    assert types[placed["Target"]]["resources"]["GPU"] == 4
    assert types[placed["Draft"]]["resources"]["GPU"] == 1
    assert config["max_workers"] >= sum(t.get("max_workers", 0) for n, t in types.items() if n != config["head_node_type"])
    # Each GPU node type sets itself up for its role.
    assert "node_setup.sh target" in " ".join(types[placed["Target"]]["worker_setup_commands"])
    assert "node_setup.sh draft" in " ".join(types[placed["Draft"]]["worker_setup_commands"])


def test_rayservice_cluster_fits_the_gpu_profile():
    """Read the RayCluster spec the way Ray's KubeRay autoscaler does, then check it."""
    import ray
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    spec = rayservice()["spec"]["rayClusterConfig"]
    assert spec["rayVersion"] == ray.__version__
    assert spec["enableInTreeAutoscaling"] is True
    autoscaling = _derive_autoscaling_config_from_ray_cr(
        {"metadata": {"name": "specdec", "namespace": "default"}, "spec": spec}
    )
    types = autoscaling["available_node_types"]
    placed = check_cluster_fits(types, autoscaling["head_node_type"], load(GPU_CONFIG))
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    limits = lambda g: g["template"]["spec"]["containers"][0]["resources"]["limits"]  # noqa: E731
    assert limits(groups[placed["Target"]])["nvidia.com/gpu"] == "4"
    assert limits(groups[placed["Draft"]])["nvidia.com/gpu"] == "1"


def test_kuberay_images_and_model_volume_agree():
    manifest, models = rayservice(), [d for d in yaml.safe_load_all(KUBE_MODELS.read_text()) if d]
    cluster = manifest["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    images = {p["spec"]["containers"][0]["image"] for p in pods}
    claim = {d["metadata"]["name"] for d in models if d["kind"] == "PersistentVolumeClaim"}
    (job,) = [d for d in models if d["kind"] == "Job"]
    assert images == {job["spec"]["template"]["spec"]["containers"][0]["image"]}
    args = the_app(load(GPU_CONFIG))["args"]
    for pod in pods:
        mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] in claim
        for pool in ("draft", "target"):
            assert args[pool]["model"].startswith(mounts["models"] + "/")


def test_node_setup_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "cluster" / "node_setup.sh")], check=True)


def test_fit_check_catches_clusters_that_cannot_host_the_profile():
    """The resource check above is not vacuous: shrink or mislabel a node type and it fails."""
    import copy

    from ray.autoscaler._private.util import prepare_config

    good = prepare_config(load(LAUNCHER))
    profile = load(GPU_CONFIG)
    broken = []
    small = copy.deepcopy(good)
    small["available_node_types"]["target_4gpu"]["resources"]["GPU"] = 2  # TP=4 needs 4 on one node
    broken.append(small)
    unlabelled = copy.deepcopy(good)
    del unlabelled["available_node_types"]["draft_1gpu"]["resources"]["draft_node"]
    broken.append(unlabelled)
    few = copy.deepcopy(good)
    few["available_node_types"]["target_4gpu"]["max_workers"] = 1  # Target max_replicas is 4
    broken.append(few)
    for config in broken:
        with pytest.raises(AssertionError):
            check_cluster_fits(config["available_node_types"], config["head_node_type"], profile)


def test_render_replaces_only_the_serve_config_block():
    from cluster.render import render

    manifest = "a: 1\nspec:\n  serveConfigV2: |\n    old: 1\n\n    more: 2\n  other: 3\n"
    assert render(manifest, "new: 2\n# note\n") == "a: 1\nspec:\n  serveConfigV2: |\n    new: 2\n    # note\n  other: 3\n"


def test_proposal_vocab_is_a_draft_setting():
    from pydantic import ValidationError

    from deployments.config import AppConfig

    assert AppConfig(draft={"model": "default-draft", "proposal_vocab": 65536}).draft.proposal_vocab == 65536
    with pytest.raises(ValidationError, match="proposal_vocab is a draft setting: the target scores every token"):
        AppConfig(target={"model": "default-target", "proposal_vocab": 65536})
