"""What a registry is told about who asks: the operator's credentials, and where they may go.

Basic credentials come from BUILDER_REGISTRY_USER / BUILDER_REGISTRY_PASSWORD, else from the docker
client's config through the docker SDK (credHelpers, credsStore, auths), asked only once a registry
wants them; they are kept in memory, never written or printed. A 401's challenge is answered with them
(Basic) or with a bearer token from the token service the challenge names (its realm). Basic credentials
go to the registry's own host only, and to a token service over https, or over plain http on the
registry's own host when the registry itself is plain http: anywhere else, anyone on the way reads them.
"""

from __future__ import annotations

import base64
import json
import os
import re
import urllib.error
import warnings
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode, urlsplit

from builder.errors import ResolveError


def network_reason(e: BaseException) -> str:
    """One short line for why a URL could not be read: the HTTP status, the socket error, or the kind."""
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return type(e).__name__


def docker_config_credentials(registry: str) -> tuple[str, str] | None:
    """(user, password) for ``registry`` as the docker client would find them, read through the docker
    SDK's own config and credential-store support (``docker.auth``): the config file
    (``$DOCKER_CONFIG/config.json``, else ``~/.docker/config.json``); the credential helper its
    ``credHelpers`` names for the registry, else its ``credsStore`` (``docker-credential-NAME get``, the
    helper protocol: where nvcr.io's and cloud registries' tokens live), else its ``auths`` entry, as
    ``docker login`` writes it. None when it has none. The secret is kept in memory only: never
    written or printed. ResolveError naming the helper when it fails."""
    # the SDK (a quarter of a second to load) only here, where a registry has asked for credentials
    from docker import auth, errors

    where = f"registry {registry}"
    try:
        with warnings.catch_warnings():  # (a helper not on PATH: the SDK warns, then fails to run it)
            warnings.simplefilter("ignore")
            found = auth.load_config().resolve_authconfig(registry)
    except errors.DockerException as e:
        from builder.foundation.dockerio import credential_helper_problem  # (the SDK is loaded already)

        missing = credential_helper_problem(e)
        why = missing or " ".join(str(e).split())[:200]  # (what the helper said about itself: no secret in it)
        raise ResolveError(f"{where}: the docker config's credential helper failed: {why}") from None
    if not found:
        return None
    if found.get("IdentityToken"):
        raise ResolveError(f"{where}: the docker config gives an identity token (an OAuth refresh token), which "
                           "builder does not send; set BUILDER_REGISTRY_USER and BUILDER_REGISTRY_PASSWORD")
    user = found.get("Username") or found.get("username")
    password = found.get("Password") or found.get("password")
    if not isinstance(user, str) or not isinstance(password, str) or not user:
        return None
    return user, password


#: opens a token service's URL with the Authorization value given (None: none sent); returns the
#: response, a context manager with ``read``
TokenOpener = Callable[[str, str | None], Any]


class RegistryAuth:
    """The Authorization a client sends to one repository of one registry, and the answer to its 401s."""

    def __init__(self, registry: str, repository: str, base_url: str, *, push: bool) -> None:
        self.registry = registry
        self.repository = repository
        self.base_url = base_url
        self.push = push
        #: the Authorization value sent (None until a 401 asked for one)
        self.header: str | None = None
        self.user = os.environ.get("BUILDER_REGISTRY_USER")
        self.password = os.environ.get("BUILDER_REGISTRY_PASSWORD")
        #: whether the docker config was asked yet: only once a registry wants credentials (a helper runs
        #: a program, and the docker SDK takes a quarter of a second to load)
        self._asked_docker = self.user is not None and self.password is not None
        #: where the credentials sent came from (for an error that says why they were refused)
        self.creds_from = "BUILDER_REGISTRY_USER and BUILDER_REGISTRY_PASSWORD" if self._asked_docker else None

    def _where(self) -> str:
        return f"{self.registry}/{self.repository}"

    def _basic(self) -> str | None:
        if not self._asked_docker:
            self._asked_docker = True
            creds = docker_config_credentials(self.registry)
            if creds is not None:
                self.user, self.password = creds
                self.creds_from = "the docker config"
        if self.user is None or self.password is None:
            return None
        return "Basic " + base64.b64encode(f"{self.user}:{self.password}".encode()).decode()

    def for_url(self, url: str) -> str | None:
        """What a request to ``url`` carries: Basic credentials go to the registry's own host only (an
        upload Location elsewhere, such as a blob store, gets the request without them)."""
        if self.header is not None and self.header.startswith("Basic ") and not self._own_host(url):
            return None
        return self.header

    def _own_host(self, url: str) -> bool:
        return (urlsplit(url).hostname or "") == urlsplit(self.base_url).hostname

    def _token_url_refused(self, url: str) -> str | None:
        """Why the token service at ``url`` (a challenge's realm) is not asked (None: it is)."""
        scheme = urlsplit(url).scheme.lower()
        if scheme == "https":
            return None
        if scheme != "http":
            return f"not an http(s) URL ({scheme or 'no scheme'})"
        if not self._own_host(url):
            return "plain http on another host than the registry (credentials go there over https only)"
        if urlsplit(self.base_url).scheme != "http":
            return "plain http, while the registry itself is reached over https"
        return None

    def refused(self) -> str:
        """One line for a registry that refused the credentials sent: the registry, where they came from,
        and the fix."""
        host = self.registry
        cause = (f"it refused the credentials from {self.creds_from}" if self.creds_from else
                 "it refused the request, and no credentials are set for it")
        return (f"registry {host}: authentication failed (401): {cause} (fix: `docker login {host}` with an "
                f"account that may {'push' if self.push else 'pull'} there, or set BUILDER_REGISTRY_USER and "
                "BUILDER_REGISTRY_PASSWORD)")

    def answer(self, challenge: str, open_token: TokenOpener) -> None:
        """Meet a 401's ``WWW-Authenticate`` challenge: Basic credentials, or a bearer token asked of the
        challenge's token service through ``open_token``. ResolveError, one line, where neither can be."""
        scheme, _, params = challenge.partition(" ")
        fields = dict(re.findall(r'(\w+)="([^"]*)"', params))
        if scheme.lower() == "basic":
            basic = self._basic()
            if basic is None:
                host = self.registry
                raise ResolveError(f"{self._where()}: authentication failed (401): the registry wants credentials "
                                   f"and none are set for {host} (fix: `docker login {host}`, "
                                   "or set BUILDER_REGISTRY_USER and BUILDER_REGISTRY_PASSWORD)")
            self.header = basic
            return
        if scheme.lower() != "bearer" or "realm" not in fields:
            raise ResolveError(f"{self._where()}: unsupported registry authentication: {scheme or 'none'}")
        query = {"service": fields.get("service", "")}
        wanted = "pull,push" if self.push else "pull"
        query["scope"] = fields.get("scope") or f"repository:{self.repository}:{wanted}"
        token_url = f"{fields['realm']}?{urlencode(query)}"
        why = self._token_url_refused(fields["realm"])
        if why is not None:
            raise ResolveError(f"registry {self.registry}: token URL {fields['realm']} refused: {why}")
        try:
            with open_token(token_url, self._basic()) as resp:
                data = json.loads(resp.read(1024 * 1024))
        except urllib.error.HTTPError as e:
            if e.code == 401:
                raise ResolveError(self.refused()) from None
            raise ResolveError(f"{self._where()}: token request refused: HTTP {e.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ResolveError(f"{self._where()}: token request failed: {network_reason(e)}") from None
        token = data.get("token") or data.get("access_token")
        if not isinstance(token, str) or not token:
            raise ResolveError(f"{self._where()}: the token service gave no token")
        self.header = f"Bearer {token}"
