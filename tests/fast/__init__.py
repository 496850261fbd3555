"""The fast tier: every test that needs no engine, no image and no server process, in seconds.

The real server and the SDK's in-memory client over a fake runtime (pagination, argument validation, every kind of
refusal, rendering, names and hints, audit records, in both protocol eras), and the pure logic beside it: policy
files, archives, streams, the wire contract, the queue's bounds, the package's layers, the deployment files.
`scripts/run check` runs this tier after ruff and mypy.
"""
