"""How well the dataflow simulator predicts measured runs: calibrate on one run, predict the others.

Reads finished run folders (each with trace.json and summary.json; `bench/pipeline.py` writes
runs/bench_pipeline_<mode>_{sync,stream0,stream1}), builds each run's profile
(`planner/calibrate.py`: per-stage exclusive step costs, edges, weight costs), and for every
(calibration run, target run) pair simulates the target's schedule and overlap depth with the
calibration run's costs. The measured figure is the target's own steady-state iteration time
(its trace window over the iterations in it, the same quantity the simulator predicts); the
baseline is the measurement itself, so the table's percentages are the prediction errors
(target: within 15%).

    .venv/bin/python bench/planner.py runs/bench_pipeline_quick_sync runs/bench_pipeline_quick_stream0 \\
        runs/bench_pipeline_quick_stream1            # the table
    .venv/bin/python bench/planner.py RUN... --json  # then one JSON object as the last line
    .venv/bin/python bench/planner.py RUN... --placement colocated   # every stage on one device set

With `--analytic CONFIG [--set KEY=VALUE ...]` (the runs' config and overrides, their schedule
sets left out) it also sets each run's calibrated costs beside the analytic ones of the config
alone (`planner/analytic.py` on this machine's timed figures, `planner/micro_calibration.py`):
seconds per iteration per stage (its steps summed) and the iteration time each predicts.

    .venv/bin/python bench/planner.py runs/bench_pipeline_{sync,stream0,stream1} --analytic configs/text_ppo.yaml \
        --set rollout.stop=[] --set rollout.max_new_tokens=48 ...     # bench/pipeline.py's WORKLOAD

Core lending: the runs are taken to have lent idle cores between the sides (bench/pipeline.py's
and the shipped configs' default; `--no-lending` otherwise): each profile fits each stage's
speed-up alone (`planner/calibrate.py`; printed, "-" where there was too little alone-time to
fit) and the simulator applies it. A target run without actor_forward (overlap_depth >= 1) is
predicted from a profile with it, and the reverse, through `Profile.for_stages`.

Placement: `separated` (the default, bench/pipeline.py's) puts the stages a run had on rollout's
cores (its plan.json: `ROLLOUT_SIDE` of driver/dataflow.py, prompts and rollout, and the config's
`placement.with_rollout`; `ROLLOUT_SIDE` alone where the plan names no cores) on one device set
and every other stage on the other, as the engine placed them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stream_rlhf.config import load_config
from stream_rlhf.driver.dataflow import OFF_BOARD, ROLLOUT_SIDE
from stream_rlhf.driver.plan import preview_plan
from stream_rlhf.planner.calibrate import Profile, profile_from_trace
from stream_rlhf.planner.job_analytic import job_analytic_profile
from stream_rlhf.planner.job_prediction import planned_on_rollout_cores
from stream_rlhf.planner.simulator import simulate
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.telemetry.trace_figures import STEADY_SKIP


def load(run: Path, placement: str) -> tuple[list[dict], dict, dict[str, str]]:
    events = json.loads((run / "trace.json").read_text())["traceEvents"]
    summary = json.loads((run / "summary.json").read_text())
    stages = {e["args"]["stage"] for e in events if e.get("cat") == "step"}
    rollout_side = on_rollout_cores(run)
    devices = {stage: "rollout side" if placement == "separated" and stage in rollout_side else "train side"
               for stage in stages}
    return events, summary, devices


def on_rollout_cores(run: Path) -> set[str]:
    """The stages the run's plan.json put on rollout's cores; `ROLLOUT_SIDE` without cores there."""
    sides = planned_on_rollout_cores(run) or {}
    return {stage for stage, on in sides.items() if on} | ROLLOUT_SIDE


def measured_iteration_s(summary: dict) -> float:
    """The run's steady-state window over the trained iterations in it."""
    iterations = summary["iterations"]
    return summary["trace"]["window_s"] / (iterations - min(STEADY_SKIP, iterations - 1))


def predict(profile: Profile, summary: dict, devices: dict[str, str], lending: bool = False) -> float:
    graph = profile.for_stages(devices).graph(iterations=summary["iterations"], overlap_depth=summary["overlap_depth"],
                          schedule=summary["schedule"], devices=devices, lending=lending)
    return simulate(graph).iteration_s


def label(summary: dict) -> str:
    return "sync" if summary["schedule"] == "sync" else f"stream k={summary['overlap_depth']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders with trace.json and summary.json")
    parser.add_argument("--placement", choices=["separated", "colocated"], default="separated")
    parser.add_argument("--no-lending", dest="lending", action="store_false",
                        help="the runs lent no idle cores (placement.lend_idle_cores=false, or colocated)")
    parser.add_argument("--json", action="store_true", help="one JSON object as the last line")
    parser.add_argument("--analytic", metavar="CONFIG", help="compare with the analytic costs of this config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="with --analytic")
    parser.add_argument("--response-tokens", type=float, help="with --analytic: decode steps per mini-batch")
    args = parser.parse_args()
    runs = {run: load(run, args.placement) for run in args.runs}
    lending = args.lending and args.placement == "separated"
    profiles = {run: profile_from_trace(events, devices, ROLLOUT_SIDE, lending=lending)
                for run, (events, _, devices) in runs.items()}
    if lending:
        print("speed-up alone with lent cores, fitted per stage (planner/calibrate.py; 1: too little alone-time):")
        for run, profile in profiles.items():
            print(f"  {label(runs[run][1]):<14}" + ", ".join(
                f"{stage} {profile.alone_speedup[stage]:.2f}" if stage in profile.alone_speedup else f"{stage} -"
                for stage in profile.step_s if stage not in OFF_BOARD))
    table: dict[str, dict[str, dict[str, float]]] = {}
    for source, profile in profiles.items():
        row = table.setdefault(label(runs[source][1]), {})
        for _target, (_, summary, devices) in runs.items():
            predicted, measured = predict(profile, summary, devices, lending), measured_iteration_s(summary)
            row[label(summary)] = {"predicted_s": round(predicted, 4), "measured_s": round(measured, 4),
                                   "error": round(predicted / measured - 1, 4)}
    targets = list(next(iter(table.values())))
    print("iteration s predicted (error vs measured); rows: the run the costs came from")
    print(f"{'calibrated on':<14}" + "".join(f"{t:>26}" for t in targets))
    for source, row in table.items():
        cells = [f"{row[t]['predicted_s']:.3f} / {row[t]['measured_s']:.3f} ({100 * row[t]['error']:+.0f}%)"
                 for t in targets]
        print(f"{source:<14}" + "".join(f"{c:>26}" for c in cells))
    analytic = {}
    if args.analytic:
        analytic = {}
        for run in args.runs:
            own = label(runs[run][1])
            analytic[own] = compare_analytic(args.analytic, args.set, args.response_tokens, run, profiles[run],
                                             table[own][own]["predicted_s"], runs[run][1], runs[run][2])
    if args.json:
        print(json.dumps({"placement": args.placement, "table": table, "analytic": analytic,
                          "alone_speedup": {label(runs[run][1]): profile.alone_speedup
                                            for run, profile in profiles.items()}}))


def compare_analytic(config: str, sets: list[str], response_tokens: float | None, run: Path, calibrated: Profile,
                     calibrated_iteration_s: float, summary: dict, devices: dict[str, str]
                     ) -> dict[str, dict[str, float]]:
    """Per stage: seconds per iteration, analytic vs calibrated on `run` (printed); and the iteration
    time each profile predicts for the run's schedule (the calibrated one: the table's own cell,
    `calibrated_iteration_s`)."""
    schedule = [f"schedule={summary['schedule']}", f"overlap_depth={summary['overlap_depth']}"]
    cfg = load_config(RLJobConfig, config, [*sets, *schedule])
    analytic, device = job_analytic_profile(cfg, preview_plan(cfg).flow, None, response_tokens=response_tokens)
    rows = {stage: {"analytic_s": round(sum(analytic.step_s[stage]), 5), "calibrated_s": round(sum(cost), 5)}
            for stage, cost in calibrated.step_s.items() if stage in analytic.step_s}
    rows["iteration"] = {"analytic_s": round(predict(analytic, summary, devices), 4),
                         "calibrated_s": calibrated_iteration_s,
                         "measured_s": round(measured_iteration_s(summary), 4)}
    print(f"\n{label(summary)} ({run}): seconds per iteration, analytic ({device.name}) / calibrated")
    for stage, row in rows.items():
        error = row["analytic_s"] / row["calibrated_s"] - 1 if row["calibrated_s"] else float("nan")
        measured = f", measured {row['measured_s']:.3f}" if "measured_s" in row else ""
        print(f"  {stage:<16}{row['analytic_s']:>9.4f} / {row['calibrated_s']:<9.4f} ({100 * error:+.0f}%){measured}")
    return rows


if __name__ == "__main__":
    main()
