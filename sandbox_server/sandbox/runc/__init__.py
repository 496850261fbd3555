"""runc's path: a call's sandbox run by runc itself on an OCI bundle of the engine's image (host ids of its own,
views of the host's mounts, a veth on an engine network), beside the engine and without its cost per call."""
