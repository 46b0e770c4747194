"""TLS for every link polyrl opens: the one place that says how a client verifies its
peer and how a server presents its certificate.

HTTP clients (trainer -> manager, worker -> manager, manager -> workers, `polyrl status`)
come from `http_client` / `async_http_client`, which verify against the configured CA
file (or the system's trust store without one). Services serve HTTPS through uvicorn's
`ssl_certfile`/`ssl_keyfile` (`polyrl.serving.server_config`). The weight data plane
wraps its sockets with `server_context` / `client_context` when `manager.transfer.tls`
is on; the plain path stays the default (BENCHMARKS.md has what encryption costs).
"""

from __future__ import annotations

import functools
import socket
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where a client is made: the publisher process needs none
    import httpx


@functools.lru_cache(maxsize=8)
def client_context(ca_file: str | None) -> ssl.SSLContext:
    """Verifies the server's certificate and host name against `ca_file` (None: the
    system's trust store). Cached: loading a CA bundle costs milliseconds, and the data
    plane opens a connection per stream."""
    return ssl.create_default_context(cafile=ca_file)


@functools.lru_cache(maxsize=8)
def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


def http_client(ca_file: str | None = None, **kwargs: Any) -> httpx.Client:
    """An httpx.Client that verifies HTTPS peers against `ca_file`; `kwargs` as httpx's."""
    import httpx

    return httpx.Client(verify=client_context(ca_file), **kwargs)


def async_http_client(ca_file: str | None = None, **kwargs: Any) -> httpx.AsyncClient:
    import httpx

    return httpx.AsyncClient(verify=client_context(ca_file), **kwargs)


def certificate_error(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The verification failure behind `exc` (httpx wraps it twice), if that is what it
    is: a wrong CA file or host name, which no retry mends, unlike a refused connection."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None or isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def reachable_host(bind_host: str, advertise: str | None = None) -> str:
    """The address other machines use for a service bound to `bind_host`: `advertise`
    when given, this machine's hostname for a wildcard bind, else the bound address."""
    if advertise:
        return advertise
    return socket.gethostname() if bind_host in ("", "0.0.0.0", "::") else bind_host


def base_url(host: str, port: int, tls: bool = False) -> str:
    """http(s)://host:port, with an IPv6 host in brackets."""
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def self_signed(directory: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1")) -> dict[str, str]:
    """A throwaway CA and a server certificate it signs for `hosts` (names and IPs), made
    with the `openssl` command line, for tests, benchmarks and trying TLS out; returns
    the paths by name: ca, cert, key. Real deployments use certificates of their own CA."""
    import ipaddress
    import subprocess

    def is_ip(host: str) -> bool:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return False
        return True

    def openssl(*args: str | Path) -> None:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl(
        "req", "-x509", *ec, "-keyout", d / "ca.key", "-out", d / "ca.pem", "-days", "7", "-subj", "/CN=polyrl test CA"
    )
    openssl("req", *ec, "-keyout", d / "key.pem", "-out", d / "server.csr", "-subj", f"/CN={hosts[0]}")
    names = ",".join(f"IP:{h}" if is_ip(h) else f"DNS:{h}" for h in hosts)
    (d / "server.ext").write_text(
        f"subjectAltName={names}\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\nauthorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n"
    )
    openssl(
        "x509",
        "-req",
        "-in",
        d / "server.csr",
        "-CA",
        d / "ca.pem",
        "-CAkey",
        d / "ca.key",
        "-CAcreateserial",
        "-out",
        d / "cert.pem",
        "-days",
        "7",
        "-extfile",
        d / "server.ext",
    )
    return {"ca": str(d / "ca.pem"), "cert": str(d / "cert.pem"), "key": str(d / "key.pem")}
