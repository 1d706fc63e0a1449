"""Tenants and the operator over HTTP (tiny model): the operator key (--admin-key) guards administration
(cache flush and stats, /metrics, /health's full view) against the tenants' --api-key, and without an admin
key the API key is the operator's, as before. `n` leaves a slot to others. The queue's fairness between tenants
is unit-tested on the fake engine (test_scheduler.py)."""

from __future__ import annotations

import httpx
import pytest

from .conftest import serving

TENANT, ADMIN = "tenant-key", "operator-key"
MSGS = [{"role": "user", "content": "hi"}]


def get(url, path, key=None, method="GET"):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.request(method, url + path, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def split(tiny_model):
    with serving(tiny_model, api_key=TENANT, admin_key=ADMIN, parallel=2, ctx_size=2048) as (rt, srv):
        yield srv.url


@pytest.mark.parametrize("path,method", [("/v1/cache/flush", "POST"), ("/metrics", "GET"),
                                         ("/v1/cache/stats", "GET")])
def test_administration_needs_the_operator_key_not_a_tenants(split, path, method):
    assert get(split, path, TENANT, method).status_code == 403
    assert get(split, path, None, method).status_code == 401
    assert get(split, path, "wrong", method).status_code == 401
    assert get(split, path, ADMIN, method).status_code == 200


def test_a_tenant_is_served_and_sees_only_status_and_slots_on_health(split):
    r = httpx.post(split + "/v1/chat/completions", json={"model": "m", "messages": MSGS, "max_tokens": 2},
                   headers={"Authorization": f"Bearer {TENANT}"}, timeout=120)
    assert r.status_code == 200, r.text
    tenant = get(split, "/health", TENANT).json()
    assert "queue_length" not in tenant and "cache" not in tenant and tenant["status"] == "ok"
    operator = get(split, "/health", ADMIN).json()
    assert "queue_length" in operator and "cache" in operator
    # the operator may use the API too
    r = httpx.post(split + "/v1/chat/completions", json={"model": "m", "messages": MSGS, "max_tokens": 2},
                   headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)
    assert r.status_code == 200, r.text


def test_n_cannot_take_every_slot(split):
    body = {"model": "m", "messages": MSGS, "max_tokens": 2, "n": 2}
    r = httpx.post(split + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {TENANT}"},
                   timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "left to other requests" in r.json()["error"]["message"]


def test_without_an_admin_key_the_api_key_is_the_operators(tiny_model):
    with serving(tiny_model, api_key=TENANT, ctx_size=2048) as (_, srv):
        assert get(srv.url, "/v1/cache/flush", TENANT, "POST").status_code == 200
        assert get(srv.url, "/metrics", TENANT).status_code == 200
        assert get(srv.url, "/metrics").status_code == 401
