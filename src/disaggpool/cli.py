"""The `disaggpool` command: one entry point, one subcommand per job.

    disaggpool sim paper [--quick] [--setup both|llama8b|paper] [--json FILE] [--plots DIR]
    disaggpool sim prefix [--quick] [--json FILE] [--plots DIR]
    disaggpool sim autoscale [--quick | --scenario FILE] [--json FILE] [--plots DIR]
                         [--workers N]
    disaggpool sim run --scenario FILE [--json FILE] [--workers N]
    disaggpool plan --scenario FILE --target-goodput X [--max-gpus N] [--json FILE]
    disaggpool profile list
    disaggpool profile show NAME|FILE [--format yaml|json]
    disaggpool emulate --profile NAME|FILE [--port 8000] [...]     (see `disaggpool emulate -h`)
    disaggpool calibrate --endpoint URL [--peer URL] --role prefill|decode --out FILE
                         [--budget-seconds N] [--configmap NS/NAME] [--report FILE]
                         [--configmap-labels K=V,...] [--configmap-owner POOL/UID]
                         [--accept-poor]
    disaggpool operator [--namespace NS ...] [--liveness URL]      (the Kopf operator)
    disaggpool pd-proxy --listen HOST:PORT --model-server URL [...]  (see `disaggpool pd-proxy -h`)

Exit codes: 0 success, 2 bad input (the message names the file or argument and the field),
1 anything unexpected. `calibrate` also: 3 the fit is poor (the profile is still written, with
quality `poor` and the reason; 0 with `--accept-poor`), 4 the pod could not be probed or the
profile not delivered.
Every `calibrate` flag can also come from the environment as DISAGGPOOL_<FLAG> (for Jobs). A pod
started with vLLM's `--api-key` is probed with the key in DISAGGPOOL_API_KEY (an environment
variable only: a flag would show in the process list).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from disaggpool import __version__
from disaggpool.errors import InputError

API_KEY_ENV = "DISAGGPOOL_API_KEY"  # vLLM's --api-key, for `calibrate`

__all__ = ["main"]


def _progress(prefix: str) -> Any:
    """A progress callback drawing one bar per stage on stderr (on a terminal only)."""
    from disaggpool import progress

    bars: dict[str, Any] = {}

    def update(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = progress.bar(
                total=total, desc=f"{prefix}: {stage}", dynamic_ncols=True
            )
        bar.total = total
        bar.n = done
        bar.refresh()
        if done >= total:
            bar.close()

    return update


def _write_json(doc: Any, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n", encoding="utf-8")


def _report_experiment(
    doc: dict[str, Any],
    started: float,
    tables: Callable[[dict[str, Any]], str],
    plots: Callable[[dict[str, Any], Path], list[Path]],
    args: argparse.Namespace,
) -> int:
    """What every `sim` experiment does with its document: tables, timing, JSON, plots."""
    print(tables(doc))
    rows = sum(len(r) for r in doc["experiments"].values())
    print(f"({rows} rows in {time.perf_counter() - started:.1f} s)", file=sys.stderr)
    _write_json(doc, args.json)
    if args.plots:
        for path in plots(doc, Path(args.plots)):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_sim_paper(args: argparse.Namespace) -> int:
    import dataclasses

    from disaggpool.studies import paper, paper_plots, paper_report

    cfg = paper.PaperConfig.quick() if args.quick else paper.PaperConfig()
    if args.setup != "both":
        cfg = dataclasses.replace(cfg, setups=(args.setup,))
    start = time.perf_counter()
    doc = paper.run_paper(cfg, workers=args.workers, progress=_progress("sim paper"))
    return _report_experiment(doc, start, paper_report.tables, paper_plots.write_plots, args)


def cmd_sim_prefix(args: argparse.Namespace) -> int:
    from disaggpool.studies import prefix_report, prefix_study

    cfg = prefix_study.PrefixConfig.quick() if args.quick else prefix_study.PrefixConfig()
    start = time.perf_counter()
    doc = prefix_study.run_prefix(cfg, workers=args.workers, progress=_progress("sim prefix"))
    return _report_experiment(doc, start, prefix_report.tables, prefix_report.write_plots, args)


def cmd_sim_autoscale(args: argparse.Namespace) -> int:
    from disaggpool.studies import autoscale_report, autoscale_study

    start = time.perf_counter()
    progress = _progress("sim autoscale")
    if args.scenario:
        from disaggpool.sim.scenario import load_scenario

        scenario = load_scenario(args.scenario)
        if scenario.autoscaling is None:
            raise InputError(args.scenario, "autoscaling", "missing (SCENARIOS.md, Autoscaling)")
        doc = autoscale_study.run_scenario(scenario, workers=args.workers, progress=progress)
    else:
        cfg = autoscale_study.AutoscaleConfig()
        if args.quick:
            cfg = autoscale_study.AutoscaleConfig.quick()
        if args.min_headroom is not None:
            from disaggpool.core.autoscaling import MAX_HEADROOM

            if not 0.0 <= args.min_headroom <= MAX_HEADROOM:
                raise InputError(
                    "--min-headroom", str(args.min_headroom), f"must be in [0, {MAX_HEADROOM:g}]"
                )
            cfg = dataclasses.replace(cfg, min_headroom=args.min_headroom)
        doc = autoscale_study.run_autoscale(cfg, workers=args.workers, progress=progress)
    return _report_experiment(
        doc, start, autoscale_report.tables, autoscale_report.write_plots, args
    )


def cmd_sim_run(args: argparse.Namespace) -> int:
    from disaggpool.sim import table
    from disaggpool.sim.runner import run_all, staged
    from disaggpool.sim.scenario import load_scenario

    scenario = load_scenario(args.scenario)
    specs = scenario.specs()
    tick = staged(_progress("sim run"), "runs", len(specs))
    rows = run_all(specs, workers=args.workers, progress=tick)
    doc = {"experiments": {"run": rows}}
    print(
        table.render(
            f"run: {scenario.name}",
            [
                {
                    k: r[k]
                    for k in ("policy", "seed", "goodput", "ttft_p99_s", "tpot_p99_s", "requests")
                }
                for r in rows
            ],
        )
    )
    _write_json(doc, args.json)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from disaggpool.sim import plan
    from disaggpool.sim.scenario import load_scenario

    scenario = load_scenario(args.scenario)
    if not 0 < args.target_goodput <= 1:
        raise InputError(
            "--target-goodput", "value", f"must be in (0, 1], got {args.target_goodput}"
        )
    if args.max_gpus is not None and args.max_gpus < 2:
        raise InputError("--max-gpus", "value", f"must be at least 2, got {args.max_gpus}")
    doc = plan.plan_scenario(
        scenario,
        args.target_goodput,
        max_gpus=args.max_gpus,
        workers=args.workers,
        progress=_progress("plan"),
    )
    print(plan.tables(doc))
    _write_json(doc, args.json)
    return 0


def cmd_profile_list(args: argparse.Namespace) -> int:
    from disaggpool.core.hardware import BUILTIN_PROFILES

    for name, p in BUILTIN_PROFILES.items():
        print(f"{name:28s} {p.source:9s} {p.gpu:5s} {p.model}")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from disaggpool.wordtokenizer import Tokenizer

    if args.vocab_size < 16:  # as the emulator's own check
        raise InputError("--vocab-size", "value", f"must be at least 16, got {args.vocab_size}")
    args.directory.mkdir(parents=True, exist_ok=True)
    for name, text in Tokenizer(args.vocab_size).huggingface_files().items():
        (args.directory / name).write_text(text, encoding="utf-8")
    print(f"wrote the emulator's tokenizer (vocabulary {args.vocab_size}) to {args.directory}")
    return 0


def cmd_profile_show(args: argparse.Namespace) -> int:
    from disaggpool.formats.profiles import dump_profile, resolve_profile

    sys.stdout.write(dump_profile(resolve_profile(args.name), args.format))
    return 0


EXIT_POOR_FIT = 3
EXIT_PROBE_FAILED = 4


def cmd_calibrate(args: argparse.Namespace) -> int:
    from disaggpool.calibration import sinks
    from disaggpool.calibration.probe import ProbeConfig, ProbeError, run_probe

    if not args.endpoint:
        raise InputError("--endpoint", "endpoint", "required (or DISAGGPOOL_ENDPOINT)")
    if not args.out and not args.configmap:
        raise InputError("--out", "out", "give --out FILE, --out - (stdout) or --configmap NS/NAME")
    if args.role not in ("prefill", "decode"):  # DISAGGPOOL_ROLE skips argparse's choices
        raise InputError(
            "--role", "role", f"prefill or decode (or DISAGGPOOL_ROLE), got {args.role}"
        )
    owner = sinks.pool_owner(args.configmap_owner)  # None without the flag
    cfg = ProbeConfig(
        endpoint=args.endpoint,
        role=args.role,
        peer=args.peer or None,
        name=args.name or args.endpoint.split("//")[-1].replace(":", "-").strip("/"),
        budget_s=args.budget_seconds,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_bytes_per_token=args.kv_bytes_per_token,
        gpu=args.gpu,
        busy_poll=args.busy_poll,
        api_key=os.environ.get(API_KEY_ENV, ""),
    )
    try:
        started = getattr(args, "started", None)  # set by `main`
        result = run_probe(cfg, progress=_progress("calibrate"), started=started)
    except ProbeError as exc:
        print(f"disaggpool: probe failed: {exc}", file=sys.stderr)
        return EXIT_PROBE_FAILED
    try:
        if args.out:
            sinks.write_profile(result.profile, args.out)
        if args.configmap:
            sinks.write_configmap(
                result.profile,
                args.configmap,
                result.report,
                _labels(args.configmap_labels),
                owner=owner,
            )
    except sinks.SinkError as exc:
        print(f"disaggpool: {exc}", file=sys.stderr)
        return EXIT_PROBE_FAILED
    _write_json(result.report, args.report)
    p = result.profile
    print(
        f"{p.name}: quality {p.quality} ({p.notes}); TTFT error {p.ttft_mape:.1%}, TPOT error "
        f"{p.tpot_mape:.1%}; {result.report['elapsed_s']} s",
        file=sys.stderr,
    )
    return EXIT_POOR_FIT if p.quality == "poor" and not args.accept_poor else 0


def _labels(text: str | None) -> dict[str, str] | None:
    """`k=v,k2=v2` (the --configmap-labels flag) -> a label map; names the bad item."""
    if not text:
        return None
    labels: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or not key:
            raise InputError("--configmap-labels", item, "expected KEY=VALUE[,KEY=VALUE...]")
        labels[key] = value
    return labels


def cmd_operator(args: argparse.Namespace) -> int:
    """Run the Kopf operator (disaggpool.operator.handlers) until interrupted."""
    import logging

    import kopf

    from disaggpool.operator import handlers  # registers the handlers

    handlers.watch_namespaces(args.namespace or ())
    kopf.configure(verbose=args.verbose)  # also sets up logging for the whole process
    logging.getLogger("disaggpool").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness,
    )
    return 0


def _env(name: str, default: Any = None) -> Any:
    import os

    return os.environ.get(f"DISAGGPOOL_{name.upper()}", default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disaggpool", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"disaggpool {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("sim", help="discrete-event simulator").add_subparsers(
        dest="sim_command", required=True
    )
    p = sim.add_parser("paper", help="reproduce the 'Calibrate, Then Route' experiments")
    p.add_argument("--quick", action="store_true", help="every experiment, small (under a minute)")
    p.add_argument(
        "--setup",
        choices=("both", "llama8b", "paper"),
        default="both",
        help="llama8b (Llama-3-8B, 8 GPUs, derived SLOs), paper (the study's Qwen2.5-3B 2P+4D "
        "configuration) or both (default)",
    )
    p.add_argument("--json", metavar="FILE", help="write all rows as JSON")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots of every experiment")
    p.add_argument(
        "--workers", type=int, default=None, help="worker processes (default: CPU count)"
    )
    p.set_defaults(func=cmd_sim_paper)
    x = sim.add_parser("prefix", help="prefix-cache-aware routing on prefix-sharing traffic")
    x.add_argument("--quick", action="store_true", help="every case, small")
    x.add_argument("--json", metavar="FILE", help="write all rows as JSON")
    x.add_argument("--plots", metavar="DIR", help="write PNG plots")
    x.add_argument(
        "--workers", type=int, default=None, help="worker processes (default: CPU count)"
    )
    x.set_defaults(func=cmd_sim_prefix)
    a = sim.add_parser("autoscale", help="autoscalers side by side on time-varying traffic")
    a.add_argument("--quick", action="store_true", help="every traffic shape, small")
    a.add_argument(
        "--min-headroom",
        type=float,
        default=None,
        metavar="H",
        help="ours' floor over the offered load, as autoscaling.minHeadroom (default 0)",
    )
    a.add_argument(
        "--scenario", metavar="FILE", help="your pool and trace, with an autoscaling: section"
    )
    a.add_argument("--json", metavar="FILE", help="write all rows as JSON")
    a.add_argument("--plots", metavar="DIR", help="write PNG plots")
    a.add_argument(
        "--workers", type=int, default=None, help="worker processes (default: CPU count)"
    )
    a.set_defaults(func=cmd_sim_autoscale)
    r = sim.add_parser("run", help="simulate one scenario file")
    r.add_argument("--scenario", required=True, metavar="FILE")
    r.add_argument("--json", metavar="FILE")
    r.add_argument("--workers", type=int, default=None)
    r.set_defaults(func=cmd_sim_run)
    pl = sub.add_parser(
        "plan", help="fewest GPUs and prefill/decode split reaching a goodput, per policy"
    )
    pl.add_argument("--scenario", required=True, metavar="FILE", help="as for `sim run`")
    pl.add_argument("--target-goodput", required=True, type=float, metavar="X")
    pl.add_argument("--max-gpus", type=int, default=None, help="default: twice the file's pool")
    pl.add_argument("--json", metavar="FILE")
    pl.add_argument("--workers", type=int, default=None)
    pl.set_defaults(func=cmd_plan)

    c = sub.add_parser("calibrate", help="probe one vLLM pod and fit its calibration profile")
    c.add_argument(
        "--endpoint",
        default=_env("endpoint"),
        help="the pod's base URL, e.g. http://198.18.0.5:8000",
    )
    c.add_argument(
        "--peer",
        default=_env("peer"),
        help="a prefill pod, to measure the KV transfer into this one",
    )
    c.add_argument(
        "--role",
        choices=("prefill", "decode"),
        default=_env("role"),
        help="the pod's role in its pool (required): nothing on a vLLM pod tells it, and it "
        "decides the verdict of a profile whose KV transfer was not measured",
    )
    c.add_argument("--out", default=_env("out"), help="profile file (.yaml/.json) or - for stdout")
    c.add_argument(
        "--configmap", default=_env("configmap"), metavar="NS/NAME", help="also write a ConfigMap"
    )
    c.add_argument(
        "--report", default=_env("report"), metavar="FILE", help="write the fit report as JSON"
    )
    c.add_argument("--name", default=_env("name"), help="profile name (default: from the endpoint)")
    c.add_argument("--gpu", default=_env("gpu", ""), help="GPU type recorded in the profile")
    c.add_argument(
        "--budget-seconds",
        type=float,
        default=float(_env("budget_seconds", 60)),
        help="time the probe spends measuring (default 60). A stage short of samples runs on, "
        "but the probe, counted from the command's start and its fits included, ends within "
        "1.25x this, cutting a request still in flight (exit 4 if then too few samples); "
        "Python's own start and exit and writing the profile add a few tenths of a second",
    )
    c.add_argument("--max-num-seqs", type=int, default=int(_env("max_num_seqs", 256)))
    c.add_argument(
        "--max-num-batched-tokens", type=int, default=int(_env("max_num_batched_tokens", 2048))
    )
    c.add_argument(
        "--kv-bytes-per-token", type=int, default=int(_env("kv_bytes_per_token", 128 * 1024))
    )
    c.add_argument(
        "--busy-poll",
        action="store_true",
        default=_env("busy_poll", "") not in ("", "0", "false"),
        help="poll instead of sleeping while waiting for answers: sharper sub-millisecond "
        "constants on VMs whose idle CPUs wake slowly, for one busy core (give the Job 1 CPU)",
    )
    c.add_argument(
        "--accept-poor",
        action="store_true",
        default=_env("accept_poor", "") not in ("", "0", "false"),
        help="exit 0 on a poor fit too (the profile is written either way)",
    )
    c.add_argument(
        "--configmap-labels",
        default=_env("configmap_labels"),
        metavar="K=V,...",
        help="labels for the ConfigMap (the operator passes pool, pod and profile=true)",
    )
    c.add_argument(
        "--configmap-owner",
        default=_env("configmap_owner"),
        metavar="POOL/UID",
        help="the DisaggPool owning the ConfigMap (the router counts only its pool's profiles)",
    )
    c.set_defaults(func=cmd_calibrate)

    o = sub.add_parser("operator", help="run the Kopf operator for DisaggPool resources")
    o.add_argument(
        "--namespace",
        action="append",
        metavar="NS",
        help="watch only this namespace (repeatable; default: all namespaces)",
    )
    o.add_argument(
        "--liveness",
        default=_env("liveness"),
        metavar="URL",
        help="serve Kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz",
    )
    o.add_argument("--verbose", action="store_true", help="debug logging")
    o.set_defaults(func=cmd_operator)

    from disaggpool import loadgen
    from disaggpool.demo import cli as demo_cli
    from disaggpool.pdproxy import cli as pdproxy_cli
    from disaggpool.sidecar import cli as sidecar_cli

    sidecar_cli.register(sub)
    pdproxy_cli.register(sub)
    loadgen.register(sub)
    demo_cli.register(sub)

    from disaggpool.emulator import cli as emulator_cli

    e = sub.add_parser("emulate", help="serve a vLLM-compatible emulator timed by a profile")
    emulator_cli.build_parser(e)
    e.set_defaults(func=emulator_cli.run)

    t = sub.add_parser(
        "tokenizer",
        help="write the emulator's tokenizer as a Hugging Face tokenizer directory",
        description="Write the emulator's word tokenizer as a Hugging Face tokenizer directory "
        "(tokenizer.json, tokenizer_config.json): benchmark clients that count tokens "
        "themselves (aiperf, guidellm) then make prompts of the lengths the emulator counts.",
    )
    t.add_argument("directory", type=Path, help="created if missing; its files are replaced")
    t.add_argument("--vocab-size", type=int, default=32000, help="as the emulator's (32000)")
    t.set_defaults(func=cmd_tokenizer)

    prof = sub.add_parser("profile", help="built-in hardware profiles").add_subparsers(
        dest="profile_command", required=True
    )
    prof.add_parser("list", help="list built-in profiles").set_defaults(func=cmd_profile_list)
    s = prof.add_parser("show", help="print a profile in the file format")
    s.add_argument("name", help="built-in name or profile file")
    s.add_argument("--format", choices=("yaml", "json"), default="yaml")
    s.set_defaults(func=cmd_profile_show)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # The command's start: `calibrate`'s budget counts from it, so that the cap holds for the
    # whole command as a user times it (building the parser imports every subcommand's
    # modules, a second or more on a busy machine).
    started = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv, argparse.Namespace(started=started))
    if getattr(args, "workers", None) is not None and args.workers < 1:
        parser.error("--workers: must be at least 1")  # exits 2
    if getattr(args, "budget_seconds", 1.0) <= 0:
        parser.error("--budget-seconds: must be positive")
    try:
        return int(args.func(args))
    except InputError as exc:
        print(f"disaggpool: error: {exc}", file=sys.stderr)
        return 2
