"""Multi-node placement on one machine: a head and two worker nodes on this machine's
address, the worker nodes carrying the custom resources the GPU profile uses
(`draft_node`, `target_node`). The application (tiny random-weight pair on CPU) is
deployed from a Serve config shaped like configs/gpu_llama3_70b.yaml: the Draft asks for
`draft_node`, the Target for a STRICT_PACK placement group whose bundle 0 holds
`target_node`; the Coordinator asks for none and lands on the head (the workers' CPUs are
all taken by their pool). Then it checks where every replica and bundle runs and serves
requests across the nodes (handle calls and HTTP through the head's proxy).

    python -m cluster.local_multinode [--draft DIR --target DIR]

Prints the evidence and one `RESULT {json}` line (tests/test_multinode.py reads it).
Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from cluster.localcluster import (
    alive_nodes, deploy, free_port, log, multinode, result_line, tiny_serve_app, tiny_pair,
)

APP = "specdec"
PROMPT = "def quicksort(items):"


def serve_app(draft_dir, target_dir) -> dict:
    """The Serve application: the GPU profile's placement shape on CPU, tiny models."""
    graceful = {"graceful_shutdown_wait_loop_s": 0.5, "graceful_shutdown_timeout_s": 30}
    return tiny_serve_app(APP, draft_dir, target_dir, [
        {"name": "Coordinator", "num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}, **graceful},
        {
            "name": "Draft",
            "num_replicas": 1,
            "ray_actor_options": {"num_cpus": 1, "resources": {"draft_node": 1}},
            **graceful,
        },
        {
            "name": "Target",
            "num_replicas": 1,
            "ray_actor_options": {"num_cpus": 1, "resources": {"target_node": 1}},
            # As in the GPU profile: the replica in bundle 0 (with target_node), more
            # bundles for tensor-parallel ranks, all on one node.
            "placement_group_bundles": [{"CPU": 1, "target_node": 1}, {"CPU": 1}],
            "placement_group_strategy": "STRICT_PACK",
            **graceful,
        },
    ])


def node_roles() -> dict[str, str]:
    roles = {}
    for node in alive_nodes():
        res = node["Resources"]
        roles[node["NodeID"]] = (
            "draft" if res.get("draft_node") else "target" if res.get("target_node")
            else "head" if res.get("node:__internal_head__") else "other"
        )
    return roles


def placement() -> dict:
    """Where each replica actor and each placement-group bundle runs (read from the GCS
    tables: the state API would need the dashboard)."""
    import ray

    roles = node_roles()
    replicas = {}
    for actor in ray._private.state.actors().values():
        name = actor["ActorClassName"] or ""
        if actor["State"] == "ALIVE" and name.startswith(f"ServeReplica:{APP}:"):
            node_id = actor["Address"]["NodeID"]
            replicas.setdefault(name.split(":")[-1], []).append(
                {"node_id": node_id, "node": roles.get(node_id, "?"), "pid": actor["Pid"]}
            )
    groups = []
    for pg in ray.util.placement_group_table().values():
        if pg["state"] != "CREATED":
            continue
        groups.append({
            "strategy": pg["strategy"],
            "bundles": [
                {"resources": pg["bundles"][i], "node": roles.get(pg["bundles_to_node_id"][i], "?")}
                for i in sorted(pg["bundles"])
            ],
        })
    return {"nodes": roles, "replicas": replicas, "placement_groups": groups}


def http_completion(port: int, prompt: str, **params) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, **params}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.local_multinode", description=__doc__.split("\n")[0])
    parser.add_argument("--draft", help="draft model folder (default: a tiny random pair)")
    parser.add_argument("--target", help="target model folder")
    args = parser.parse_args(argv)
    draft_dir, target_dir = (args.draft, args.target) if args.draft else tiny_pair()

    import ray

    t0 = time.monotonic()
    checks: dict[str, bool] = {}
    with multinode(
        head={"num_cpus": 2},
        workers=[
            {"num_cpus": 1, "resources": {"draft_node": 1}},
            {"num_cpus": 2, "resources": {"target_node": 1}},
        ],
    ) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        log("nodes up:", node_roles(), f"{time.monotonic() - t0:.1f} s")
        port = free_port()
        handle = deploy(serve_app(draft_dir, target_dir), http_port=port)
        log(f"application RUNNING after {time.monotonic() - t0:.1f} s")

        where = placement()
        for deployment, replicas in sorted(where["replicas"].items()):
            for r in replicas:
                log(f"replica {deployment:<11} on {r['node']:<6} node {r['node_id'][:12]}  pid {r['pid']}")
        for pg in where["placement_groups"]:
            log(f"placement group {pg['strategy']}: bundles on {[b['node'] for b in pg['bundles']]}")
        nodes_of = {d: {r["node"] for r in rs} for d, rs in where["replicas"].items()}
        checks["draft on the draft node"] = nodes_of.get("Draft") == {"draft"}
        checks["target on the target node"] = nodes_of.get("Target") == {"target"}
        checks["coordinator on the head"] = nodes_of.get("Coordinator") == {"head"}
        target_pgs = [pg for pg in where["placement_groups"] if any("target_node" in b["resources"] for b in pg["bundles"])]
        checks["target placement group packed on the target node"] = bool(target_pgs) and all(
            pg["strategy"] == "STRICT_PACK" and {b["node"] for b in pg["bundles"]} == {"target"} for pg in target_pgs
        )

        # Requests across the nodes: coordinator (head) -> draft node -> target node.
        greedy = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
        spec = handle.generate.remote({"prompt": PROMPT, "sampling_params": greedy}).result(timeout_s=120)
        alone = handle.generate.remote(
            {"prompt": PROMPT, "sampling_params": greedy | {"num_speculative_tokens": 0}}
        ).result(timeout_s=120)
        log(f"handle: {len(spec.token_ids)} tokens, speculation {spec.speculation}")
        checks["greedy speculative == target-only across nodes"] = spec.token_ids == alone.token_ids
        checks["speculation ran"] = spec.speculation.proposed > 0 and spec.speculation.rounds < 16

        def one(i: int):
            params = {"temperature": 0.8, "seed": i, "max_tokens": 12, "ignore_eos": True}
            return handle.generate.remote({"prompt": f"{PROMPT} # {i}", "sampling_params": params}).result(timeout_s=120)

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(one, range(6)))
        checks["6 concurrent requests finished"] = all(r.usage.completion_tokens == 12 for r in results)
        over_http = http_completion(port, PROMPT, **greedy)
        log(f"HTTP /v1/completions via the head's proxy: {over_http['usage']}")
        checks["HTTP completion equals the handle's"] = over_http["choices"][0]["text"] == spec.text

        for name, ok in checks.items():
            log(("PASS " if ok else "FAIL ") + name)
        result_line({
            "checks": checks,
            "placement": where,
            "tokens": spec.token_ids,
            "seconds": round(time.monotonic() - t0, 1),
        })
    log(f"cluster stopped after {time.monotonic() - t0:.1f} s")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
