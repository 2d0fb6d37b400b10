"""Ray Serve deployments: Draft and Target pools, the Coordinator (HTTP ingress) and the
application builder that ray_config.yaml names."""
