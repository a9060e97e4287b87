"""Choosing the chunk plan at run time: the paper's Algorithm 1, and a model-based tuner.

The engine drives a :class:`Tuner` between iterations: it asks ``plan()`` before each step,
profiles the step if ``wants_profile``, and reports ``observe(seconds, profile_or_None)`` after it.
Plans only change between steps, and any plan gives the same gradients, so a tuner can never change
results, only speed.

Invariants every tuner keeps:

* ``plan()`` and ``wants_profile`` are pure functions of the observations so far; the same
  observations always give the same decisions (under MPI, rank 0 decides and the engine broadcasts).
* ``state_dict()`` is JSON-serialisable and ``load_state_dict`` restores the exact decision state.

Two tuners:

* :class:`PaperTuner` runs :class:`PaperChunkSearch` (Algorithm 1, exactly) on
  :func:`cgdp.planning.chunks.paper_plan`: about ``interval·(step + range)`` steps, measurement only.
* :class:`AutoTuner` profiles a few steps under two contrasting plans, fits the simulator to them
  (:mod:`cgdp.planning.calibrate`), plans on it (:mod:`cgdp.planning.planner`: dynamic programming over layer
  boundaries, the best uniform and byte-bucket plans), then measures the few best candidates
  against the naive plan, interleaved, and keeps the fastest measured. With the default
  :class:`AutoTunerConfig`, 8 to 17 steps (1 warm-up, 4 profiled, then 3 rounds of its 1 to 4
  candidates). If profiles are not available or the fit fails, it falls back to measuring uniform
  plans of sizes 1, 2, 4, ….
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any, Protocol, Sequence, runtime_checkable

from cgdp.planning.chunks import one_chunk_plan, paper_plan
from cgdp.planning.costs import Linear
from cgdp.planning.profile import StepProfile

Plan = list[list[int]]


def _pos_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return int(value)


class PaperChunkSearch:
    """Algorithm 1 of the paper (§4.2), exactly, without any device.

    ``chunk`` is the chunk size for the next iteration; call ``observe(seconds)`` after each
    iteration. Every ``interval`` iterations, unless ``done``: if ``chunk >= best_chunk +
    step*range`` the search stops and keeps ``best_chunk``; otherwise lapse (the time of the last
    ``interval`` iterations) is compared with the best so far, and chunk grows by 1 while below
    ``step``, by ``step`` after. The stop test comes before the measurement.

    Worked example (step=10, range=5): chunks 1..9 are measured at iterations 10..90, then 10, 20,
    ..., 50 at iterations 100..140; if chunk 9 (iteration 90) was fastest, at iteration 150 chunk is
    60 ≥ 9 + 50, so the search stops there and uses chunk 9.
    """

    def __init__(self, step: int, range: int, interval: int = 10) -> None:  # noqa: A002 (paper's name)
        self.step = _pos_int(step, "step")
        self.range = _pos_int(range, "range")
        self.interval = _pos_int(interval, "interval")
        self.chunk = 1
        self.best_chunk = 1
        self.lapse_min = math.inf
        self.iteration = 0
        """Iterations observed so far (the paper's iter − 1 after each one)."""
        self.done = False
        self.stop_iteration: int | None = None
        """The iteration at which the search stopped."""
        self.history: list[tuple[int, int, float]] = []
        """(iteration, chunk measured, lapse) at every measurement."""
        self._lapse = 0.0

    def observe(self, seconds: float) -> None:
        """Report the wall time of one iteration run with ``self.chunk``."""
        seconds = float(seconds)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"iteration time must be a finite non-negative number of seconds, got {seconds!r}")
        self.iteration += 1
        if self.done:
            return
        self._lapse += seconds
        if self.iteration % self.interval != 0:
            return
        if self.chunk >= self.best_chunk + self.step * self.range:  # lines 8-10
            self.chunk = self.best_chunk
            self.done = True
            self.stop_iteration = self.iteration
            return
        lapse = self._lapse  # line 13: time since the last interval boundary
        self.history.append((self.iteration, self.chunk, lapse))
        if lapse < self.lapse_min:
            self.lapse_min = lapse
            self.best_chunk = self.chunk
        self.chunk = self.chunk + 1 if self.chunk < self.step else self.chunk + self.step
        self._lapse = 0.0  # line 23

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "range": self.range, "interval": self.interval, "chunk": self.chunk,
                "best_chunk": self.best_chunk,
                "lapse_min": None if math.isinf(self.lapse_min) else self.lapse_min,
                "iteration": self.iteration, "done": self.done, "stop_iteration": self.stop_iteration,
                "history": [list(h) for h in self.history], "lapse": self._lapse}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__init__(state["step"], state["range"], state["interval"])  # type: ignore[misc]
        self.chunk, self.best_chunk = int(state["chunk"]), int(state["best_chunk"])
        self.lapse_min = math.inf if state["lapse_min"] is None else float(state["lapse_min"])
        self.iteration, self.done = int(state["iteration"]), bool(state["done"])
        self.stop_iteration = state["stop_iteration"]
        self.history = [(int(a), int(b), float(c)) for a, b, c in state["history"]]
        self._lapse = float(state["lapse"])


@runtime_checkable
class Tuner(Protocol):
    """What the engine needs from a tuner."""

    name: str
    done: bool
    wants_profile: bool

    def plan(self) -> Plan: ...
    def observe(self, seconds: float, profile: StepProfile | None = None) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class PaperTuner:
    """Algorithm 1 driving the paper's uniform plans."""

    name = "paper"
    wants_profile = False

    def __init__(self, num_layers: int, step: int = 10, range: int = 5, interval: int = 10) -> None:  # noqa: A002
        self.num_layers = int(num_layers)
        self.search = PaperChunkSearch(step, range, interval)

        self.confirmed = False
        """The final plan has run one step (the engine stops asking once ``done``)."""

    @property
    def done(self) -> bool:
        return self.search.done and self.confirmed

    def plan(self) -> Plan:
        return paper_plan(self.num_layers, self.search.chunk)

    def observe(self, seconds: float, profile: StepProfile | None = None) -> None:
        if self.search.done:
            self.confirmed = True
        self.search.observe(seconds)

    def describe(self) -> str:
        s = self.search
        state = f"stopped at iteration {s.stop_iteration}" if s.done else f"searching (chunk {s.chunk})"
        return f"paper tuner (Algorithm 1, step={s.step}, range={s.range}): best chunk {s.best_chunk}, {state}"

    def __repr__(self) -> str:
        return f"<PaperTuner for {self.num_layers} layers: {self.describe().partition(': ')[2]}>"

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "num_layers": self.num_layers, "search": self.search.state_dict(),
                "confirmed": self.confirmed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"state is for tuner {state.get('name')!r}, not {self.name!r}")
        self.num_layers = int(state["num_layers"])
        self.search.load_state_dict(state["search"])
        self.confirmed = bool(state.get("confirmed", False))


@dataclass
class AutoTunerConfig:
    """Settings of the model-based tuner; each can be fixed by the user."""

    warmup_steps: int = 1
    """Steps run before profiling (first-step allocation and caching distort timings)."""
    profile_rounds: int = 2
    """Profiled steps per calibration plan (two plans: every layer alone, and one chunk)."""
    verify_rounds: int = 3
    """Measured steps per candidate plan, interleaved round by round."""
    candidates: int = 3
    """Model-chosen plans to verify (besides the naive plan, chunk size 1)."""
    max_front: int = 64
    """Planner's Pareto-front cap (exact below it)."""

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "profile_rounds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("verify_rounds", "candidates", "max_front"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class AutoTuner:
    """Profile, fit the simulator, plan by DP, verify by measurement (see the module docstring)."""

    name = "auto"

    def __init__(self, layer_bytes: Sequence[int], devices: int,
                 config: AutoTunerConfig | None = None, comm: Linear | None = None,
                 ranks: int = 1) -> None:
        self.layer_bytes = [int(b) for b in layer_bytes]
        self.devices = int(devices)
        self.comm = comm
        """The MPI allreduce of one chunk, α + β·bytes, from ``probe_alpha_beta`` (several ranks)."""
        self.ranks = int(ranks)
        self.config = config or AutoTunerConfig()
        L = len(self.layer_bytes)
        self.naive = paper_plan(L, 1) if L else []
        self._reset()

    def _reset(self) -> None:
        c = self.config
        L = len(self.layer_bytes)
        # (plan, profile?) per scheduled step; the verification part is appended once planned.
        self.schedule: list[tuple[Plan, bool]] = [(self.naive, False)] * c.warmup_steps
        if L > 1:
            for _ in range(c.profile_rounds):
                self.schedule += [(self.naive, True), (one_chunk_plan(L), True)]
        self.observations: list[tuple[float, dict | None]] = []
        self.profiles: list[StepProfile] = []
        self.candidates: list[tuple[str, Plan, float]] = []  # (name, plan, predicted seconds)
        self.measured: dict[int, list[float]] = {}
        self.method = "model" if L > 1 else "trivial"
        self.chosen: Plan | None = None if L > 1 else self.naive
        self.chosen_name = "" if L > 1 else "single layer"
        self.steps_seen = 0
        self.confirmed = False
        """The chosen plan has run one step (the engine stops asking once ``done``)."""
        self._planned = False
        if L > 1 and not self.schedule:
            self._make_candidates()

    # -- the engine-facing protocol ------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.chosen is not None and self.confirmed

    @property
    def wants_profile(self) -> bool:
        return self.chosen is None and self.steps_seen < len(self.schedule) and self.schedule[self.steps_seen][1]

    def plan(self) -> Plan:
        if self.chosen is not None:
            return [list(ch) for ch in self.chosen]
        return [list(ch) for ch in self.schedule[self.steps_seen][0]]

    def observe(self, seconds: float, profile: StepProfile | None = None) -> None:
        seconds = float(seconds)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"step time must be a finite non-negative number of seconds, got {seconds!r}")
        if self.chosen is not None:
            self.confirmed = True
            self.steps_seen += 1
            return
        wanted = self.schedule[self.steps_seen][1]
        self.observations.append((seconds, profile.to_dict() if (wanted and profile is not None) else None))
        self._advance(seconds, profile if wanted else None, wanted)

    def _advance(self, seconds: float, profile: StepProfile | None, wanted: bool) -> None:
        i = self.steps_seen
        self.steps_seen += 1
        if wanted:
            if profile is None:
                self._fall_back("no step profile was available")
            else:
                self.profiles.append(profile)
        elif self._planned and i >= self._verify_start:
            k = (i - self._verify_start) % len(self.candidates)
            r = (i - self._verify_start) // len(self.candidates)
            self.measured.setdefault((k + r) % len(self.candidates), []).append(seconds)
        if self.steps_seen == len(self.schedule):
            if not self._planned:
                self._make_candidates()
            else:
                self._choose()

    def _make_candidates(self) -> None:
        self._planned = True
        if self.method == "model":
            try:
                self.candidates = self._model_candidates()
            except (ValueError, ArithmeticError, IndexError) as exc:  # a degenerate fit: measure instead
                self._fall_back(f"the simulator could not be fitted ({exc})")
        if self.method != "model":
            L = len(self.layer_bytes)
            ks = sorted({min(2 ** i, L) for i in range(0, max(L, 1).bit_length() + 1)})
            self.candidates = [(f"uniform k={k}", paper_plan(L, k), math.nan) for k in ks]
        self._verify_start = len(self.schedule)
        n = len(self.candidates)
        for r in range(self.config.verify_rounds):  # rotate the order each round to cancel drift
            self.schedule += [(self.candidates[(k + r) % n][1], False) for k in range(n)]

    def _model_candidates(self) -> list[tuple[str, Plan, float]]:
        from cgdp.planning.calibrate import calibrate  # planning code, imported when first needed
        from cgdp.planning.planner import choose_plan
        from cgdp.planning.simulator import predict_step

        base = None
        if self.comm is not None and self.ranks > 1:
            from cgdp.planning.costs import StageCosts
            base = StageCosts(devices=self.devices, ranks=self.ranks, comm=self.comm)
        cal = calibrate(self.profiles, base)
        choice = choose_plan(cal.model, cal.costs, self.config.max_front)
        ranked = sorted(choice.alternatives.items(), key=lambda kv: kv[1][0])
        out: list[tuple[str, Plan, float]] = []
        for name, (t, plan) in ranked:
            if not math.isfinite(t):
                raise ArithmeticError(f"predicted step time of {name} is {t}")
            if all(plan != p for _, p, _ in out) and len(out) < self.config.candidates:
                out.append((name, plan, t))
        if all(self.naive != p for _, p, _ in out):
            out.append(("naive k=1", self.naive, predict_step(cal.model, cal.costs, self.naive)))
        self.calibration = cal
        return out

    def _fall_back(self, why: str) -> None:
        if self.method == "model":
            self.method = f"measure-only ({why})"
            # drop the remaining profile steps: nothing can be fitted without profiles
            self.schedule = self.schedule[:self.steps_seen]

    def _choose(self) -> None:
        med = {k: median(v) for k, v in self.measured.items()}
        best = min(med, key=lambda k: (med[k], k))
        self.chosen_name, self.chosen = self.candidates[best][0], self.candidates[best][1]

    # -- reporting and state ---------------------------------------------------------------------
    def describe(self) -> str:
        """Which tuner ran, what it chose, predicted against measured."""
        if self.chosen is None:
            return f"auto tuner ({self.method}): step {self.steps_seen} of {len(self.schedule)}"
        lines = [f"auto tuner ({self.method}): chose {self.chosen_name} ({len(self.chosen or [])} chunks) "
                 f"after {len(self.schedule)} steps"]
        for k, (name, _, pred) in enumerate(self.candidates):
            m = median(self.measured[k]) if k in self.measured else math.nan
            lines.append(f"  {name:<28} predicted {pred * 1e3:9.3f} ms   measured {m * 1e3:9.3f} ms")
        return "\n".join(lines)

    def __repr__(self) -> str:
        """One line: layers, devices, and how far it is (:meth:`describe` has the candidates)."""
        where = self.describe().splitlines()[0].removeprefix("auto tuner ")
        return f"<AutoTuner for {len(self.layer_bytes)} layers on {self.devices} device(s), {where}>"

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "layer_bytes": self.layer_bytes, "devices": self.devices,
                "config": asdict(self.config), "observations": [list(o) for o in self.observations],
                "steps_seen": self.steps_seen, "confirmed": self.confirmed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"state is for tuner {state.get('name')!r}, not {self.name!r}")
        self.__init__(state["layer_bytes"], state["devices"], AutoTunerConfig(**state["config"]))  # type: ignore[misc]
        for seconds, prof in state["observations"]:  # replay: decisions are a function of these
            wanted = self.schedule[self.steps_seen][1]
            self.observations.append((seconds, prof))
            self._advance(seconds, StepProfile.from_dict(prof) if prof is not None else None, wanted)
        self.steps_seen = int(state["steps_seen"])
        self.confirmed = bool(state.get("confirmed", False))


def make_tuner(spec: object, layer_bytes: Sequence[int], devices: int,
               comm: Linear | None = None, ranks: int = 1) -> Tuner:
    """``"auto"`` → :class:`AutoTuner`; ``"paper"`` → :class:`PaperTuner` (step 10, range 5, as
    the paper's §5.3); a :class:`Tuner` instance is used as is. ``comm``/``ranks``: the probed
    MPI allreduce cost and the number of machines, for the auto tuner's model."""
    if spec == "auto":
        return AutoTuner(layer_bytes, devices, comm=comm, ranks=ranks)
    if spec == "paper":
        return PaperTuner(len(layer_bytes))
    if isinstance(spec, Tuner) and not isinstance(spec, (str, type)):
        return spec
    raise ValueError(f"unknown tuner {spec!r}: use 'auto' (model-based, 8 to 17 steps) or 'paper' "
                     f"(the paper's Algorithm 1, ~150 steps)")
