"""``python -m cgdp.plan``: predict a training step on hardware you do not have.

Give a model (a built-in paper profile, or a saved :class:`cgdp.planning.profile.StepProfile` JSON measured
on a real device) and a machine (a preset, a JSON :class:`cgdp.planning.hardware.Hardware`, and overrides);
get the predicted step time of CGDP, typical data parallel training and ring allreduce, the chunk
plan the planner picks, which limit binds, and optionally a timeline PNG (needs matplotlib).

Examples::

    python -m cgdp.plan --model resnet152 --minibatch 16 --hardware paper-p100
    python -m cgdp.plan --model vgg16 --hardware pcie4-8gpu-switch --nodes 2 --network-gbps 100
    python -m cgdp.plan --model runs/profile.json --hardware pcie3-4gpu --timeline step.png
    python -m cgdp.plan --model runs/job/metrics.jsonl   # the profile lines cgdp.train wrote
    python -m cgdp.plan --update host --params 1.5e9 --gpus 4 --gpu-memory-gb 24   # per preset

Every user error (a bad number, a missing file) is one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from cgdp.planning.chunks import paper_plan
from cgdp.planning.hardware import PRESETS, Hardware, host_traffic, preset, stage_costs
from cgdp.planning.host_update import UPDATE_BYTES, estimate
from cgdp.planning.paper_profiles import PAPER_MODELS, paper_model
from cgdp.planning.planner import choose_plan
from cgdp.planning.simulator import ModelCosts, SimResult, StageCosts, simulate

LIMITS = {"compute": "backward compute (communication is hidden)", "d2h": "device-to-host link bandwidth",
          "h2d": "host-to-device link bandwidth", "acc": "host accumulation (memory bandwidth / threads)",
          "comm": "network between machines", "sync": "per-chunk synchronisation",
          "gather": "gathering gradients on device 0", "bcast": "broadcasting parameters",
          "reduce": "adding gradients on device 0", "update": "the update on device 0",
          "ring": "ring allreduce over the links",
          "dram": "host DRAM bandwidth ((3G+1) x the gradient bytes per step)",
          "hostcpu": "host CPU (the host thread's work per segment)"}


MAX_GPUS = 64
"""GPUs per machine the cost model is asked about (it has one link per device or switch)."""
MAX_NODES = 4096
LAYER_NOTE = ("layers as in the paper's profile: weighted layers, BatchNorm folded into its convolution; "
              "cgdp.train's models count every BatchNorm as a layer of its own, see docs/train.md")


class PlanError(ValueError):
    """A user error: printed as one line, exit code 2."""


def load_model(spec: str, minibatch: int | None) -> ModelCosts:
    if spec.lower() in PAPER_MODELS:
        try:
            return paper_model(spec, minibatch)
        except ValueError as exc:
            raise PlanError(f"--model {spec}: {exc}") from None
    path = Path(spec)
    if not path.is_file():
        raise PlanError(f"--model {spec!r}: not a built-in model ({', '.join(PAPER_MODELS)}) and no such file")
    from cgdp.planning.calibrate import calibrate
    from cgdp.planning.profile import StepProfile
    try:
        profiles = [StepProfile.from_dict(d) for d in _profile_dicts(path.read_text())]
        if not profiles:
            raise ValueError("it holds no profile (cgdp.train writes one every --profile_every steps)")
        return calibrate(profiles).model
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
        raise PlanError(f"--model {spec}: not a StepProfile JSON (Trainer.last_profile.to_dict()) nor a "
                        f"metrics.jsonl with profile lines: {exc}") from None


def _profile_dicts(text: str) -> list[dict]:
    """A StepProfile JSON (one or a list), or the ``"kind": "profile"`` lines of a metrics.jsonl."""
    try:
        data = json.loads(text)
        return data if isinstance(data, list) else [data]
    except ValueError:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        return [{k: v for k, v in r.items() if k not in ("kind", "step")}
                for r in rows if isinstance(r, dict) and r.get("kind") == "profile"]


def load_hardware(args: argparse.Namespace) -> Hardware:
    if args.hardware in PRESETS:
        hw = preset(args.hardware)
    elif Path(args.hardware).is_file():
        try:
            hw = Hardware.from_dict(json.loads(Path(args.hardware).read_text()))
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise PlanError(f"--hardware {args.hardware}: not a Hardware JSON: {exc}") from None
    else:
        raise PlanError(f"--hardware {args.hardware!r}: not a preset ({', '.join(PRESETS)}) and no such file")
    d = hw.to_dict()
    for key in ("gpus", "pcie_gen", "devices_per_switch", "host_mem_gbps", "host_threads", "nodes",
                "network_gbps", "p2p_gbps", "sync_s", "hook_s", "segment_s"):
        value = getattr(args, key)
        if value is not None:
            d[key] = value
    try:
        hw = Hardware.from_dict(d)
    except (ValueError, TypeError) as exc:
        raise PlanError(f"hardware: {exc}") from None
    for key, value in hw.to_dict().items():  # also what a JSON file said
        if isinstance(value, float) and not (math.isfinite(value) and value >= 0):
            raise PlanError(f"hardware: {key} must be a finite number >= 0, got {value}")
    if hw.gpus > MAX_GPUS or hw.nodes > MAX_NODES:
        raise PlanError(f"hardware: {hw.gpus} GPUs x {hw.nodes} nodes is beyond what the planner models "
                        f"(at most {MAX_GPUS} GPUs per machine and {MAX_NODES} machines)")
    return hw


def _positive(kind: type, what: str):
    """An argparse type: a finite number > 0 (argparse turns the ValueError into exit code 2)."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not (math.isfinite(v) and v > 0):
            raise argparse.ArgumentTypeError(f"must be {what} > 0, got {text}")
        return v
    parse.__name__ = what
    return parse


def host_budget(model: ModelCosts, hw: Hardware, costs: StageCosts, plan: list[list[int]]) -> dict:
    """What one step asks of the host: DRAM traffic against the links, and the host CPU's own
    work (one process: it is serialised across the devices)."""
    G = hw.gpus
    total = sum(model.layer_bytes)
    chunk_bytes = [sum(model.layer_bytes[i] for i in ch) for ch in plan]
    segments = sum(costs.segments(b) for b in chunk_bytes)
    tensors = sum(model.layer_tensors) if model.layer_tensors else model.num_layers
    link = costs.share() * max(total * costs.d2h.per_byte_s, total * costs.h2d.per_byte_s)
    out = {"traffic_bytes": host_traffic(G) * total, "dram_s": host_traffic(G) * total / (hw.host_mem_gbps * 1e9),
           "link_s": link, "hooks_s": G * tensors * costs.hook_s, "sends_s": G * len(plan) * costs.sync_s,
           "host_thread_s": segments * (costs.segment_s + G * costs.segment_device_s), "segments": segments}
    out["host_cpu_s"] = out["hooks_s"] + out["sends_s"] + out["host_thread_s"]
    out["binds"] = "host DRAM" if out["dram_s"] > link else "PCIe"
    return out


def describe(r: SimResult) -> str:
    return f"{r.step_s * 1e3:9.2f} ms   (exposed after backward {r.exposed_s * 1e3:7.2f} ms; limit: {LIMITS.get(r.binding, r.binding)})"


def save_timeline(result: SimResult, path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: timeline PNG skipped (pip install matplotlib)"
    rows = sorted({t.resource or t.kind for t in result.tasks})
    colors = {"compute": "tab:blue", "sync": "tab:gray", "d2h": "tab:orange", "acc": "tab:green",
              "comm": "tab:purple", "h2d": "tab:red"}
    fig, ax = plt.subplots(figsize=(12, 0.4 * len(rows) + 1.5))
    for t in result.tasks:
        if t.duration > 0:
            ax.broken_barh([(t.start * 1e3, t.duration * 1e3)], (rows.index(t.resource or t.kind) - 0.4, 0.8),
                           color=colors.get(t.kind, "tab:olive"))
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("ms after backward starts")
    ax.set_title(f"{result.mode}: backward phase {result.phase_s * 1e3:.2f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"timeline written to {path}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cgdp.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet152", help=f"{', '.join(PAPER_MODELS)} or a StepProfile JSON")
    pos_int, pos_float = _positive(int, "an integer"), _positive(float, "a number")
    ap.add_argument("--minibatch", type=pos_int, default=None, help="per-GPU minibatch (resnet152 only)")
    ap.add_argument("--hardware", default="pcie4-8gpu", help=f"preset ({', '.join(PRESETS)}) or a JSON file")
    ap.add_argument("--gpus", type=pos_int)
    ap.add_argument("--pcie-gen", dest="pcie_gen", type=pos_int)
    ap.add_argument("--devices-per-switch", dest="devices_per_switch", type=pos_int)
    ap.add_argument("--host-gbps", dest="host_mem_gbps", type=pos_float)
    ap.add_argument("--host-threads", dest="host_threads", type=pos_int)
    ap.add_argument("--nodes", type=pos_int)
    ap.add_argument("--network-gbps", dest="network_gbps", type=pos_float, help="Gbit/s per machine")
    ap.add_argument("--p2p-gbps", dest="p2p_gbps", type=pos_float)
    ap.add_argument("--sync-us", dest="sync_us", type=pos_float, help="per-chunk host cost per device (the send), microseconds")
    ap.add_argument("--hook-us", dest="hook_us", type=pos_float, help="per-parameter hook cost per device, microseconds")
    ap.add_argument("--segment-us", dest="segment_us", type=pos_float, help="host-thread cost per segment, microseconds")
    ap.add_argument("--chunks", default="auto", help="'auto' (planner) or a uniform chunk size k")
    ap.add_argument("--timeline", help="write the CGDP timeline to this PNG (needs matplotlib)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--update", choices=("devices", "host"), default="devices",
                    help="host: also say, per preset, whether the host optimizer fits under backward and what it frees")
    ap.add_argument("--optimizer", choices=sorted(UPDATE_BYTES), default="adamw", help="for --update host")
    ap.add_argument("--params", type=pos_float, help="float32 parameters (default: the model's gradient bytes / 4)")
    ap.add_argument("--backward-ms", dest="backward_ms", type=pos_float,
                    help="backward compute per step for --update host (default: the model's)")
    ap.add_argument("--gpu-memory-gb", dest="gpu_memory_gb", type=pos_float, default=24.0,
                    help="GPU memory per device, for --update host (default 24)")
    args = ap.parse_args(argv)  # exits with 2 and a usage line on a malformed option
    for name in ("sync", "hook", "segment"):
        us = getattr(args, f"{name}_us")
        setattr(args, f"{name}_s", us * 1e-6 if us is not None else None)
    try:
        return _run(args)
    except PlanError as exc:
        print(f"python -m cgdp.plan: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    model = load_model(args.model, args.minibatch)
    hw = load_hardware(args)
    costs = stage_costs(hw)
    if args.chunks == "auto":
        choice = choose_plan(model, costs)
        plan, how = choice.plan, choice.method
    else:
        try:
            k = int(args.chunks)
        except ValueError:
            raise PlanError(f"--chunks must be 'auto' or an int chunk size, got {args.chunks!r}") from None
        if k < 1:
            raise PlanError(f"--chunks {k}: a chunk holds at least one layer; use 1 (one layer per chunk) or auto")
        plan, how = paper_plan(model.num_layers, k), f"uniform k={k}"
    res = {m: simulate(model, costs, plan, m) for m in ("cgdp", "typical", "ring")}
    floor = model.forward_s + sum(model.backward_s) + model.update_s
    host = host_budget(model, hw, costs, plan)
    if args.json:
        out = {"hardware": hw.to_dict(), "plan": plan, "method": how,
               "step_s": {m: r.step_s for m, r in res.items()},
               "binding": {m: r.binding for m, r in res.items()}, "compute_floor_s": floor, "host": host}
        if args.update == "host":
            out["host_update"] = {n: vars(e) for n, _, e in _host_update_rows(args, model)}
        print(json.dumps(out, indent=1))
    else:
        total = sum(model.layer_bytes)
        note = f" ({LAYER_NOTE})" if args.model.lower() in PAPER_MODELS else ""
        print(f"model: {args.model}, {model.num_layers} layers{note}, {total / 1e6:.1f} MB of gradients; "
              f"one device computes {floor * 1e3:.2f} ms per step")
        link = "measured links" if hw.link_gbps else f"PCIe gen {hw.pcie_gen} x{hw.pcie_lanes}"
        print(f"hardware: {hw.name}: {hw.gpus} GPU(s) x {hw.nodes} node(s), {link} "
              f"({costs.d2h.per_byte_s and 1e-9 / costs.d2h.per_byte_s:.1f} GB/s D2H per link, "
              f"{hw.devices_per_switch} per switch), host {hw.host_mem_gbps:.0f} GB/s, {hw.host_threads} threads")
        sizes = [len(c) for c in plan]
        print(f"chunk plan ({how}): {len(plan)} chunks, sizes in send order {sizes}")
        for m, r in res.items():
            print(f"  {m:8s}{describe(r)}")
        base = res["typical"].step_s
        print(f"  cgdp vs typical: {base / res['cgdp'].step_s:.3f}x; vs ring: "
              f"{res['ring'].step_s / res['cgdp'].step_s:.3f}x; single-device floor {floor * 1e3:.2f} ms")
        G = hw.gpus
        print(f"host DRAM: (3G+1) x S = {host_traffic(G)} x {total / 1e6:.1f} MB = {host['traffic_bytes'] / 1e9:.2f} GB "
              f"per step, {host['dram_s'] * 1e3:.2f} ms at {hw.host_mem_gbps:g} GB/s; PCIe: {total / 1e6:.1f} MB each "
              f"way per link, {host['link_s'] * 1e3:.2f} ms: {host['binds']} binds first")
        print(f"host CPU per step (one process, serialised over the devices): hooks {host['hooks_s'] * 1e3:.2f} ms, "
              f"sends {host['sends_s'] * 1e3:.2f} ms, host thread {host['host_thread_s'] * 1e3:.2f} ms "
              f"({host['segments']:.0f} segments) = {host['host_cpu_s'] * 1e3:.2f} ms"
              + (f"; more than the backward compute ({sum(model.backward_s) * 1e3:.2f} ms): the host CPU binds"
                 if host["host_cpu_s"] > sum(model.backward_s) else ""))
        if args.timeline:
            print(save_timeline(res["cgdp"], args.timeline))
        if args.update == "host":
            _host_update_table(args, model)
    return 0


def _host_update_rows(args: argparse.Namespace, model: ModelCosts) -> list:
    """Per preset (with this run's --gpus): (name, hardware, the host update's estimate)."""
    params = args.params or sum(model.layer_bytes) / 4
    backward = args.backward_ms / 1e3 if args.backward_ms else sum(model.backward_s)
    rows = []
    for name in PRESETS:
        p = preset(name)
        if args.gpus:
            p.gpus = args.gpus
        rows.append((name, p, estimate(p, params, backward, args.optimizer,
                                       last_chunk_share=1 / max(model.num_layers, 1))))
    return rows


def _host_update_table(args: argparse.Namespace, model: ModelCosts) -> None:
    """The host optimizer's time against backward per preset, and the GPU memory it frees."""
    rows = _host_update_rows(args, model)
    params = args.params or sum(model.layer_bytes) / 4
    backward = args.backward_ms / 1e3 if args.backward_ms else sum(model.backward_s)
    cap = args.gpu_memory_gb * 1e9
    e0 = rows[0][2]
    print(f"\nupdate='host' ({args.optimizer}, {UPDATE_BYTES[args.optimizer]} B of host DRAM per element, "
          f"{params / 1e9:.2f} B parameters, backward {backward * 1e3:.1f} ms per step): GPU memory per device for "
          f"parameters + gradients + optimizer state {e0.gpu_bytes['devices'] / 1e9:.1f} GB -> "
          f"{e0.gpu_bytes['host'] / 1e9:.1f} GB ({e0.freed_per_gpu_bytes / 1e9:.1f} GB freed; activations not "
          f"counted); of {args.gpu_memory_gb:g} GB that leaves {(cap - e0.gpu_bytes['devices']) / 1e9:.1f} GB -> "
          f"{(cap - e0.gpu_bytes['host']) / 1e9:.1f} GB for activations and workspace")
    print(f"  {'preset':22s} {'G':>2s} {'DRAM GB/s':>9s} {'update ms':>10s} {'step DRAM ms':>12s} "
          f"{'hidden':>6s} {'exposed ms':>10s} {'host GB':>8s}")
    for name, p, e in rows:
        print(f"  {name:22s} {p.gpus:2d} {p.host_mem_gbps:9.0f} {e.update_s * 1e3:10.2f} {e.dram_s * 1e3:12.2f} "
              f"{'yes' if e.hidden else 'no':>6s} {e.exposed_s * 1e3:10.2f} {e.host_bytes / 1e9:8.1f}")


if __name__ == "__main__":
    sys.exit(main())
