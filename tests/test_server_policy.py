"""The server's admission policy, decision by decision, without a server (SRV-013, SRV-060..062,
SRV-071, SRV-072); the HTTP answers to these decisions are tested in test_server_admission.py
and test_server_tenancy.py."""

from __future__ import annotations

import pytest

from pagedkv.entrypoints.server.admission import AdmissionLimits
from pagedkv.entrypoints.server.api_keys import ApiKeys
from pagedkv.entrypoints.server.errors import api_error
from pagedkv.entrypoints.server.policy import (
    Admitted,
    BodyTooLarge,
    QueueFull,
    Refused,
    ServerPolicy,
    TooManyPrompts,
    Unauthenticated,
)
from pagedkv.errors import InvalidRequest

LIMITS = AdmissionLimits(max_prompts_per_request=4, max_waiting_requests=8, request_timeout_s=2.5)


def keyed(*, tenant_per_key: bool) -> ServerPolicy:
    return ServerPolicy(100, LIMITS, ApiKeys.of(("key-a", "key-b")), tenant_per_key=tenant_per_key)


@pytest.mark.spec("SRV-071")
def test_only_a_configured_key_is_admitted_and_health_needs_none() -> None:
    policy = keyed(tenant_per_key=False)
    assert policy.authenticate("/v1/models", "Bearer key-b") == Admitted()
    assert policy.authenticate("/health", "") == Admitted()
    for header in ("", "Bearer key-c", "Basic key-a", "key-a"):
        decision = policy.authenticate("/v1/models", header)
        assert isinstance(decision, Refused)
        assert isinstance(decision.reason, Unauthenticated)
        error = api_error(decision.reason)
        assert (error.status_code, error.info.code) == (401, "invalid_api_key")
        assert error.headers == {"WWW-Authenticate": "Bearer"}


@pytest.mark.spec("SRV-071")
def test_without_keys_every_request_is_admitted() -> None:
    assert ServerPolicy(100).authenticate("/v1/models", "") == Admitted()


@pytest.mark.spec("SRV-072")
def test_each_key_is_its_own_tenant_and_salts_the_cache() -> None:
    policy = keyed(tenant_per_key=True)
    a = policy.authenticate("/v1/completions", "Bearer key-a")
    b = policy.authenticate("/v1/completions", "bearer  key-b")
    assert isinstance(a, Admitted)
    assert isinstance(b, Admitted)
    assert a.tenant is not None
    assert b.tenant is not None
    assert a.tenant != b.tenant
    assert "key-a" not in a.tenant
    assert policy.cache_salt(a.tenant, "s") != policy.cache_salt(b.tenant, "s")
    assert policy.cache_salt(a.tenant, None) == f"{a.tenant}:"
    assert policy.cache_salt(None, "s") == "s"


@pytest.mark.spec("SRV-013")
def test_a_body_over_the_bound_is_refused_with_413() -> None:
    policy = ServerPolicy(100)
    assert policy.admit_body(100) == Admitted()
    decision = policy.admit_body(101)
    assert isinstance(decision, Refused)
    assert isinstance(decision.reason, BodyTooLarge)
    error = api_error(decision.reason)
    assert (error.status_code, error.info.code) == (413, "request_too_large")


@pytest.mark.spec("SRV-060")
def test_too_many_prompts_in_one_request_are_refused_with_400() -> None:
    policy = ServerPolicy(100, LIMITS)
    assert policy.admit_prompts(4) == Admitted()
    decision = policy.admit_prompts(5)
    assert isinstance(decision, Refused)
    assert isinstance(decision.reason, TooManyPrompts)
    assert api_error(decision.reason).status_code == 400


@pytest.mark.spec("SRV-061")
def test_a_full_queue_refuses_with_429_and_retry_after() -> None:
    policy = ServerPolicy(100, LIMITS)
    assert policy.admit_queue(waiting=5, count=3) == Admitted()
    decision = policy.admit_queue(waiting=6, count=3)
    assert isinstance(decision, Refused)
    assert isinstance(decision.reason, QueueFull)
    error = api_error(decision.reason)
    assert error.status_code == 429
    assert error.headers == {"Retry-After": str(LIMITS.retry_after_s)}


@pytest.mark.spec("SRV-062")
def test_the_deadline_runs_from_acceptance() -> None:
    assert ServerPolicy(100, LIMITS).deadline(10.0) == 12.5
    assert ServerPolicy(100).deadline(10.0) is None
    assert api_error(ServerPolicy(100, LIMITS).expired()).status_code == 504


def test_a_policy_refuses_impossible_settings() -> None:
    with pytest.raises(InvalidRequest, match="max_body_bytes"):
        ServerPolicy(0)
    with pytest.raises(InvalidRequest, match="API key"):
        ServerPolicy(100, tenant_per_key=True)
    with pytest.raises(InvalidRequest, match="API keys"):
        ApiKeys.of(("key", ""))
