"""Object storage (S3 and S3-compatible stores: AWS, MinIO, Ceph RGW; other fsspec URLs): one small
client, and the ``storage_options`` config mapping that ``data.storage_options`` and
``checkpoint.storage_options`` share.

The client is obstore (Rust, ``object_store``) for ``s3://``: measured against s3fs on the same
shards from the same endpoint it read whole shards ~1.6x faster and ranged reads with ~5x less
client CPU (docs/data.md). Any other scheme (``gs://``, ``memory://``, ...) goes through fsspec,
when the filesystem for it is installed. Credentials come from where boto3 finds them
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the
config files, an instance role); the endpoint from ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``.
``storage_options`` may override endpoint, addressing style, region and profile, but never holds a
secret, so neither a config file nor a run directory ever does.

What names a place is checked as a place before any client is made: the options are a closed set
of typed values (a region is ``[a-z0-9-]``, an endpoint a host and port without ``user@``, query or
fragment), every URL is parsed once (:func:`parse_url`) into bucket and prefix with ``..``, empty
segments, whitespace, ``?``, ``#`` and control characters refused naming the setting, a key is
checked the same way before each request, and a listing leaves out (and names) keys that no client
can read instead of failing the prefix. Every failure leaves a
:class:`Store` method as a :class:`UserError` (credentials, permissions, no such bucket: exit 2) or
a :class:`RunError` (the store did not answer after ``retries`` attempts with exponential backoff:
exit 1), one line, with the secrets of the environment taken out.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hpctrain.core.atomic import replace_durably
from hpctrain.core.errors import HpctrainError, RunError, UserError
from hpctrain.core.section import ConfigError

log = logging.getLogger("hpctrain")
ADDRESSING = ("path", "virtual", "auto")
DEFAULT_RETRIES = 4  # attempts after the first: 0.2 + 0.4 + 0.8 + 1.6 s of backoff before giving up
MAX_RETRIES = 100  # beyond any store's outage worth waiting out; the client's counters stay in range
_OPTIONS: dict[str, str] = {
    "endpoint_url": "the S3 endpoint, e.g. http://minio.site:9000 (default: AWS_ENDPOINT_URL, else AWS)",
    "addressing_style": "path (MinIO, Ceph RGW) | virtual | auto (virtual on AWS, path elsewhere)",
    "region": "the bucket's region, [a-z0-9-] (default: AWS_DEFAULT_REGION / the profile's, else us-east-1)",
    "profile": "a profile of ~/.aws/config to take credentials and region from (default: AWS_PROFILE)",
    "anon": "true: unsigned requests (a public bucket)",
    "retries": "attempts after the first for a store that does not answer (default 4, backoff from 0.2 s)",
}
_SECRET_WORDS = ("secret", "password", "token", "key", "credential")
_SECRET_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID",
                "GOOGLE_APPLICATION_CREDENTIALS", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN")
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+)://")
Chunks = list[bytes]  # (an alias: inside the classes below, `list` is their method)


def is_url(path: str | os.PathLike[str] | None) -> bool:
    """``s3://b/p`` and other ``scheme://`` locations (not ``file://``, not a local path)."""
    if path is None or not isinstance(path, str):
        return False
    m = _URL.match(path)
    return m is not None and m.group(1).lower() != "file"


def check_storage_options(key: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` checked (a ConfigError naming ``key.NAME`` with a hint) and normalized.

    A closed set of typed values: every one of them ends up in a request (the endpoint, the host
    name a region makes, the signature), so each is held to the form its kind has and nothing
    else; no text of the config reaches a client unchecked."""
    if not isinstance(options, Mapping):
        raise ConfigError(f"{key}={options!r} must be a mapping of {', '.join(_OPTIONS)}")
    out: dict[str, Any] = {}
    for name, value in options.items():
        where = f"{key}.{name}"
        if name not in _OPTIONS:
            if any(w in str(name).lower() for w in _SECRET_WORDS):
                raise ConfigError(f"{where}: credentials do not belong in the config (it is copied into the run "
                                  "directory); hint: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the job's "
                                  f"environment, or {key}.profile=NAME")
            raise ConfigError(f"unknown key '{where}'; valid keys: {', '.join(_OPTIONS)}")
        out[name] = _CHECKS[name](where, value)
    return out


_REGION = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,62})")  # us-east-1, eu-central-2, a MinIO site's "garage-1"
_PROFILE = re.compile(r"[A-Za-z0-9_.@+:-]{1,128}")  # a section name of ~/.aws/config
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]+\]")  # a DNS name, IPv4, [IPv6]
_ENDPOINT_PATH = re.compile(r"(?:/[A-Za-z0-9._~-]+)*/?")  # a store behind a reverse proxy's path, or none


def _check_endpoint(where: str, value: Any) -> str:
    """An http(s) URL of a host (and port, and a plain path): nothing that could name another host
    (``user@``), nor a query or fragment that would cut the request's path off."""
    hint = f"hint: {where}=http://HOST:PORT"
    if not isinstance(value, str) or _UNSAFE.search(value) or not re.match(r"^https?://[^/]", value):
        raise ConfigError(f"{where}={value!r} is not an http(s) URL; {hint}")
    parts = urlsplit(value)
    if "@" in parts.netloc:
        raise ConfigError(f"{where}: credentials do not belong in the endpoint URL; hint: set AWS_ACCESS_KEY_ID "
                          "and AWS_SECRET_ACCESS_KEY in the job's environment")
    host = parts.netloc.rsplit(":", 1)[0] if not parts.netloc.endswith("]") else parts.netloc
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if (not _HOST.fullmatch(host) or not port_ok or parts.query or parts.fragment or "?" in value or "#" in value
            or not _ENDPOINT_PATH.fullmatch(parts.path) or ".." in parts.path.split("/")):
        raise ConfigError(f"{where}={value!r} is not an http(s) URL of a host and port (no query, fragment or '..'); "
                          f"{hint}")
    return value.rstrip("/")


def _check_choice(where: str, value: Any) -> str:
    if value not in ADDRESSING:
        raise ConfigError(f"{where}={value!r} is not allowed; choose one of: {', '.join(ADDRESSING)}")
    return str(value)


def _check_region(where: str, value: Any) -> str:
    if not isinstance(value, str) or not _REGION.fullmatch(value):
        raise ConfigError(f"{where}={value!r} is not a region name (lower-case letters, digits and '-', e.g. "
                          f"us-east-1); hint: {where}=us-east-1, or leave it unset")
    return value


def _check_profile(where: str, value: Any) -> str:
    if not isinstance(value, str) or not _PROFILE.fullmatch(value):
        raise ConfigError(f"{where}={value!r} is not a profile name (letters, digits, '_', '.', '@', '+', ':', '-'); "
                          "hint: the name of a [profile NAME] section of ~/.aws/config")
    return value


def _check_anon(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}={value!r} must be true or false")
    return value


def _check_retries(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RETRIES:
        raise ConfigError(f"{where}={value!r} must be a whole number from 0 to {MAX_RETRIES}")
    return value


_CHECKS: dict[str, Any] = {"endpoint_url": _check_endpoint, "addressing_style": _check_choice,
                           "region": _check_region, "profile": _check_profile, "anon": _check_anon,
                           "retries": _check_retries}


def redact(text: str) -> str:
    """``text`` without the values of the environment's credential variables, nor a URL's password."""
    for var in _SECRET_VARS:
        value = os.environ.get(var)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return re.sub(r"(://[^/\s:@]+):[^/\s@]+@", r"\1:***@", text)


# ---------------------------------------------------------------- URLs and keys

# what no object key hpctrain writes holds, and what a client or a server could read as something else:
# whitespace, '?' and '#' (a query, a fragment), a backslash, control characters (C0, DEL, C1)
_UNSAFE = re.compile(r"[\s?#\\\x00-\x1f\x7f-\x9f]")
_BUCKET = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")  # S3's rules, and Ceph's older ones
_URL_HINT = "hint: s3://BUCKET/PREFIX, without '..', '//', spaces, '?', '#' or control characters"


class StoreUrlError(ConfigError):
    """A URL (or a key in one) that names no object hpctrain reads: refused before any client sees it."""


@dataclass(frozen=True)
class StoreUrl:
    """``scheme://bucket/prefix`` parsed once: every client and message takes its parts from here."""

    scheme: str
    bucket: str
    prefix: str  # no slash at either end; its segments checked (:func:`key_problem`)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")


def key_problem(key: str) -> str | None:
    """Why ``key`` (an object key or a prefix, ``/``-separated) names no object hpctrain reads, in
    words; None when it is fine. obstore refuses (or panics on) the same keys."""
    for segment in key.split("/"):
        if segment == "":
            return "an empty segment ('//', or a leading '/')"
        if segment in (".", ".."):
            return f"a {segment!r} segment"
    bad = _UNSAFE.search(key)
    if bad is None:
        return None
    char = bad.group()
    named = {" ": "a space", "?": "a '?'", "#": "a '#'", "\\": "a backslash"}.get(char)
    return named or (f"the whitespace {char!r}" if char.isspace() else f"the control character {char!r}")


def parse_url(url: str | StoreUrl, key: str = "URL") -> StoreUrl:
    """``url`` as (scheme, bucket, prefix), or :class:`StoreUrlError` (exit 2, one line) naming
    ``key`` (the config key or argument that gave it) and the URL: a bucket that is not a bucket
    name, a prefix with an empty, ``.`` or ``..`` segment, whitespace, ``?``, ``#``, a backslash or a
    control character. Trailing slashes are dropped. The one parser of every object-store URL
    (``data.path``, ``data.mix[i].path``, ``checkpoint.remote``, ``hpctrain data|ckpt ... URL``)."""
    if isinstance(url, StoreUrl):
        return url
    m = _URL.match(url) if isinstance(url, str) else None
    if m is None:
        raise StoreUrlError(f"{key}={url!r} is not a URL; {_URL_HINT}")
    bucket, _, prefix = url[m.end():].partition("/")
    if not bucket:
        raise StoreUrlError(f"{key}={url!r} names no bucket; {_URL_HINT}")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise StoreUrlError(f"{key}={url!r}: {bucket!r} is not a bucket name (letters, digits, '.', '-', '_'; at "
                            f"most 63); {_URL_HINT}")
    prefix = prefix.rstrip("/")
    problem = key_problem(prefix) if prefix else None
    if problem:
        raise StoreUrlError(f"{key}={url!r}: its path has {problem}; {_URL_HINT}")
    return StoreUrl(m.group(1).lower(), bucket, prefix)


def open_store(url: str | StoreUrl, options: Mapping[str, Any] | None = None, *, key: str = "URL") -> Store:
    """The client for ``url`` (``s3://bucket/prefix`` or another fsspec URL); keys are relative to it.
    ``url`` and ``options`` are checked before a client is made (``key`` names the URL's setting)."""
    opts = check_storage_options("storage_options", options or {})
    place = parse_url(url, key)
    if place.scheme in ("s3", "s3a"):
        if _OBSTORE_PID[0] not in (None, os.getpid()):
            # a process forked from one that ran obstore (a DataLoader worker): obstore's runtime did not
            # survive the fork and would hang, so this process reads through boto3's client
            return Store(place, _Boto3Backend(place, opts), opts)
        return Store(place, _S3Backend(place, opts), opts)
    return Store(place, _FsspecBackend(place, opts), opts)


_OBSTORE_PID: list[int | None] = [None]  # the process that started obstore's runtime (inherited by a fork)


class Store:
    """List / read / read a range / write / delete objects under one root URL.

    Thread-safe (the backends are), and picklable (a DataLoader worker re-opens the connection)."""

    def __init__(self, place: StoreUrl, backend: Any, options: dict[str, Any]) -> None:
        self.place, self.url, self._backend, self.options = place, place.url, backend, options

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        fresh = open_store(state["url"], state["options"])
        self.__dict__.update(fresh.__dict__)

    def where(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _call(self, what: str, key: str, fn: Any, *args: Any) -> Any:
        problem = key_problem(key) if key else None
        if problem:  # a key from a manifest or a caller: refused here, never handed to the client
            raise StoreUrlError(f"{what} {self.where(key)}: the key has {problem}; no object hpctrain writes is "
                                "named so; hint: check the manifest or the path that named it")
        try:
            return fn(*args)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.where(key)} does not exist") from None
        except HpctrainError:
            raise
        except Exception as err:  # noqa: BLE001 - every client error is named here, once, without secrets
            raise storage_error(err, f"{what} {self.where(key)}") from None

    def list(self, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix`` (recursive): key -> size in bytes. Keys no hpctrain writer
        makes and no client reads (a ``..`` or empty segment, ``?``, ...) are left out, named in
        one warning: a stray object must not make the whole prefix unreadable."""
        bare = prefix.rstrip("/")  # "step-1/": the objects in that folder (the key checked is its name)
        found: dict[str, int] = self._call("listing", bare, self._backend.list, prefix)
        return skip_unreadable(self.where(bare), found)

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except FileNotFoundError:
            return False
        return True

    def size(self, key: str) -> int:
        return int(self._call("reading", key, self._backend.size, key))

    def read(self, key: str) -> bytes:
        return bytes(self._call("reading", key, self._backend.read, key))

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``key`` (fewer where the object is shorter)."""
        if end <= start:
            return b""
        return bytes(self._call("reading", key, self._backend.read_range, key, start, end))

    def read_ranges(self, key: str, starts: Sequence[int], ends: Sequence[int]) -> Chunks:
        """Several ranges of one object in one call (the client coalesces and parallelizes them)."""
        if not starts:
            return []
        return [bytes(b) for b in self._call("reading", key, self._backend.read_ranges, key, starts, ends)]

    def write(self, key: str, data: bytes) -> None:
        self._call("writing", key, self._backend.write, key, data)

    def put_file(self, key: str, local: str | Path) -> None:
        self._call("uploading to", key, self._backend.put_file, key, Path(local))

    def get_file(self, key: str, local: str | Path) -> None:
        """Download ``key`` to ``local`` whole or not at all, durably (a temporary name, fsynced, then
        a rename and the directory's fsync: a crash after return cannot lose it)."""
        dst = Path(local)
        tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
        try:
            self._call("downloading", key, self._backend.get_file, key, tmp)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            replace_durably(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)

    def delete(self, key: str) -> None:
        """Remove ``key``; a key that is not there is no error."""
        try:
            self._call("deleting", key, self._backend.delete, key)
        except FileNotFoundError:
            pass


def skip_unreadable(where: str, found: Mapping[str, int]) -> dict[str, int]:
    """``found`` (key -> size) without the keys :func:`key_problem` refuses, which one warning names
    (the first five); a directory marker (``dir/``, as consoles make) is dropped without a word."""
    kept: dict[str, int] = {}
    bad: list[str] = []
    for key, size in found.items():
        if key.endswith("/") and not key_problem(key.rstrip("/") or "x"):
            continue
        if key_problem(key):
            bad.append(key)
        else:
            kept[key] = size
    if bad:
        shown = ", ".join(repr(k) for k in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        log.warning("listing %s: skipped %d key(s) that name no object hpctrain reads (an empty, '.' or '..' segment, "
                    "whitespace, '?', '#', a backslash or a control character): %s; hint: rename or remove them",
                    redact(where), len(bad), shown)
    return kept


# ---------------------------------------------------------------- errors

_USER_WORDS = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "NoSuchBucket", "ExpiredToken",
               "InvalidToken", "Forbidden", "403", "401", "credential", "Unauthenticated", "PermissionDenied")


def storage_error(err: BaseException, what: str) -> HpctrainError:
    """``err`` of a client as hpctrain's error: the user's (exit 2) when the store refused the
    credentials or has no such bucket, the run's (exit 1) when it did not answer."""
    detail = redact(" ".join(f"{type(err).__name__}: {err}".split()))[:300]
    if any(w.lower() in detail.lower() for w in _USER_WORDS) and "connect" not in detail.lower():
        return UserError(f"{what}: the store refused the request ({_short(detail)}); hint: check the credentials "
                         "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE), the bucket name and the endpoint "
                         "(AWS_ENDPOINT_URL or storage_options.endpoint_url)")
    return RunError(f"{what} failed after the retries ({_short(detail)}); hint: check that the store is up and "
                    "reachable, then run again (training resumes from its last checkpoint)")


def _short(detail: str) -> str:
    code = re.search(r"<Code>(\w+)</Code>", detail)
    if code:  # an S3 error document: its code says it all (InvalidAccessKeyId, NoSuchBucket, ...)
        return code.group(1)
    for word in _USER_WORDS + ("Connection refused", "connect", "timed out", "Timeout", "500", "503"):
        i = detail.find(word)
        if i >= 0:
            return detail[max(0, i - 40): i + 80].strip()
    return detail[:160]


# ---------------------------------------------------------------- backends


def _endpoint(opts: Mapping[str, Any]) -> str | None:
    """The endpoint: the option's (checked with the config), else the environment's, held to the same
    form (a variable set by a site's module is as likely to carry a stray character)."""
    if opts.get("endpoint_url"):
        return str(opts["endpoint_url"])
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(var):
            try:
                return _check_endpoint(var, os.environ[var])
            except ConfigError as err:
                raise UserError(f"{err} (in the environment)") from None
    return None


def _session(opts: Mapping[str, Any]) -> Any:
    import boto3  # type: ignore[import-untyped]  # optional: the s3 extra; resolves credentials the way every AWS tool does

    profile = opts.get("profile")
    try:
        return boto3.Session(profile_name=profile) if profile else boto3.Session()
    except Exception as err:  # noqa: BLE001 - ProfileNotFound and friends: the user's setting
        raise UserError(f"storage_options.profile={profile!r}: {redact(str(err))}; hint: a profile of "
                        "~/.aws/config, or unset it") from None


def _region(opts: Mapping[str, Any], session: Any) -> str:
    """The option's region (checked with the config), else the environment's or the profile's, held to
    the same form: the region is part of the host name every request goes to."""
    region = opts.get("region") or session.region_name or "us-east-1"
    if not _REGION.fullmatch(str(region)):
        raise UserError(f"the region {region!r} (from AWS_DEFAULT_REGION or the profile) is not a region "
                        "name (lower-case letters, digits and '-'); hint: set storage_options.region=us-east-1, or fix "
                        "the variable or the profile")
    return str(region)


def _s3_settings(place: StoreUrl, opts: Mapping[str, Any]) -> tuple[Any, str | None, str, bool, int]:
    """(boto3 session, endpoint, region, virtual-hosted addressing, retries) for ``place``."""
    session = _session(opts)
    endpoint = _endpoint(opts)
    region = _region(opts, session)
    style = opts.get("addressing_style", "auto")
    virtual = style == "virtual" or (style == "auto" and not endpoint)  # MinIO and Ceph serve paths
    if not opts.get("anon") and session.get_credentials() is None:
        raise UserError(f"{place.url}: no credentials found; hint: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                        "(or AWS_PROFILE) in the job's environment, or storage_options.anon=true for a public bucket")
    return session, endpoint, region, virtual, int(opts.get("retries", DEFAULT_RETRIES))


class _S3Backend:
    """obstore's S3Store over one bucket and prefix."""

    def __init__(self, place: StoreUrl, opts: Mapping[str, Any]) -> None:
        try:
            import obstore  # optional: the s3 extra
            from obstore.store import S3Store  # optional: the s3 extra
        except ImportError:
            raise UserError(f"{place.url}: reading object storage needs obstore and boto3; hint: pip install "
                            "'hpctrain[s3]'") from None
        self._obs, self._place, self._opts = obstore, place, opts
        session, endpoint, region, virtual, retries = _s3_settings(place, opts)
        config: dict[str, Any] = {"region": region, "virtual_hosted_style_request": virtual}
        if endpoint:
            config["endpoint"] = endpoint
        retry = {"max_retries": retries, "retry_timeout": timedelta(seconds=30 + 10 * retries),
                 "backoff": {"init_backoff": timedelta(seconds=0.2), "max_backoff": timedelta(seconds=5), "base": 2}}
        client = {"allow_http": bool(endpoint and endpoint.startswith("http://")), "connect_timeout": "5s",
                  "timeout": "120s"}
        provider = None
        if opts.get("anon"):
            config["skip_signature"] = True
        else:
            from obstore.auth.boto3 import Boto3CredentialProvider  # optional: the s3 extra

            provider = Boto3CredentialProvider(session)
        _OBSTORE_PID[0] = os.getpid()
        self.store = S3Store(place.bucket, prefix=place.prefix or None, config=config,  # type: ignore[arg-type]
                             client_options=client, retry_config=retry,  # type: ignore[arg-type]
                             credential_provider=provider)  # type: ignore[arg-type]

    def _missing(self, err: Exception) -> bool:
        return isinstance(err, self._obs.exceptions.NotFoundError) or isinstance(err, FileNotFoundError)

    def _get(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self.store, *args, **kwargs)
        except Exception as err:
            if self._missing(err):
                raise FileNotFoundError(args[0] if args else "") from None
            raise

    def list(self, prefix: str) -> dict[str, int]:
        out: dict[str, int] = {}
        try:
            for batch in self._obs.list(self.store, prefix or None):
                for meta in batch:
                    out[str(meta["path"])] = int(meta["size"])
        except self._obs.exceptions.InvalidPathError:
            # a key obstore cannot parse (a '..' or '//' in it) fails the whole listing: boto3's keeps
            # every key as it is, and Store.list leaves out (and names) the ones hpctrain cannot read
            return _Boto3Backend(self._place, self._opts).list(prefix)
        return out

    def size(self, key: str) -> int:
        return int(self._get(self._obs.head, key)["size"])

    def read(self, key: str) -> bytes:
        return bytes(self._get(self._obs.get, key).bytes())

    def read_range(self, key: str, start: int, end: int) -> bytes:
        return bytes(self._get(self._obs.get_range, key, start=start, end=end))

    def read_ranges(self, key: str, starts: Sequence[int], ends: Sequence[int]) -> Chunks:
        return [bytes(b) for b in self._get(self._obs.get_ranges, key, starts=starts, ends=ends)]

    def write(self, key: str, data: bytes) -> None:
        self._obs.put(self.store, key, data)

    def put_file(self, key: str, local: Path) -> None:
        self._obs.put(self.store, key, local)  # multipart for large files, parts in parallel

    def get_file(self, key: str, local: Path) -> None:
        with open(local, "wb") as fh:
            for chunk in self._get(self._obs.get, key).stream(min_chunk_size=8 << 20):
                fh.write(chunk)

    def delete(self, key: str) -> None:
        self._obs.delete(self.store, key)


class _Boto3Backend:
    """boto3's client over one bucket and prefix: for a process forked after obstore ran in its parent."""

    def __init__(self, place: StoreUrl, opts: Mapping[str, Any]) -> None:
        from botocore.config import Config  # type: ignore[import-untyped]  # optional: the s3 extra

        self.bucket, self.prefix = place.bucket, f"{place.prefix}/" if place.prefix else ""
        session, endpoint, region, virtual, retries = _s3_settings(place, opts)
        config = Config(region_name=region, connect_timeout=5, read_timeout=120,
                        retries={"max_attempts": retries + 1, "mode": "standard"},
                        s3={"addressing_style": "virtual" if virtual else "path"},
                        **({"signature_version": _unsigned()} if opts.get("anon") else {}))
        self.client = session.client("s3", endpoint_url=endpoint, config=config)

    def _call(self, fn: Any, key: str, **kwargs: Any) -> Any:
        try:
            return fn(Bucket=self.bucket, Key=self.prefix + key, **kwargs)
        except Exception as err:
            code = getattr(err, "response", {}).get("Error", {}).get("Code")
            if code in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(key) from None
            raise

    def list(self, prefix: str) -> dict[str, int]:
        out: dict[str, int] = {}
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                out[obj["Key"][len(self.prefix):]] = int(obj["Size"])
        return out

    def size(self, key: str) -> int:
        return int(self._call(self.client.head_object, key)["ContentLength"])

    def read(self, key: str) -> bytes:
        return bytes(self._call(self.client.get_object, key)["Body"].read())

    def read_range(self, key: str, start: int, end: int) -> bytes:
        return bytes(self._call(self.client.get_object, key, Range=f"bytes={start}-{end - 1}")["Body"].read())

    def read_ranges(self, key: str, starts: Sequence[int], ends: Sequence[int]) -> Chunks:
        return [self.read_range(key, s, e) for s, e in zip(starts, ends)]

    def write(self, key: str, data: bytes) -> None:
        self._call(self.client.put_object, key, Body=data)

    def put_file(self, key: str, local: Path) -> None:
        self.client.upload_file(str(local), self.bucket, self.prefix + key)

    def get_file(self, key: str, local: Path) -> None:
        try:
            self.client.download_file(self.bucket, self.prefix + key, str(local))
        except Exception as err:
            if getattr(err, "response", {}).get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(key) from None
            raise

    def delete(self, key: str) -> None:
        self._call(self.client.delete_object, key)


def _unsigned() -> Any:
    from botocore import UNSIGNED  # type: ignore[import-untyped]  # optional: the s3 extra

    return UNSIGNED


class _FsspecBackend:
    """Any other URL whose fsspec filesystem is installed (gs://, az://, memory://, ...)."""

    def __init__(self, place: StoreUrl, opts: Mapping[str, Any]) -> None:
        try:
            import fsspec  # type: ignore[import-untyped]  # optional: only for URLs other than s3://
        except ImportError:
            raise UserError(f"{place.url}: this URL needs fsspec; hint: pip install fsspec") from None
        try:
            self.fs = fsspec.filesystem(place.scheme)
        except (ImportError, ValueError) as err:
            raise UserError(f"{place.url}: no filesystem for {place.scheme}:// is installed ({err}); hint: install "
                            "the fsspec implementation for it, or use s3://") from None
        self.root = place.url

    def _p(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def list(self, prefix: str) -> dict[str, int]:
        base = self._p("")
        try:
            found = self.fs.find(self._p(prefix), detail=True)
        except FileNotFoundError:
            return {}
        strip = self.fs._strip_protocol(base).rstrip("/") + "/"
        return {self.fs._strip_protocol(p)[len(strip):]: int(info.get("size") or 0) for p, info in found.items()}

    def size(self, key: str) -> int:
        return int(self.fs.size(self._p(key)))

    def read(self, key: str) -> bytes:
        return bytes(self.fs.cat_file(self._p(key)))

    def read_range(self, key: str, start: int, end: int) -> bytes:
        return bytes(self.fs.cat_file(self._p(key), start=start, end=end))

    def read_ranges(self, key: str, starts: Sequence[int], ends: Sequence[int]) -> Chunks:
        return [self.read_range(key, s, e) for s, e in zip(starts, ends)]

    def write(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._p(key), data)

    def put_file(self, key: str, local: Path) -> None:
        self.fs.put_file(str(local), self._p(key))

    def get_file(self, key: str, local: Path) -> None:
        self.fs.get_file(self._p(key), str(local))

    def delete(self, key: str) -> None:
        self.fs.rm_file(self._p(key))
