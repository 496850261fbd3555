"""Who may call a server over HTTP (serve --tokens, --issuer and their rules), each caller's policy checked at
start as its calls will load it."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sandbox_server.errors import UsageError

if TYPE_CHECKING:
    from sandbox_server.access.auth import Authentication
    from sandbox_server.access.shared import SharedAccess, SharedTokens
    from sandbox_server.policy import Policy
    from sandbox_server.state.database import Database

__all__ = ["authentication", "shared_access"]


def authentication(
    args: argparse.Namespace, caller_policy: Callable[[str], Policy], log: logging.Logger, database: Database | None
) -> Authentication | None:
    """Who may call over HTTP: the tokens file's callers and the issuer's (None: no authentication)."""
    from sandbox_server.access.auth import Authentication, JwtVerifier, PolicyRule, StaticTokenVerifier, jwks_url_of
    from sandbox_server.access.tokens import TokensFile, policies_said
    from sandbox_server.policy.loader import policy_problem

    if not args.tokens and not args.issuer:
        return None
    resource = args.public_url or f"http://{args.host}:{args.port}/mcp"
    static, issued = None, None
    problem_of = policy_problem(caller_policy)  # a policy is checked by loading it as its caller's calls will
    if args.tokens:
        tokens_file = TokensFile(Path(args.tokens), problem_of)
        tokens: TokensFile | SharedTokens = tokens_file
        if database is not None:  # replicas: the callers are the shared state's (the file seeds them once)
            from sandbox_server.access.shared import SharedTokens

            tokens = SharedTokens(database, seed=tokens_file)
        static = StaticTokenVerifier(tokens)
        where = "the shared state" if database is not None else args.tokens
        callers = tokens.callers()
        log.info("HTTP callers need a token of %s (%d caller(s))", where, len(callers))
        lines, warning = policies_said(callers, args.policy)
        for line in lines:
            log.info("%s", line)
        if warning is not None:
            log.warning("%s", warning)
    if args.issuer:
        rules = [PolicyRule.parse(rule, by_scope=True) for rule in args.scope_policy]
        rules += [PolicyRule.parse(rule, by_scope=False) for rule in args.claim_policy]
        for rule in rules:
            problem = problem_of(rule.policy)
            if problem is not None:
                raise UsageError(f"policy {rule.policy!r} of rule {rule.claim}:{rule.value}: {problem}")
        jwks = args.jwks_url or jwks_url_of(args.issuer)
        issued = JwtVerifier(args.issuer, resource, jwks, rules)
        log.info("HTTP callers may bring JWT access tokens of %s for %s (keys: %s)", args.issuer, resource, jwks)
    return Authentication.of(resource, static, issued, args.required_scope)


def shared_access(database: Database | None) -> SharedAccess | None:
    """What a replica's protocol and calls share with the other replicas, in the shared state (None: alone)."""
    if database is None:
        return None
    from sandbox_server.access.shared import SharedAccess

    return SharedAccess.of(database)
