"""The engine: frozen specs in, results out. Docker stays behind docker_runtime (and the engine, removal and
host_config modules); the hardened container's settings, the seccomp profile, images, warm pools, streams and
archives live here.

It may import only the top-level modules (errors, shipped); every other layer imports it.
"""
