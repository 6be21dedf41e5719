"""The servers the gateway calls on a policy's behalf (escalation targets, review webhooks) are the operator's.

The operator names them in settings (`CALM_TARGETS`, a JSON object: name → URL, where the key is, protocol, whether a
private address may be reached); an admin's policy refers to one by name and can neither add a URL nor choose which
environment variable or file is sent as a credential. So an admin key cannot send `CALM_DB_URL` or a service-account
token to a server of its choosing, or reach the cloud's metadata address through the gateway.

Addresses are checked when a call connects (`GuardedTransport`): loopback, private (RFC 1918, fc00::/7) and
link-local (169.254/16 with the metadata service, fe80::/10) addresses, and anything not globally routable, are
refused unless the target's `private` is set. The check resolves the host itself just before httpx does; a DNS answer
that changes between the two is not caught (the names are the operator's own).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Literal

import httpx
from httpx._utils import URLPattern, get_environment_proxies
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

TARGET_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
# Printable ASCII, spelled out (every regex engine and fuzzer reads the ranges alike, not so `\s`): a host of anything
# but / ? # [ ] (no IPv6 literals: a bracket that is not one makes urlsplit raise), then nothing or / ? # and anything.
HTTP_URL = r"^https?://[\x21\x22\x24-\x2e\x30-\x3e\x40-\x5a\x5c\x5e-\x7e]+([/?#][\x21-\x7e]*)?$"
_ABSOLUTE_PATH = r"^/[\x21-\x7e]+$"
PRIVATE_EXTENSION = "calm_private_allowed"  # the httpx request extension GuardedTransport reads


class Target(BaseModel):
    """One server the operator lets policies call. For an escalation target `url` is the OpenAI-compatible base (ending
    in /v1); for a review webhook it is the URL posted to. The key is read at call time from the environment variable
    or the file named here (rotated keys apply at once)."""

    model_config = ConfigDict(extra="forbid")

    url: StrictStr = Field(pattern=HTTP_URL, max_length=2000)
    api_key_env: StrictStr | None = Field(default=None, pattern=_ENV_NAME)
    api_key_file: StrictStr | None = Field(default=None, pattern=_ABSOLUTE_PATH, max_length=4096)
    # "calm": a CALM gateway (options sent as options, its calibration passed on, the peer hop signed for it);
    # "openai": options written into the question as lettered lines.
    protocol: Literal["openai", "calm"] = "openai"
    private: StrictBool = False  # loopback, private and link-local addresses may be reached (same host, same VPC)
    # What policies may use it for: an escalation target gets callers' requests, a webhook gets review texts; neither
    # goes where the operator meant the other.
    kind: Literal["escalate", "webhook"] = "escalate"

    @model_validator(mode="after")
    def _one_key(self):
        if self.api_key_env and self.api_key_file:
            raise ValueError("give a target's API key as `api_key_env` or `api_key_file`, not both")
        return self


class Targets:
    """The operator's targets, looked up by a policy's name (or, for a policy stored before targets were named, by
    the URL it held: only a URL the operator also lists is called)."""

    def __init__(self, targets: dict[str, Target] | None = None):
        self._by_name = dict(targets or {})

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def find(self, name: str | None, legacy_url: str | None = None, kind: str = "escalate") -> Target | None:
        if name is not None:
            found = self._by_name.get(name)
            return found if found is not None and found.kind == kind else None
        if legacy_url is not None:
            wanted = legacy_url.rstrip("/")
            return next((t for t in self._by_name.values() if t.kind == kind and t.url.rstrip("/") == wanted), None)
        return None

    def unknown(self, name: str, kind: str = "escalate") -> str | None:
        """Why a policy may not name `name` for `kind` (for the admin's 400), None when the operator lists it so."""
        if self.find(name, kind=kind) is not None:
            return None
        listed = ", ".join(n for n in self.names() if self._by_name[n].kind == kind) or "none are set"
        return f"{name!r} is not one of the operator's {kind} targets (CALM_TARGETS: {listed})"


def address_allowed(address: str, private: bool) -> bool:
    """Whether a resolved address may be called: a globally routable one always; loopback, private and link-local ones
    only for a target marked `private`; multicast, unspecified and reserved ones never."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone ("fe80::1%eth0") is not part of the address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.is_site_local:  # fec0::/10, deprecated but still routed inside some networks
            return private
        # IPv4 carried inside IPv6 (mapped, 6to4, Teredo's client) is judged as that IPv4 address.
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is not None:
            ip = embedded
    if ip.is_multicast or ip.is_unspecified or ip.is_reserved and not ip.is_loopback:  # ::1 sits in reserved ::/8
        return False
    if ip.is_global:
        return True
    return private and (ip.is_loopback or ip.is_private or ip.is_link_local)


class AddressRefused(httpx.ConnectError):
    """The target's host resolves to an address this target may not reach."""


class GuardedTransport(httpx.AsyncBaseTransport):
    """httpx's transport, refusing before it connects to an address the request's target may not reach.

    The environment's proxies (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY, NO_PROXY, as httpx itself reads them) are honoured:
    httpx ignores them once a client is given its own transport, and a gateway behind an egress proxy could reach no
    target. Through a proxy the proxy resolves the target's name (this host may not be able to), so only a host written
    as an address is checked here; the proxy's own rules govern names."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None, limits: httpx.Limits | None = None):
        self._limits = limits or httpx.Limits(max_connections=256)
        self._inner = inner or httpx.AsyncHTTPTransport(limits=self._limits)
        self._proxied: dict[str, httpx.AsyncBaseTransport] = {}

    def _route(self, url: httpx.URL) -> tuple[httpx.AsyncBaseTransport, bool]:
        """The transport for `url` and whether it goes through a proxy."""
        proxy = _environment_proxy(url)
        if proxy is None:
            return self._inner, False
        if proxy not in self._proxied:
            self._proxied[proxy] = httpx.AsyncHTTPTransport(proxy=proxy, limits=self._limits)
        return self._proxied[proxy], True

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        private = bool(request.extensions.get(PRIVATE_EXTENSION, False))
        transport, proxied = self._route(request.url)
        host, port = request.url.host, request.url.port or (443 if request.url.scheme == "https" else 80)
        if proxied:
            try:
                found = [ipaddress.ip_address(host)]
            except ValueError:
                found = []  # a name: the proxy resolves it
            addresses = [str(ip) for ip in found]
        else:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                raise httpx.ConnectError(f"cannot resolve {host}: {e}", request=request) from None
            addresses = [info[4][0] for info in infos]
        refused = sorted({a for a in addresses if not address_allowed(a, private)})
        if refused:
            raise AddressRefused(f"{host} resolves to {', '.join(refused)}, which this target may not reach "
                                 "(set `private` on the operator's target to allow it)", request=request)
        return await transport.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()
        for transport in self._proxied.values():
            await transport.aclose()


def _environment_proxy(url: httpx.URL) -> str | None:
    """The proxy the environment names for `url` (None: connect directly), read at each call as httpx reads it."""
    # The most specific pattern first, as httpx orders its mounts (a NO_PROXY host before the scheme's proxy).
    patterns = sorted(((URLPattern(p), proxy) for p, proxy in get_environment_proxies().items()), key=lambda m: m[0])
    return next((proxy for pattern, proxy in patterns if pattern.matches(url)), None)
