"""Sandboxes: frozen specs in, results out.

Each way a sandbox is made has a folder of its own: `engine` (containers through the Docker API, and the images,
services and removals the engine does for every path), `runc` (runc run on a bundle of the engine's image, beside
the engine), `gvisor` (runsc on the same bundles, for `strict`) and `template` (a bundle's sandbox forked from a
template of its image). What they share lives here: the spec and its results, the seccomp profile, the warm pools
and their memory, the meters, streams, archives, kept workspaces' mounts, and the launchers' wire.

It may import only the top-level modules (errors, shipped); every other layer imports it.
"""
