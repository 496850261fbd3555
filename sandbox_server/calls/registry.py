"""The tools a policy offers and the warm containers they want.

The registry holds the server's policy (swapped whole when its file changes), the policies
callers' tokens name, and the names clients see (with a prefix); from them it plans one warm
pool per distinct container shape, within the server policy's memory budget and the host's
memory floor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from sandbox_server.network.proxies import EgressProxies
from sandbox_server.policy import Policy
from sandbox_server.policy.ecma import SchemaValidator
from sandbox_server.policy.references import same_policy
from sandbox_server.sandbox.host_memory import available_bytes
from sandbox_server.sandbox.pool import PoolTarget, WarmPool
from sandbox_server.tools import Tool, offers
from sandbox_server.workspaces.store import WorkspaceStore

__all__ = ["ToolRegistry"]

logger = logging.getLogger("sandbox_server")


class ToolRegistry:
    """Tools by the names clients see, the policies calls run under, and the warm pools they want."""

    def __init__(
        self,
        tools: list[Tool],
        policy: Policy,
        pool: WarmPool[Any] | None = None,
        proxies: EgressProxies | None = None,
        workspaces: WorkspaceStore | None = None,
        caller_policy: Callable[[str], Policy] | None = None,
        tool_prefix: str | None = None,
        server_reference: str | None = None,
    ) -> None:
        self.all_tools = {tool.name: tool for tool in tools}
        self.validators = {tool.name: SchemaValidator(tool.input_schema) for tool in tools}
        self.policy = policy
        self.pool = pool
        self.proxies = proxies
        """The egress proxies of policies with an allow list (None: such a policy's calls are refused)."""
        self.workspaces = workspaces
        self.caller_policy = caller_policy
        """Loads the policy a caller's token names, by its reference (None: every call runs under the server's)."""
        self.server_reference = server_reference
        """How callers' tokens name the server's own policy, which they then share with its reloads."""
        self.tool_prefix = tool_prefix
        """Overrides the policy's `tool_prefix` when set (serve --tool-prefix)."""
        self._caller_policies: dict[str, Policy] = {}
        """Callers' policies other than the server's, by reference: the warm pools keep containers for them too."""
        self._pooled_networks: set[str] = set()
        """Allow lists whose network the warm pools know of (by key)."""
        self._service_networks: frozenset[str] = frozenset()
        """Networks of workspaces whose services run: a warm container waits on each for their calls."""
        self._configure_pool()

    @property
    def prefix(self) -> str:
        """What is put before every tool name clients see."""
        return self.policy.tool_prefix if self.tool_prefix is None else self.tool_prefix

    def tools_of(self, policy: Policy) -> dict[str, Tool]:
        """The tools a policy offers, by the names clients see."""
        prefix = self.prefix
        return {prefix + name: tool for name, tool in self.all_tools.items() if offers(policy, tool)}

    def policy_for(self, reference: str | None) -> Policy:
        """The policy a caller's calls run under: the one its token names, else the server's (as it is now)."""
        if reference is None or self.caller_policy is None:
            return self.policy
        policy = self.named(reference)
        if policy is not self.policy and self._caller_policies.get(reference) is not policy:
            self._caller_policies[reference] = policy  # one not known before: its warm pools from now on
            self._configure_pool()
        return policy

    def named(self, reference: str) -> Policy:
        """The policy a reference names: the server's own as it is now, or a caller's as loaded."""
        if self.caller_policy is None or same_policy(reference, self.server_reference):
            return self.policy
        return self.caller_policy(reference)

    def know_policies(self, references: list[str]) -> None:
        """Keep warm containers for these callers' policies from the start (the tokens' and the issuer rules')."""
        if self.caller_policy is None:
            return
        for reference in references:
            policy = self.named(reference)
            if policy is not self.policy:
                self._caller_policies[reference] = policy
        self._configure_pool()

    def largest_arguments(self) -> int:
        """The largest `limits.argument_bytes` of any tool under the server's and the known callers' policies."""
        policies = [self.policy, *self._caller_policies.values()]
        return max(p.for_tool(name).max_argument_bytes for p in policies for name in self.all_tools)

    def swap(self, policy: Policy) -> None:
        """Use a new server policy for new calls (running calls keep theirs)."""
        self.policy = policy
        if self.workspaces is not None:
            self.workspaces.reconfigure(policy.workspace, policy.host.workspace_storage_mb * 1024 * 1024)
        self._configure_pool()

    def network_ready(self, key: str) -> None:
        """An allow list's network exists now: the warm pools of tools behind it can fill."""
        if key not in self._pooled_networks:
            self._pooled_networks.add(key)
            self._configure_pool()

    def service_networks(self, networks: set[str]) -> None:
        """The networks of workspaces with running services now: their calls' warm containers wait on them."""
        if frozenset(networks) != self._service_networks:
            self._service_networks = frozenset(networks)
            self._configure_pool()

    def _pool_targets(self, policy: Policy) -> list[PoolTarget]:
        """One warm pool per enabled tool's container settings (tools with equal settings share one)."""
        targets = []
        for name, tool in self.all_tools.items():
            tool_policy = policy.for_tool(name)
            if not tool_policy.enabled or not tool.sandbox:
                continue
            template = tool_policy.container_spec()
            if tool_policy.egress is not None:  # on its internal network, which the first call's proxy made
                if self.proxies is None or (network := self.proxies.network_of(tool_policy.egress)) is None:
                    continue
                trusted = self.proxies.mounts_of(tool_policy.egress)  # the CAs, when the proxy opens HTTPS
                template = replace(template, network=network, mounts=template.mounts + trusted)
            if policy.workspace.persist and self.workspaces is not None:
                template = self.workspaces.shape(template)  # calls in kept workspaces get such containers
            most, ahead, deeper = tool_policy.pool_most, tool_policy.pool_ahead, tool_policy.pool_on_runc
            targets.append(PoolTarget(template, tool_policy.pool_size, tool_policy.pool_idle_s, most, ahead, deeper))
            if policy.workspace.persist and tool_policy.pool_size > 0:  # one on each running services' network
                for network in sorted(self._service_networks):
                    on_it = replace(template, service_network=network)
                    targets.append(PoolTarget(on_it, 1, tool_policy.pool_idle_s, 1))
        return targets

    def _configure_pool(self) -> None:
        """The warm pools the server's and the known callers' policies want, within the server policy's memory
        budget and the host's memory floor."""
        if self.pool is None:
            return
        policy = self.policy
        floor = policy.host.min_available_memory_mb * 2**20

        def host_room() -> bool:
            return available_bytes() > floor

        targets = self._pool_targets(policy)
        for other in self._caller_policies.values():
            targets += self._pool_targets(other)
        self.pool.configure(targets, policy.host.pool_memory_mb * 2**20, host_room, policy.host.pool_sandboxes)
