"""The network a sandbox may reach: allow lists and the filtering proxy's configuration and log (egress), and
the proxies themselves with their internal networks and firewall rules (proxies).

It may import the sandbox layer and the top-level modules; policy and everything above import it.
"""
