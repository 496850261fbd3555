"""Running the server on a host: `setup` (engine, images, data folder: bootstrap), `doctor` (what the host can
do), and `doctor --posture` (a sandbox read from the host, against its policy).

It may import policy, network, sandbox and the top-level modules; only the command line imports it.
"""
