"""The engine's path: a call's sandbox as a hardened container made through the Docker API (the engine, Podman),
and what the engine does for every path: images (ours and teams'), services' containers and networks, removal."""
