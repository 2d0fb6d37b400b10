"""Cluster shapes around the application: the GPU Serve profile's cluster launcher and
KubeRay manifests (`render` keeps the RayService's serveConfigV2 equal to
configs/gpu_llama3_70b.yaml), and local multi-node helpers (`localcluster`,
`local_multinode`, `local_autoscaling`) used by the tests; `cpu_node.env` (read by
`node_env` and `./run.sh serve`): the Ray / Serve settings of a node whose CPUs run the models."""
