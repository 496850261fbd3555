"""Benchmarks: each runs the real server through the real MCP client and writes bench/results/<name>.json."""
