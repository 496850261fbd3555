"""The sandbox layer: frozen specs in, results out; Docker stays behind docker_runtime."""
