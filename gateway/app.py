"""The FastAPI application, built by a factory: nothing is created at import time, so tests inject what they need."""

from __future__ import annotations

import asyncio
import hmac
import re
import time
from contextlib import asynccontextmanager
from typing import Annotated
from http import HTTPStatus

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi import Path as FastAPIPath
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from adapters.engine import EngineClient
from calm_core.artifact import LoadedArtifact
from calm_core.capture import Capture
from calm_core.jobs import JobQueue
from calm_core.registry import Registry
from gateway.deployments import Deployment, Deployments, VersionLoader
from gateway.errors import APIError, ErrorClass, classify, install_error_handlers, log, sse_error
from gateway.group_commit import GroupCommit
from gateway.guarantees import GuaranteedThresholds
from gateway.keys import ClientKey, KeyRing, issue_key
from gateway.limits import BodySizeLimit, InFlight, deadline
from gateway.monitoring import DomainMonitor, Metrics
from gateway.policies import DEFAULT_DOMAIN, Policy, resolve
from gateway.protocol import (
    ChatCompletionRequest, CompletionRequest, ErrorResponse, FeedbackRequest, FeedbackResponse, KeyCreate, KeyCreated,
    KeyList, KeyOut, LabelUpload, LabelUploadResult, ModelCard, ModelList, PolicyOut,
)
from gateway.loop_routes import loop_router
from gateway.retraining import CaptureBook
from gateway.serving import CalibratedService, PolicyBook, ServedArtifact, response_key
from gateway.settings import GatewaySettings
from gateway.store import Store, VersionConflict

DOMAIN_HEADER = "x-calm-domain"
DOMAIN_PATTERN = r"^[a-z0-9][a-z0-9_\-]{0,63}$"
_DOMAIN_NAME = re.compile(DOMAIN_PATTERN)
# A domain in a path: the rule is in the OpenAPI schema, so a schema-valid name is never refused.
DomainPath = Annotated[str, FastAPIPath(pattern=DOMAIN_PATTERN, description="lower-case letters, digits, '_' or '-'")]


def documented(*statuses: int) -> dict:
    """OpenAPI entries for the error statuses a route answers, all in the OpenAI error shape."""
    return {status: {"model": ErrorResponse, "description": HTTPStatus(status).phrase} for status in statuses}


def contract(app: FastAPI, settings: GatewaySettings) -> dict:
    """The OpenAPI document as the gateway behaves: invalid requests are 400s in the OpenAI error shape (FastAPI would
    document 422s), the policy body a PUT reads itself is declared, limits set at run time are in it (max_tokens),
    and optional headers are strings (a header cannot be null)."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    bad_request = {"description": "Bad Request",
                   "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for operations in schema["paths"].values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None:
                responses.setdefault("400", bad_request)
            for param in operation.get("parameters", []):
                branches = param.get("schema", {}).get("anyOf")
                if param.get("in") == "header" and branches:
                    kept = [b for b in branches if b.get("type") != "null"]
                    if len(kept) == 1:
                        param["schema"] = {**kept[0], "title": param["schema"].get("title", param["name"])}
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in ("ChatCompletionRequest", "CompletionRequest"):
        for name in ("max_tokens", "max_completion_tokens"):
            field = components.get(model, {}).get("properties", {}).get(name)
            if field is not None:
                for branch in field.get("anyOf", [field]):
                    if branch.get("type") == "integer":
                        branch["le"] = settings.max_tokens_limit
    components.setdefault("ErrorResponse", ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}"))
    policy = Policy.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(policy.pop("$defs", {}))
    components["Policy"] = policy
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    app.openapi_schema = _standard_bounds(schema)
    return app.openapi_schema


_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _standard_bounds(node):
    """Integer fields that also take integral floats (12.0) carry pydantic's bound names in their schema; JSON Schema
    spells them minimum / maximum."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node = {_BOUNDS.get(k, k): v for k, v in node.items()}
        return {k: _standard_bounds(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_standard_bounds(v) for v in node]
    return node


def create_app(
    settings: GatewaySettings,
    engine: EngineClient,
    tokenizer,
    artifact: LoadedArtifact,
    store: Store | None = None,
    registry: CollectorRegistry | None = None,
    load_version: VersionLoader | None = None,
) -> FastAPI:
    """`engine` serves `artifact`, the global default; `load_version` starts an engine for another registry version
    (per-domain versions and hot swap), None where the engine cannot serve other versions (an upstream server)."""
    registry = registry or CollectorRegistry()
    store = store or Store(settings.database)
    metrics = Metrics(registry)
    monitor = DomainMonitor(metrics, artifact.manifest.reference_histograms, settings.domains, settings.drift_window)
    artifacts = Registry(store, settings.registry_root)
    if "path" in artifact.__dict__:  # an artifact on disk (unit tests build bare ones) is the registry's default
        artifacts.ensure_default(artifact.path)
    jobs = JobQueue(store)
    capture = Capture(store)
    capture_book = CaptureBook(capture)
    policies = PolicyBook(store)
    responses = GroupCommit(lambda rows: store.record_responses(rows))  # one writer for every version's service
    guarantees = GuaranteedThresholds(store, metrics, policies.in_force, monitor.reference, settings.risk_refit_every)

    def make_service(version_engine: EngineClient, loaded: LoadedArtifact) -> CalibratedService:
        return CalibratedService(settings, version_engine, tokenizer, store, monitor, ServedArtifact.of(loaded.manifest),
                                 policies, guarantees, capture_book, responses)

    service = make_service(engine, artifact)
    deployments = Deployments(Deployment(artifact.manifest.artifact_version, service, artifact), artifacts,
                              make_service, monitor, load_version, settings.drain_s, settings.registry_poll_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        poller = None
        try:
            await deployments.sync()  # per-domain versions serve from the first request on
            poller = asyncio.get_running_loop().create_task(deployments.run())
            yield
        finally:  # engines and the database always shut down, however the server stops
            if poller is not None:
                poller.cancel()
            await capture_book.flush()
            await deployments.close()  # every version's engines, the default's included (or closed when it retired)
            store.close()

    app = FastAPI(title="CALM Gateway", version="0.1.0", lifespan=lifespan)
    app.openapi = lambda: contract(app, settings)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    in_flight = InFlight(settings.max_in_flight)
    app.state.in_flight = in_flight
    app.state.service = service
    app.state.deployments = deployments

    # Dependencies are coroutines: FastAPI runs a plain function in a worker thread, a hop per request.
    async def admin(authorization: str | None = Header(default=None)) -> str:
        if not authorization:
            raise APIError(401, "admin key required: send 'Authorization: Bearer <key>'", "authentication_error")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.encode(), settings.admin_key.encode()):
            raise APIError(403, "admin key is not valid", "permission_error")
        return "admin"

    keyring = KeyRing(store, settings.api_keys_required)
    app.state.keyring = keyring

    async def client(authorization: str | None = Header(default=None)) -> ClientKey | None:
        return keyring.authenticate(authorization)

    def checked_domain(domain: str) -> str:
        if domain != DEFAULT_DOMAIN and not _DOMAIN_NAME.match(domain):
            raise APIError(400, "domain must be lower-case letters, digits, '_' or '-', at most 64 characters", param="domain")
        return domain

    def count_error(endpoint: str, domain: str, exc: BaseException) -> ErrorClass:
        error = classify(exc)
        metrics.errors.labels(endpoint, domain, error.type).inc()
        metrics.requests.labels(endpoint, domain, str(error.status)).inc()
        return error

    async def sse(endpoint: str, domain: str, stream):
        """A stream whose failure becomes an SSE error event and [DONE], classified and counted like any error."""
        try:
            async for piece in stream:
                yield piece
        except Exception as e:
            error = count_error(endpoint, domain, e)
            if error.unexpected:
                log.error("unhandled error in a %s stream", endpoint, exc_info=e)
            yield sse_error(error)

    async def observed(endpoint: str, method: str, req, domain_header, key: ClientKey | None):
        start = time.perf_counter()
        domain = service.domain_of(req, domain_header)
        streaming = False
        try:
            keyring.admit(key, domain)
            in_flight.acquire()
            # The version serving this domain now; a swap during the request lets it finish on this one.
            deployment = deployments.for_domain(domain)
            deployment.in_flight += 1
            try:
                async with deadline(settings.request_deadline_s):
                    result = await getattr(deployment.service, method)(req, domain)
                streaming = hasattr(result, "__aiter__")
            finally:
                if not streaming:
                    in_flight.release()
                    deployment.in_flight -= 1
        except Exception as e:
            count_error(endpoint, domain, e)
            raise
        metrics.requests.labels(endpoint, domain, "200").inc()
        if streaming:  # the slots are held until the stream's last chunk
            stream = held_until_done(sse(endpoint, domain, result), deployment)
            return StreamingResponse(in_flight.hold_stream(stream), media_type="text/event-stream")
        metrics.latency.labels(endpoint, domain).observe(time.perf_counter() - start)
        return Response(result.model_dump_json(), media_type="application/json")

    @app.post("/v1/chat/completions", responses=documented(400, 401, 403, 404, 413, 429, 500, 503, 504))
    async def chat_completions(req: ChatCompletionRequest, x_calm_domain: str | None = Header(default=None),
                               key: ClientKey | None = Depends(client)):
        return await observed("chat", "chat", req, x_calm_domain, key)

    @app.post("/v1/completions", responses=documented(400, 401, 403, 404, 413, 429, 500, 503, 504))
    async def completions(req: CompletionRequest, x_calm_domain: str | None = Header(default=None),
                          key: ClientKey | None = Depends(client)):
        return await observed("completions", "completion", req, x_calm_domain, key)

    @app.get("/v1/models", responses=documented(401))
    async def models(_: ClientKey | None = Depends(client)) -> ModelList:
        return ModelList(data=[ModelCard(id=engine.model_name)])

    @app.get("/health", responses=documented(503))
    async def health():
        default = deployments.default.service
        for deployment in list(deployments.loaded.values()):
            await deployment.service.engine.check_health()
        return {"status": "ok", "model": default.engine.model_name, "artifact_version": default.engine.artifact_version,
                "scoring": default.scoring_paths(), "engine": default.engine.describe(),
                "versions": deployments.describe()}

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition"}})
    async def prometheus_metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/feedback", responses=documented(400, 401, 403, 404, 409, 429))
    async def feedback(req: FeedbackRequest, client_key: ClientKey | None = Depends(client)) -> FeedbackResponse:
        key = response_key(req.response_id, req.choice_index)
        found = await asyncio.to_thread(store.get_response, key)  # database work stays off the event loop
        if found is None:
            what = f"choice {req.choice_index} of " if req.choice_index else ""
            whole = req.choice_index and await asyncio.to_thread(store.get_response, req.response_id)
            raise APIError(404, f"no {what}response with id {req.response_id!r}", "not_found_error",
                           "choice_index" if whole else "response_id")
        domain, _ = found
        keyring.admit(client_key, domain)

        def record() -> bool | None:  # stored durably before the answer: an acknowledged verdict is never lost
            stored = store.add_feedback(key, req.correct)
            if stored:
                confidences, outcomes = store.recent_feedback(domain, settings.feedback_window)
                monitor.observe_feedback(domain, req.correct, confidences, outcomes)
                guarantees.on_feedback(domain)
            return stored

        stored = await asyncio.to_thread(record)
        if stored is None:
            raise APIError(409, f"response {req.response_id!r} already has different feedback", "conflict_error",
                           "correct")
        return FeedbackResponse(response_id=req.response_id, correct=req.correct, recorded=stored, domain=domain)

    # -- admin: abstention policies ------------------------------------------------------------------------------
    def policy_out(domain: str, body: dict, version: int) -> PolicyOut:
        policy = Policy.model_validate(body)
        effective = resolve(policy, domain, monitor.reference(domain), None, guarantees.fit_for(domain))
        return PolicyOut(domain=domain, version=version, policy=policy.model_dump(mode="json"),
                         effective_threshold=effective.threshold, state=effective.state)

    @app.get("/admin/policies", responses=documented(401, 403))
    async def list_policies(_: str = Depends(admin)):
        return {"data": [policy_out(d, b, v) for d, (b, v) in store.list_policies().items()]}

    @app.get("/admin/policies/{domain}", responses=documented(400, 401, 403, 404))
    async def get_policy(domain: DomainPath, _: str = Depends(admin)) -> PolicyOut:
        found = store.get_policy(checked_domain(domain))
        if found is None:
            raise APIError(404, f"no policy for domain {domain!r}", "not_found_error", "domain")
        return policy_out(domain, *found)

    @app.put("/admin/policies/{domain}", responses=documented(400, 401, 403, 409),
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": {"$ref": "#/components/schemas/Policy"}}}}})
    async def put_policy(domain: DomainPath, request: Request, actor: str = Depends(admin),
                         if_match: str | None = Header(default=None, pattern=r'^"?[0-9]+"?$')) -> PolicyOut:
        checked_domain(domain)
        try:
            policy = Policy.model_validate_json(await request.body())
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise APIError(400, f"invalid policy: {(loc + ': ') if loc else ''}{err['msg']}", param=loc or None) from None
        expected = None
        if if_match is not None:
            if not if_match.strip('"').isdigit():
                raise APIError(400, "If-Match must be a policy version number", param="If-Match")
            expected = int(if_match.strip('"'))
        try:
            version = store.put_policy(domain, policy.model_dump(mode="json"), actor, expected)
        except VersionConflict as e:
            raise APIError(409, str(e), "conflict_error") from None
        policies.refresh()
        guarantees.on_policy_change()
        return policy_out(domain, policy.model_dump(mode="json"), version)

    @app.delete("/admin/policies/{domain}", responses=documented(400, 401, 403, 404))
    async def delete_policy(domain: DomainPath, actor: str = Depends(admin)):
        if not store.delete_policy(checked_domain(domain), actor):
            raise APIError(404, f"no policy for domain {domain!r}", "not_found_error", "domain")
        policies.refresh()
        guarantees.on_policy_change()
        return {"domain": domain, "deleted": True}

    @app.post("/admin/labels/{domain}", responses=documented(400, 401, 403, 404, 503))
    async def upload_labels(domain: DomainPath, upload: LabelUpload, _: str = Depends(admin)) -> LabelUploadResult:
        domain = checked_domain(domain)
        if domain == DEFAULT_DOMAIN or monitor.label(domain) != domain:
            raise APIError(404, f"labels belong to a known serving domain; {domain!r} is not one", "not_found_error",
                           param="domain")
        verdicts = await deployments.for_domain(domain).service.score_labelled(domain, upload.questions)
        # Kept with their answers for the retraining gate (judged on, never trained on).
        await asyncio.to_thread(capture.add_labelled, domain, [(q.question, q.options, q.answer) for q in upload.questions])
        return LabelUploadResult(domain=domain, scored=len(verdicts), accuracy=sum(verdicts) / len(verdicts),
                                 labels=len(store.labelled_answers(domain)[0]))

    # -- admin: client API keys -----------------------------------------------------------------------------------
    def key_out(key: ClientKey) -> KeyOut:
        return KeyOut(id=key.id, name=key.name, domains=list(key.domains) if key.domains else None,
                      requests_per_minute=key.requests_per_minute, created_at=key.created_at, revoked_at=key.revoked_at)

    @app.post("/admin/keys", responses=documented(400, 401, 403), status_code=201)
    async def create_key(body: KeyCreate, _: str = Depends(admin)) -> KeyCreated:
        for domain in body.domains or []:
            checked_domain(domain)
        created = issue_key(store, body.name, body.domains, body.requests_per_minute)
        keyring.refresh()
        return created

    @app.get("/admin/keys", responses=documented(401, 403))
    async def list_keys(_: str = Depends(admin)) -> KeyList:
        return KeyList(data=[key_out(k) for k, _ in store.client_keys()])

    @app.delete("/admin/keys/{key_id}", responses=documented(401, 403, 404))
    async def revoke_key(key_id: str, _: str = Depends(admin)):
        if not store.revoke_client_key(key_id):
            raise APIError(404, f"no active API key with id {key_id!r}", "not_found_error", "key_id")
        keyring.refresh()
        return {"id": key_id, "revoked": True}

    @app.get("/admin/audit", responses=documented(400, 401, 403))
    async def audit(request: Request, domain: Annotated[str | None, Query(max_length=80)] = None,
                    limit: Annotated[int, Query(ge=1, le=1000)] = 100, _: str = Depends(admin)):
        for name in ("domain", "limit"):  # one value each; a query string cannot make "0.0" or "true" an integer
            values = request.query_params.getlist(name)
            if len(values) > 1 or (name == "limit" and values and not values[0].isdigit()):
                raise APIError(400, f"{name} must be given once" + (", as a whole number" if name == "limit" else ""),
                               param=name)
        return {"data": store.audit_log(domain, limit)}

    app.include_router(loop_router(admin, documented, deployments, artifacts, jobs, capture, capture_book,
                                   lambda: monitor.known))
    return app


async def held_until_done(stream, deployment: Deployment):
    """A response stream that keeps its deployment in use until the last chunk (or the client's disconnect)."""
    try:
        async for piece in stream:
            yield piece
    finally:
        deployment.in_flight -= 1
