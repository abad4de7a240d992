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
  unhealthy until a scrape succeeds;
* expiry: requests nobody reported on within `inflight_ttl_s` are forgotten;
* KV events: with `kv_events`, the prefill pods' vLLM KV events (`sidecar.kv_events`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from disaggpool.core.profile import CalibrationProfile, profile_from_dict
from disaggpool.errors import InputError
from disaggpool.formats.fields import FieldReader
from disaggpool.formats.profiles import load_profile, load_yaml
from disaggpool.kubeclient import Kube, KubeUnavailable, parse_selector, path_for, pod_ready
from disaggpool.labels import POD_LABEL, PROFILE_KEY, ROLE_LABEL, ROLES
from disaggpool.sidecar.config import KubernetesSource, Member, SidecarConfig, parse_members
from disaggpool.sidecar.kv_events import KVEventSubscribers
from disaggpool.sidecar.scrape import MetricsFormatError, parse_gauges
from disaggpool.sidecar.service import RoutingService

__all__ = ["Collectors", "members_from_pods", "profiles_from_configmaps"]

log = logging.getLogger("disaggpool.sidecar")

SCRAPE_FAILURES = 3  # consecutive slow or malformed scrapes before a pod counts as unhealthy


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
    maps: Mapping[str, Mapping[str, Any]],
) -> dict[str, CalibrationProfile | InputError]:
    """pod name -> its profile, or the error that stopped it from loading."""
    out: dict[str, CalibrationProfile | InputError] = {}
    for name, cm in sorted(maps.items()):
        pod = ((cm.get("metadata") or {}).get("labels") or {}).get(POD_LABEL)
        if not pod:
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


def _profile_file(folder: Path, pod: str) -> Path | None:
    for ext in (".yaml", ".yml", ".json"):
        path = folder / f"{pod}{ext}"
        if path.is_file():
            return path
    return None


class Collectors:
    """Starts and stops every background task of one sidecar."""

    def __init__(self, service: RoutingService, session: aiohttp.ClientSession) -> None:
        self.service = service
        self.state = service.state
        self.config: SidecarConfig = service.config
        self.session = session
        self._tasks: list[asyncio.Task[None]] = []
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
        cfg = self.config
        if cfg.static_members:
            self._set_members(cfg.static_members)
        elif cfg.members_file:
            self._spawn(self._poll_file_members(cfg.members_file))
        elif cfg.members_kubernetes is not None:
            self._spawn(self._watch(cfg.members_kubernetes, "Pod", self._on_pods))
        if cfg.profiles_dir:
            self._spawn(self._poll_profile_dir(Path(cfg.profiles_dir)))
        if cfg.profiles_kubernetes is not None:
            self._spawn(self._watch(cfg.profiles_kubernetes, "ConfigMap", self._on_configmaps))
        self._spawn(self._scrape_loop())
        self._spawn(self._expire_loop())
        if cfg.kv_events is not None:
            self._events = KVEventSubscribers(self.service, cfg.kv_events)
            self._events.start()

    async def stop(self) -> None:
        if self._events is not None:
            await self._events.stop()
            self._events = None
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def _spawn(self, coro: Any) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coro))

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

    async def _poll_file_members(self, path: str) -> None:
        while True:
            try:
                mtime = Path(path).stat().st_mtime
                if self._files.get(path) != mtime:
                    self._files[path] = mtime
                    doc = load_yaml(Path(path).read_text(encoding="utf-8"))
                    self._set_members(parse_members(doc, FieldReader(path), "<document>"))
                    self._members_file_error = ""
            except (OSError, InputError, yaml.YAMLError) as exc:
                # A half-written or broken file must not end the poll: the next edit is read.
                self._members_file_error = f"{path}: {exc}"
                log.error("pool file %s: %s (keeping the previous membership)", path, exc)
            await asyncio.sleep(self.config.scrape_interval_s)

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
        try:
            kube = Kube.from_environment(session=self.session)
            selector = parse_selector(src.selector)
        except (KubeUnavailable, ValueError) as exc:
            # Nothing to retry: the sidecar runs without this source, loudly.
            log.error("cannot watch %s %s: %s", src.namespace, kind, exc)
            return
        await kube.watch(path_for("v1", kind, src.namespace), selector, on_change)

    # ------------------------------------------------------------------ profiles
    def _on_configmaps(self, maps: dict[str, dict[str, Any]]) -> None:
        self._k8s_profiles = profiles_from_configmaps(maps)
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
        if self._profile_errors.get(pod) != message:
            self._profile_errors[pod] = message
            log.error("pod %s: profile rejected: %s", pod, message)

    async def _poll_profile_dir(self, folder: Path) -> None:
        while True:
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
            await asyncio.sleep(self.config.scrape_interval_s)

    # ------------------------------------------------------------------ scraping and expiry
    async def scrape_once(self) -> None:
        members = [i.member for i in list(self.state.instances.values()) if not i.removed]
        await asyncio.gather(*(self._scrape(m) for m in members))

    async def _scrape(self, member: Member) -> None:
        # A busy vLLM answers /metrics late; a slow answer is not a dead pod. Only a refused
        # connection (nothing listens) takes a pod out at once; timeouts and bad pages must
        # repeat SCRAPE_FAILURES times in a row (requests that fail still eject it at once).
        timeout = aiohttp.ClientTimeout(total=self.config.scrape_timeout)
        try:
            async with self.session.get(f"{member.url}/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    raise MetricsFormatError(f"HTTP {resp.status}")
                gauges = parse_gauges(await resp.text())
        except (aiohttp.ClientError, TimeoutError, OSError, MetricsFormatError) as exc:
            refused = isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError)
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

    async def _scrape_loop(self) -> None:
        interval = self.config.scrape_interval_s
        while True:
            started = time.monotonic()
            await self.scrape_once()
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(30.0, self.config.inflight_ttl_s / 4))
            self.service.expire()
