"""Admin API: abstention policies, labelled questions, client API keys and the audit log. Every route needs the admin
key."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi import Path as FastAPIPath
from pydantic import ValidationError

from gateway.errors import NOT_JSON, APIError, json_content_type, validation_message
from gateway.edge.keys import issue_key
from gateway.records.client_keys import ClientKey
from gateway.serving.labels import score_labelled
from gateway.policy.policies import Policy, resolve, stored_policy, unknown_target
from gateway.records.handoff_store import Review
from gateway.protocol.admin import (
    KeyCreate, KeyCreated, KeyList, KeyOut, LabelledOpenQuestion, LabelUpload, LabelUploadResult, PolicyOut,
    ReviewClosed, ReviewList, ReviewOut, ReviewVerdict,
)
from gateway.routers.deps import DOMAIN_PATTERN, DomainPath, admin, checked_domain, documented, served_domain, state
from gateway.state import GatewayState
from gateway.records.store import VersionConflict

router = APIRouter()
POLICY_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/Policy"}}}}}


# Routes that only read or write the store are plain functions: FastAPI runs them in its thread pool, so a slow or
# partitioned database never holds the event loop (and /health/live with it); async routes hand store calls to threads.

# -- abstention policies ----------------------------------------------------------------------------------------------
def policy_out(gateway: GatewayState, domain: str, body: dict, version: int) -> PolicyOut:
    policy = stored_policy(body)
    effective = resolve(policy, domain, gateway.monitor.reference(domain), None,
                        gateway.shared.guarantees.fit_for(domain))
    return PolicyOut(domain=domain, version=version, policy=policy.model_dump(mode="json"),
                     effective_threshold=effective.threshold, state=effective.state)


def policies_changed(gateway: GatewayState) -> None:
    gateway.shared.policies.refresh()
    gateway.shared.guarantees.on_policy_change()


@router.get("/admin/policies", responses=documented(401, 403))
def list_policies(_: str = Depends(admin), gateway: GatewayState = Depends(state)):
    return {"data": [policy_out(gateway, d, b, v) for d, (b, v) in gateway.store.list_policies().items()]}


@router.get("/admin/policies/{domain}", responses=documented(400, 401, 403, 404))
def get_policy(domain: DomainPath, _: str = Depends(admin), gateway: GatewayState = Depends(state)) -> PolicyOut:
    found = gateway.store.get_policy(checked_domain(domain))
    if found is None:
        raise APIError(404, f"no policy for domain {domain!r}", "not_found_error", "domain")
    return policy_out(gateway, domain, *found)


@router.put("/admin/policies/{domain}", responses=documented(400, 401, 403, 404, 409), openapi_extra=POLICY_BODY)
async def put_policy(domain: DomainPath, request: Request, actor: str = Depends(admin),
                     if_match: str | None = Header(default=None, pattern=r'^"?[0-9]+"?$'),
                     gateway: GatewayState = Depends(state)) -> PolicyOut:
    served_domain(gateway, domain, default=True)
    if not json_content_type(request.headers.get("content-type")):  # one rule with every other route's body
        raise APIError(400, NOT_JSON)
    try:
        policy = Policy.model_validate_json(await request.body())
    except ValidationError as e:
        message, param = validation_message(e.errors(), Policy)
        raise APIError(400, f"invalid policy: {message}", param=param) from None
    unnamed = unknown_target(policy, gateway.shared.handoff.escalator.targets)
    if unnamed is not None:
        raise APIError(400, f"invalid policy: {unnamed[1]}", param=unnamed[0])
    expected = None
    if if_match is not None:
        if not if_match.strip('"').isdigit():
            raise APIError(400, "If-Match must be a policy version number", param="If-Match")
        expected = int(if_match.strip('"'))
    try:
        version = await asyncio.to_thread(gateway.store.put_policy, domain, policy.model_dump(mode="json"), actor,
                                          expected)
    except VersionConflict as e:
        raise APIError(409, str(e), "conflict_error") from None
    await asyncio.to_thread(policies_changed, gateway)
    return policy_out(gateway, domain, policy.model_dump(mode="json"), version)


@router.delete("/admin/policies/{domain}", responses=documented(400, 401, 403, 404))
def delete_policy(domain: DomainPath, actor: str = Depends(admin), gateway: GatewayState = Depends(state)):
    if not gateway.store.delete_policy(checked_domain(domain), actor):
        raise APIError(404, f"no policy for domain {domain!r}", "not_found_error", "domain")
    policies_changed(gateway)
    return {"domain": domain, "deleted": True}


# -- labelled questions -------------------------------------------------------------------------------------------------
@router.post("/admin/labels/{domain}", responses=documented(400, 401, 403, 404, 503))
async def upload_labels(domain: DomainPath, upload: LabelUpload, _: str = Depends(admin),
                        gateway: GatewayState = Depends(state)) -> LabelUploadResult:
    domain = served_domain(gateway, domain)
    verdicts = await score_labelled(gateway.deployments.for_domain(domain).service, domain, upload.questions)
    # Kept with their answers for the retraining gate (judged on, never trained on).
    await asyncio.to_thread(gateway.capture.add_labelled, domain,
                            [(q.question, None, q.answers) if isinstance(q, LabelledOpenQuestion)
                             else (q.question, q.options, q.answer) for q in upload.questions])
    return LabelUploadResult(domain=domain, scored=len(verdicts), accuracy=sum(verdicts) / len(verdicts),
                             labels=len((await asyncio.to_thread(gateway.store.labelled_answers, domain))[0]))


# -- the review queue (review policies) ---------------------------------------------------------------------------------
ReviewId = Annotated[str, FastAPIPath(pattern=r"^rev-[0-9a-f]{1,64}$")]


def review_out(review: Review) -> dict:
    return dict(id=review.id, domain=review.domain, response_id=review.response_id, request=review.request,
                answer=review.answer, answer_option=review.answer_option, confidence=review.confidence,
                created_at=review.created_at,
                status="open" if review.closed_at is None else "closed", correct=review.correct,
                reviewer=review.reviewer, note=review.note, closed_at=review.closed_at)


@router.get("/admin/reviews", responses=documented(400, 401, 403))
async def list_reviews(status: Annotated[Literal["open", "closed", "all"], Query()] = "open",
                       domain: Annotated[str | None, Query(pattern=DOMAIN_PATTERN)] = None,
                       limit: Annotated[int, Query(ge=1, le=1000)] = 100, _: str = Depends(admin),
                       gateway: GatewayState = Depends(state)) -> ReviewList:
    found = await asyncio.to_thread(gateway.shared.handoff.store.reviews, status, domain, limit)
    return ReviewList(data=[ReviewOut(**review_out(r)) for r in found])


@router.post("/admin/reviews/{review_id}", responses=documented(400, 401, 403, 404, 409))
async def close_review(review_id: ReviewId, verdict: ReviewVerdict, actor: str = Depends(admin),
                       gateway: GatewayState = Depends(state)) -> ReviewClosed:
    """The operator's verdict on the withheld answer: closes the review; the verdict is that answer's feedback."""
    reviews = gateway.shared.handoff.store
    review = await asyncio.to_thread(reviews.review, review_id)
    if review is None:
        raise APIError(404, f"no review with id {review_id!r}", "not_found_error", "review_id")
    stored = await asyncio.to_thread(reviews.close_review, review_id, verdict.correct, actor, verdict.note)
    if stored is None:
        raise APIError(409, f"review {review_id!r} or its response already has a different verdict", "conflict_error",
                       "correct")
    if stored:
        gateway.metrics.reviews.labels(review.domain, "closed").inc()
        await asyncio.to_thread(gateway.shared.verdict_recorded, review.domain, verdict.correct)
    closed = await asyncio.to_thread(reviews.review, review_id)
    return ReviewClosed(**review_out(closed), recorded=stored)


# -- client API keys ----------------------------------------------------------------------------------------------------
def key_out(key: ClientKey) -> KeyOut:
    return KeyOut(id=key.id, name=key.name, domains=list(key.domains) if key.domains else None,
                  requests_per_minute=key.requests_per_minute, created_at=key.created_at, revoked_at=key.revoked_at,
                  labeller=key.labeller, sequences_per_minute=key.sequences_per_minute)


@router.post("/admin/keys", responses=documented(400, 401, 403, 404), status_code=201)
def create_key(body: KeyCreate, _: str = Depends(admin), gateway: GatewayState = Depends(state)) -> KeyCreated:
    for domain in body.domains or []:
        served_domain(gateway, domain)
    created = issue_key(gateway.store, body.name, body.domains, body.requests_per_minute, body.labeller,
                        body.sequences_per_minute)
    gateway.keyring.refresh()
    return created


@router.get("/admin/keys", responses=documented(401, 403))
def list_keys(_: str = Depends(admin), gateway: GatewayState = Depends(state)) -> KeyList:
    return KeyList(data=[key_out(k) for k, _ in gateway.store.client_keys()])


@router.delete("/admin/keys/{key_id}", responses=documented(401, 403, 404))
def revoke_key(key_id: str, _: str = Depends(admin), gateway: GatewayState = Depends(state)):
    if not gateway.store.revoke_client_key(key_id):
        raise APIError(404, f"no active API key with id {key_id!r}", "not_found_error", "key_id")
    gateway.keyring.refresh()
    return {"id": key_id, "revoked": True}


@router.get("/admin/audit", responses=documented(400, 401, 403))
def audit(request: Request, domain: Annotated[str | None, Query(max_length=80)] = None,
                limit: Annotated[int, Query(ge=1, le=1000)] = 100, _: str = Depends(admin),
                gateway: GatewayState = Depends(state)):
    for name in ("domain", "limit"):  # one value each; a query string cannot make "0.0" or "true" an integer
        values = request.query_params.getlist(name)
        if len(values) > 1 or (name == "limit" and values and not values[0].isdigit()):
            raise APIError(400, f"{name} must be given once" + (", as a whole number" if name == "limit" else ""),
                           param=name)
    return {"data": gateway.store.audit_log(domain, limit)}
