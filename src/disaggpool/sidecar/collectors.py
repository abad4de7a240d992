"""Background tasks that keep the sidecar's `PoolState` current; the hot path never waits on them.

* membership: a static list (once), a YAML file (re-read when it changes) or Kubernetes pods
  selected by label (watched through `kubeclient.Kube.watch`; a pod counts once it is Ready with
  an IP, and its role comes from its `labels.ROLE_LABEL`);
* profiles: a directory of ``<pod>.yaml|.yml|.json`` files (re-read when they change; a mounted
  ConfigMap works) or ConfigMaps selected by label (watched; pod from `labels.POD_LABEL`, the
  profile in key `labels.PROFILE_KEY`, as the calibration Job writes it). A file or ConfigMap that
  does not parse is logged with the field at fault and the pod keeps no profile: never a silent
  default;
* scraping: every pod's `/metrics` each `scrape_interval_s`, concurrently; a pod that refuses
  the connection, or times out or answers garbage `SCRAPE_FAILURES` times in a row, is marked
  unhealthy until a scrape succeeds. A page that is not a vLLM metrics page (NaN or infinite
  gauges, garbage, bytes that are not UTF-8, more than `MAX_METRICS_BYTES`) is one malformed
  scrape of that pod, counted in `disaggpool_scrape_failures_total{pod,reason}`, and nothing else;
* expiry: requests nobody reported on within their lease are forgotten;
* KV events: with `kv_events`, the prefill pods' vLLM KV events (`sidecar.kv_events`).

Each runs under the sidecar's `Supervisor` (`sidecar.supervise`): an error is logged, counted and
retried with backoff; it never ends the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from disaggpool.core.profile import CalibrationProfile, profile_from_dict
from disaggpool.errors import InputError
from disaggpool.formats.fields import FieldReader
from disaggpool.formats.profiles import load_profile, load_yaml
from disaggpool.kubeclient import Kube, parse_selector, path_for, pod_ready
from disaggpool.labels import KIND, POD_LABEL, PROFILE_KEY, ROLE_LABEL, ROLES
from disaggpool.sidecar.config import KubernetesSource, Member, SidecarConfig, parse_members
from disaggpool.sidecar.kv_events import KVEventSubscribers
from disaggpool.sidecar.scrape import MetricsFormatError, parse_gauges
from disaggpool.sidecar.service import RoutingService
from disaggpool.sidecar.supervise import Supervisor

__all__ = ["Collectors", "members_from_pods", "profiles_from_configmaps"]

log = logging.getLogger("disaggpool.sidecar")

SCRAPE_FAILURES = 3  # consecutive slow or malformed scrapes before a pod counts as unhealthy
MAX_METRICS_BYTES = 8 * 1024 * 1024  # vLLM's page is well under 1 MiB; more is not a vLLM pod


def members_from_pods(
    pods: Mapping[str, Mapping[str, Any]], port: int, kv_events_port: int = 0
) -> list[Member]:
    """The Ready, addressable pods with a valid role label; with `kv_events_port`, each prefill
    pod's KV events endpoint on its IP."""
    out = []
    for name, pod in sorted(pods.items()):
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        role = (meta.get("labels") or {}).get(ROLE_LABEL)
        ip = status.get("podIP")
        if role in ROLES and ip and pod_ready(pod) and not meta.get("deletionTimestamp"):
            host = f"[{ip}]" if ":" in ip else ip
            events = (
                f"tcp://{host}:{kv_events_port}" if kv_events_port and role == "prefill" else ""
            )
            out.append(Member(name, role, f"http://{host}:{port}", events))
    return out


def profiles_from_configmaps(
    maps: Mapping[str, Mapping[str, Any]], owner: str = ""
) -> dict[str, CalibrationProfile | InputError]:
    """pod name -> its profile, or the error that stopped it from loading. With `owner`, only
    ConfigMaps owned by that DisaggPool count (`KubernetesSource.owner`)."""
    out: dict[str, CalibrationProfile | InputError] = {}
    for name, cm in sorted(maps.items()):
        meta = cm.get("metadata") or {}
        pod = (meta.get("labels") or {}).get(POD_LABEL)
        if not pod:
            continue
        if owner and not _owned_by(meta, owner):
            if pod not in out:  # a profile the pool owns wins over a stray one for the pod
                out[pod] = InputError(
                    f"configmap/{name}", "metadata.ownerReferences", f"not owned by pool {owner!r}"
                )
            continue
        text = (cm.get("data") or {}).get(PROFILE_KEY)
        source = f"configmap/{name}"
        if text is None:
            out[pod] = InputError(source, PROFILE_KEY, "missing")
            continue
        try:
            out[pod] = profile_from_dict(load_yaml(text), source)
        except InputError as exc:
            out[pod] = exc
        except yaml.YAMLError as exc:  # must not escape: it would end the watch
            out[pod] = InputError(source, PROFILE_KEY, f"not valid YAML: {exc}")
    return out


def _owned_by(meta: Mapping[str, Any], pool: str) -> bool:
    refs = meta.get("ownerReferences")
    return isinstance(refs, list) and any(
        isinstance(r, dict) and r.get("kind") == KIND and r.get("name") == pool for r in refs
    )


def _profile_file(folder: Path, pod: str) -> Path | None:
    for ext in (".yaml", ".yml", ".json"):
        path = folder / f"{pod}{ext}"
        if path.is_file():
            return path
    return None


class Collectors:
    """Starts and stops every background task of one sidecar."""

    def __init__(
        self, service: RoutingService, session: aiohttp.ClientSession, supervisor: Supervisor
    ) -> None:
        self.service = service
        self.supervisor = supervisor
        self.state = service.state
        self.config: SidecarConfig = service.config
        self.session = session
        self._files: dict[str, float] = {}  # path -> mtime seen
        self._profile_errors: dict[str, str] = {}
        self._k8s_profiles: dict[str, CalibrationProfile | InputError] = {}
        self._members_file_error = ""
        self._events: KVEventSubscribers | None = None

    @property
    def profile_errors(self) -> dict[str, str]:
        """pod -> why its profile was last rejected (what the log said)."""
        return dict(self._profile_errors)

    @property
    def members_file_error(self) -> str:
        """Why the members file was last refused, "" once it parses."""
        return self._members_file_error

    def start(self) -> None:
        cfg, sup = self.config, self.supervisor
        every = cfg.scrape_interval_s
        if cfg.static_members:
            self._set_members(cfg.static_members)
        elif cfg.members_file:
            path = cfg.members_file
            sup.periodic("members_file", lambda: self._read_members_file(path), every)
        elif cfg.members_kubernetes is not None:
            pods = cfg.members_kubernetes
            sup.task("watch_pods", lambda: self._watch(pods, "Pod", self._on_pods))
        if cfg.profiles_dir:
            folder = Path(cfg.profiles_dir)
            sup.periodic("profiles_dir", lambda: self._read_profile_dir(folder), every)
        if cfg.profiles_kubernetes is not None:
            maps = cfg.profiles_kubernetes
            sup.task(
                "watch_configmaps", lambda: self._watch(maps, "ConfigMap", self._on_configmaps)
            )
        sup.periodic("scrape", self.scrape_once, every)
        sup.periodic("expire", self._expire, self.service.expiry_period_s)
        if cfg.kv_events is not None:
            self._events = KVEventSubscribers(self.service, cfg.kv_events, sup)
            self._events.start()

    async def stop(self) -> None:
        if self._events is not None:
            await self._events.stop()
            self._events = None

    async def _expire(self) -> None:
        self.service.expire()

    # ------------------------------------------------------------------ membership
    def _set_members(self, members: Any) -> None:
        added, removed = self.state.set_members(members)
        for name in added:
            log.info("pod %s joined the pool", name)
        for name in removed:
            log.info("pod %s left the pool", name)
        if added and self.config.profiles_dir:
            self._files.clear()  # re-read profiles: a new pod may already have one
        if removed:  # a pod that measured its KV transfer may have been the stand-in
            self.service.note_transfer_stand_ins()

    async def _read_members_file(self, path: str) -> None:
        try:
            mtime = Path(path).stat().st_mtime
            if self._files.get(path) != mtime:
                self._files[path] = mtime
                doc = load_yaml(Path(path).read_text(encoding="utf-8"))
                self._set_members(parse_members(doc, FieldReader(path), "<document>"))
                self._members_file_error = ""
        except (OSError, InputError, yaml.YAMLError, UnicodeDecodeError) as exc:
            # A half-written or broken file is the user's to fix, not a loop failure: the next
            # edit is read.
            self._members_file_error = f"{path}: {exc}"
            log.error("pool file %s: %s (keeping the previous membership)", path, exc)

    def _on_pods(self, pods: dict[str, dict[str, Any]]) -> None:
        assert self.config.members_kubernetes is not None
        events = self.config.kv_events
        self._set_members(
            members_from_pods(
                pods, self.config.members_kubernetes.port, events.port if events else 0
            )
        )
        self._apply_profiles()

    async def _watch(
        self, src: KubernetesSource, kind: str, on_change: Callable[[dict[str, Any]], None]
    ) -> None:
        # Missing credentials raise KubeUnavailable: the supervisor retries with backoff and,
        # if they never come, /livez fails and the kubelet restarts the pod, visibly.
        kube = Kube.from_environment(session=self.session)
        selector = parse_selector(src.selector)  # checked when the config was parsed
        await kube.watch(path_for("v1", kind, src.namespace), selector, on_change)

    # ------------------------------------------------------------------ profiles
    def _on_configmaps(self, maps: dict[str, dict[str, Any]]) -> None:
        assert self.config.profiles_kubernetes is not None
        self._k8s_profiles = profiles_from_configmaps(maps, self.config.profiles_kubernetes.owner)
        self._apply_profiles()

    def _apply_profiles(self) -> None:
        """Install the ConfigMap profiles on the current members (pods may come after)."""
        now = self.service.clock()
        for name, inst in self.state.instances.items():
            got = self._k8s_profiles.get(name)
            profile = got if isinstance(got, CalibrationProfile) else None
            if isinstance(got, InputError):
                self._report_profile_error(name, str(got))
            changed = profile != inst.profile
            if changed and self.service.install_profile(name, profile, now) and profile:
                log.info("pod %s: profile %s (%s)", name, profile.name, profile.quality)

    def _report_profile_error(self, pod: str, message: str) -> None:
        self.service.trust.rejected(pod, message)  # scored without a profile; metric; warning
        self._profile_errors[pod] = message

    async def _read_profile_dir(self, folder: Path) -> None:
        now = self.service.clock()
        for name in list(self.state.instances):
            path = _profile_file(folder, name)
            if path is None:
                continue
            try:
                mtime = path.stat().st_mtime
                if self._files.get(str(path)) == mtime:
                    continue
                self._files[str(path)] = mtime
                profile = load_profile(path)
            except (OSError, InputError) as exc:
                self._report_profile_error(name, str(exc))
                continue
            if self.service.install_profile(name, profile, now):
                log.info(
                    "pod %s: profile %s (%s) from %s", name, profile.name, profile.quality, path
                )

    # ------------------------------------------------------------------ scraping and expiry
    async def scrape_once(self) -> None:
        members = [i.member for i in list(self.state.instances.values()) if not i.removed]
        results = await asyncio.gather(*(self._scrape(m) for m in members), return_exceptions=True)
        # An error no scrape expects is the loop's (counted by the supervisor), after every
        # other pod's scrape has been applied.
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _scrape(self, member: Member) -> None:
        # A busy vLLM answers /metrics late; a slow answer is not a dead pod. Only a refused
        # connection (nothing listens) takes a pod out at once; timeouts and bad pages must
        # repeat SCRAPE_FAILURES times in a row (requests that fail still eject it at once).
        timeout = aiohttp.ClientTimeout(total=self.config.scrape_timeout)
        headers = self.service.upstream_headers()
        try:
            async with self.session.get(
                f"{member.url}/metrics", timeout=timeout, headers=headers
            ) as resp:
                if resp.status != 200:
                    raise _ScrapeFailed("http", f"HTTP {resp.status}")
                page = await _read_bounded(resp, MAX_METRICS_BYTES)
            gauges = parse_gauges(page.decode("utf-8"))
        except (
            aiohttp.ClientError, TimeoutError, OSError, MetricsFormatError, UnicodeDecodeError,
            _ScrapeFailed,
        ) as exc:  # fmt: skip
            refused = isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError)
            self.service.metrics.scrape_failures.labels(member.name, _reason(exc)).inc()
            inst = self.state.instances.get(member.name)
            was_healthy = inst is not None and inst.healthy
            self.state.unreachable(member.name, 1 if refused else SCRAPE_FAILURES)
            if was_healthy and inst is not None and not inst.healthy:
                log.warning("pod %s unreachable: %s", member.name, exc or type(exc).__name__)
            return
        inst = self.state.instances.get(member.name)
        if inst is not None and inst.member == member:
            if not inst.healthy:
                log.info("pod %s is healthy again", member.name)
            self.state.scraped(member.name, gauges, self.service.clock())
            if inst.max_model_len is None and not self.config.max_model_len:
                inst.max_model_len = await self._max_model_len(member, timeout, headers)

    async def _max_model_len(
        self, member: Member, timeout: aiohttp.ClientTimeout, headers: Mapping[str, str]
    ) -> int | None:
        """The pod's `max_model_len` from its `/v1/models` (None: ask again next scrape)."""
        try:
            async with self.session.get(
                f"{member.url}/v1/models", timeout=timeout, headers=headers
            ) as resp:
                doc = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return None
        data = doc.get("data") if isinstance(doc, dict) else None
        cards = [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        lengths = [int(m["max_model_len"]) for m in cards if _positive_int(m.get("max_model_len"))]
        return min(lengths) if lengths else None


class _ScrapeFailed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _reason(exc: BaseException) -> str:
    """The `reason` label of a failed scrape."""
    if isinstance(exc, _ScrapeFailed):
        return exc.reason
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return "refused"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, MetricsFormatError | UnicodeDecodeError):
        return "malformed"
    return "connection"


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, or `_ScrapeFailed` past `limit` bytes (a page that size is no vLLM's)."""
    if resp.content_length is not None and resp.content_length > limit:
        raise _ScrapeFailed("malformed", f"page of {resp.content_length} bytes")
    chunks, size = [], 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise _ScrapeFailed("malformed", f"page over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
