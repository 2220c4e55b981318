"""What keeps web pages away from a server on this machine: the Host header check (against DNS rebinding), the
JSON content type on POSTs (a page may send ``text/plain`` cross-origin without a CORS preflight, never
``application/json``), the ``--cors-origin`` list, and the API key compared as the UTF-8 bytes a client sends.

A page on ``http://evil.example`` can make the browser POST to ``http://127.0.0.1:8000`` (a "simple" request:
``text/plain`` body, no custom headers) and, by re-pointing its own name at 127.0.0.1 (DNS rebinding), read the
answers of a same-origin fetch whose ``Host`` is ``evil.example``. The content type check stops the first, the
Host check the second; neither is needed by, nor gets in the way of, a client that is not a browser.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import ConfigError

WILDCARD_BINDS = ("0.0.0.0", "::", "")  # binding all interfaces
_NAME = re.compile(r"^[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*$")
_ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://[^/\s?#@]+$")


def normalize_host(value: str) -> str | None:
    """The host of a ``Host`` header or a host name, lower-case, without port or trailing dot; IP addresses in their
    canonical form (``[0:0::1]:80`` -> ``::1``). None for something that is not a host."""
    text = value.strip().lower()
    if text.startswith("["):  # [IPv6]:port
        end = text.find("]")
        port = text[end + 1:] if end > 0 else "x"
        if port and not (port.startswith(":") and port[1:].isdigit()):
            return None
        try:
            return str(ipaddress.IPv6Address(text[1:end]))
        except ValueError:
            return None
    if text.count(":") > 1:  # a bare IPv6 address (a --host or --allowed-hosts value)
        try:
            return str(ipaddress.IPv6Address(text))
        except ValueError:
            return None
    host, _, port = text.partition(":")
    if port and not port.isdigit():
        return None
    host = host[:-1] if host.endswith(".") else host
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    return host if _NAME.match(host) else None


@dataclass(frozen=True)
class HostPolicy:
    """Which ``Host`` headers a server answers: loopback addresses and ``localhost`` (and ``*.localhost``) always;
    the bound address; the names and ``.domain`` suffixes of ``--allowed-hosts``; any IP address when bound to all
    interfaces (a rebinding page's Host is always a name, never an address); anything with ``*``."""

    names: frozenset[str]
    suffixes: tuple[str, ...]  # ".example.com": example.com and every name under it
    any_address: bool = False
    any_host: bool = False

    @classmethod
    def create(cls, bind_host: str, allowed: Iterable[str] = ()) -> HostPolicy:
        names, suffixes, any_host = {"localhost"}, [".localhost"], False
        bind = bind_host.strip().strip("[]")
        if bind not in WILDCARD_BINDS and (host := normalize_host(bind)) is not None:
            names.add(host)
        for entry in allowed:
            if entry.strip() == "*":
                any_host = True
                continue
            suffix = entry.strip().startswith(".")
            host = normalize_host(entry.strip()[1:] if suffix else entry)
            if host is None or "/" in entry or (suffix and _is_address(host)):
                raise ConfigError(f"--allowed-hosts: {entry!r} is not a host name, an IP address, a .domain or * "
                                  "(give names without scheme or path, e.g. --allowed-hosts api.example.com)")
            if suffix:
                suffixes.append("." + host)
            else:
                names.add(host)
        return cls(frozenset(names), tuple(suffixes), any_address=bind in WILDCARD_BINDS, any_host=any_host)

    def allows(self, header: str | None) -> bool:
        if header is None or self.any_host:  # no Host (HTTP/1.0): not a browser, which always sends one
            return True
        host = normalize_host(header)
        if host is None:
            return False
        if _is_address(host):
            address = ipaddress.ip_address(host)
            return address.is_loopback or self.any_address or host in self.names
        return host in self.names or any(host.endswith(s) or host == s[1:] for s in self.suffixes)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class HostGuard:
    """ASGI middleware: a request whose ``Host`` the policy refuses gets ``reject(host)``'s response, before any
    route, CORS or key check (``/health`` and the playground included)."""

    def __init__(self, app, policy: HostPolicy, reject: Callable) -> None:
        self.app, self.policy, self.reject = app, policy, reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            for name, value in scope["headers"]:
                if name == b"host" and not self.policy.allows(value.decode("latin-1")):
                    await self.reject(value.decode("latin-1"))(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def is_json_media_type(content_type: str | None) -> bool:
    """``application/json`` or ``application/*+json``, any case, with no charset or ``charset=utf-8``."""
    if not content_type:
        return False
    media, *params = [part.strip().lower() for part in content_type.split(";")]
    if media != "application/json" and not re.fullmatch(r"application/[a-z0-9.!#$&^_-]+\+json", media):
        return False
    for param in params:
        key, _, value = param.partition("=")
        if key.strip() == "charset" and value.strip().strip('"') not in ("utf-8", "utf8"):
            return False
    return True


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The raw bytes after ``Bearer`` in the first Authorization header (b"" if none): compared as bytes, so a
    key outside ASCII matches what a UTF-8 client sends (starlette's str headers are decoded as latin-1)."""
    for name, value in headers:
        if name == b"authorization":
            return value[7:].lstrip(b" ") if value[:7].lower() == b"bearer " else b""
    return b""


def check_api_key(key: str) -> bytes:
    """The key's UTF-8 bytes; a ConfigError for a key HTTP cannot carry."""
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("--api-key (or TOKENLOOM_API_KEY) is not valid UTF-8") from None
    if key != key.strip() or any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise ConfigError("--api-key (or TOKENLOOM_API_KEY) must not start or end with whitespace or hold control "
                          "characters: an HTTP header cannot carry them")
    return raw


def check_cors_origins(origins: Iterable[str]) -> tuple[str, ...]:
    """Origins as browsers send them (``scheme://host[:port]``, lower case, a trailing / dropped) or ``*``."""
    out = []
    for origin in origins:
        text = origin.strip().lower()  # browsers send the scheme and host in lower case
        text = text[:-1] if text.endswith("/") and text.count("/") == 3 else text
        if text != "*" and not _ORIGIN.match(text):
            raise ConfigError(f"--cors-origin: {origin!r} is not an origin: give scheme://host[:port] (e.g. "
                              "http://localhost:3000, no path) or *")
        out.append(text)
    return tuple(out)
