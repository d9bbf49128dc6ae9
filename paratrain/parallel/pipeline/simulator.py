"""Check, time and draw pipeline schedules without running them.

`validate` proves a schedule executable by the runtime: every action on a
stage its rank holds, each (micro-batch, stage) forwarded and backwarded
exactly once, point-to-point messages sent in the order they are received,
and no deadlock — neither when sends are buffered (gloo) nor when every send
blocks until its receive is posted (NCCL may: a large send waits for its peer,
and the sends and receives between two ranks share one stream). `simulate`
times it under a cost model; `draw_timeline` plots the result;
`schedule_traits` reads off what the planner needs (in-flight micro-batches,
split backward, bubble), so the planner knows a schedule by its actions only.

Point-to-point exchanges (`exchanges.exchanges`, the groups the runtime posts):
under rendezvous semantics a group completes once each of its sends met its
receive in the peer's group then posted and each of its receives met its send;
`check_rendezvous` replays the groups of every rank under exactly that rule.

Cost model. ``f``, ``b`` and ``w`` are the costs of one micro-batch through
one rank's share of the model: ``f`` the forward, ``b`` the whole backward,
``w`` the weight-grad part of it (default b/2). An action on one of a rank's
``v`` chunks costs 1/v of that, so schedules of the same model compare
directly. Without a split backward, B costs b/v; with it (zero-bubble), B
costs (b-w)/v and W costs w/v. ``comm`` is added between an action and a
dependency that ran on another rank.

In flight. A micro-batch is in flight on a stage from its F until its
activations are released: the end of B without a split backward, the end of
W with one (W still holds the layer inputs and output-grads). A rank's count
is over its (micro-batch, stage) pairs, so with v chunks one unit is 1/v of a
rank's layers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from paratrain.parallel.pipeline.exchanges import Message, action_transfers, exchanges, messages
from paratrain.parallel.pipeline.schedules import Action, Kind, Schedule, ScheduleError, ScheduleName, build_schedule


@dataclass(frozen=True)
class TimedAction:
    """One action with its simulated start and end."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """A simulated schedule: per-rank timelines and what they add up to."""

    schedule: Schedule
    timeline: tuple[tuple[TimedAction, ...], ...]  # per rank, in execution order
    makespan: float
    busy: tuple[float, ...]  # compute time per rank
    peak_in_flight: tuple[int, ...]  # per rank, in (micro-batch, stage) units

    @property
    def rank_bubble_fraction(self) -> tuple[float, ...]:
        """Idle time / makespan, per rank."""
        return tuple(1.0 - busy / self.makespan if self.makespan else 0.0 for busy in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Idle time over all ranks / (ranks × makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


def dependencies(schedule: Schedule, action: Action) -> tuple[Action, ...]:
    """The actions that must finish before `action` may start (in the runtime: the data it receives)."""
    mb, stage = action.microbatch, action.stage
    if action.kind is Kind.F:
        return (Action(Kind.F, mb, stage - 1),) if stage > 0 else ()
    if action.kind is Kind.W:
        return (Action(Kind.B, mb, stage),)
    if stage == schedule.num_stages - 1:
        return (Action(Kind.F, mb, stage),)
    return Action(Kind.F, mb, stage), Action(Kind.B, mb, stage + 1)


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError naming the first problem; return None if the runtime can execute `schedule`."""
    check_structure(schedule)
    _clock(schedule, dict.fromkeys(Kind, 0.0), 0.0)
    check_p2p_order(schedule)
    check_rendezvous(schedule)


def check_structure(schedule: Schedule) -> None:
    """Every action on a held stage; one F, B (and W when split) per (mb, stage); F before B before W."""
    kinds = (Kind.F, Kind.B, Kind.W) if schedule.split_backward else (Kind.F, Kind.B)
    position: dict[Action, int] = {}
    for rank, actions in enumerate(schedule.actions):
        for index, action in enumerate(actions):
            if not 0 <= action.stage < schedule.num_stages or schedule.rank_of(action.stage) != rank:
                raise ScheduleError(f"rank {rank} runs {action} but holds only stages {schedule.stages_of(rank)}")
            if action.kind not in kinds:
                raise ScheduleError(f"rank {rank} runs {action} but {schedule.name!r} does not split the backward")
            if action in position:
                raise ScheduleError(f"rank {rank} runs {action} twice")
            position[action] = index
    extra = [a for a in position if not 0 <= a.microbatch < schedule.num_microbatches]
    if extra:
        raise ScheduleError(f"{extra[0]} names a micro-batch outside 0..{schedule.num_microbatches - 1}")
    for mb in range(schedule.num_microbatches):
        for stage in range(schedule.num_stages):
            _check_stage_order(schedule, position, kinds, mb, stage)


def _check_stage_order(schedule: Schedule, position: dict[Action, int], kinds: tuple[Kind, ...],
                       mb: int, stage: int) -> None:
    actions = [Action(kind, mb, stage) for kind in kinds]
    for action in actions:
        if action not in position:
            raise ScheduleError(f"{action} is missing from rank {schedule.rank_of(stage)}")
    for earlier, later in zip(actions, actions[1:]):
        if position[later] < position[earlier]:
            raise ScheduleError(f"rank {schedule.rank_of(stage)} runs {later} before {earlier}")


def check_rendezvous(schedule: Schedule) -> None:
    """Raise ScheduleError if the runtime's groups (`exchanges`) can deadlock when every send blocks until
    its receive is posted.

    Each rank works through its groups in order; an operation completes when its partner sits in the
    partner rank's current group (a send and its receive meet); a group is done when all of its
    operations are, and the rank moves on. Stuck with some rank unfinished is a deadlock.
    """
    plans = [[(set(sends), set(receives)) for sends, receives in exchanges(schedule, r)]
             for r in range(schedule.pp)]
    at = [0] * schedule.pp
    while True:
        for r in range(schedule.pp):  # finished groups first: a rank waits in its next one
            while at[r] < len(plans[r]) and not any(plans[r][at[r]]):
                at[r] += 1
        progressed = False
        for r in range(schedule.pp):
            if at[r] == len(plans[r]):
                continue
            sends, _ = plans[r][at[r]]
            for peer, message in list(sends):
                if at[peer] < len(plans[peer]) and (r, message) in plans[peer][at[peer]][1]:
                    sends.discard((peer, message))
                    plans[peer][at[peer]][1].discard((r, message))
                    progressed = True
        if all(a == len(p) for a, p in zip(at, plans)):
            return
        if not progressed:
            raise ScheduleError(_rendezvous_deadlock(schedule, plans, at))


def _rendezvous_deadlock(schedule: Schedule, plans, at) -> str:
    r = next(r for r in range(schedule.pp) if at[r] < len(plans[r]))
    sends, receives = plans[r][at[r]]
    waiting = [f"send {_message([m], 0)} to rank {p}" for p, m in sorted(sends)]
    waiting += [f"receive {_message([m], 0)} from rank {p}" for p, m in sorted(receives)]
    return (f"{schedule.name} pp={schedule.pp} m={schedule.num_microbatches}: deadlock when sends wait for their "
            f"receives: rank {r} waits to {' and '.join(waiting)}, which rank(s) "
            f"{sorted({p for p, _ in sends | receives})} will post only after groups that wait on others")


def check_p2p_order(schedule: Schedule) -> None:
    """Raise ScheduleError unless, for each ordered pair of ranks A→B, the messages A sends B
    come in the order B receives them.

    NCCL matches point-to-point messages between two ranks in issue order,
    without tags, so a mismatch lands one tensor in another's buffer (or
    hangs). The order is checked over all of A→B's traffic together
    (activations and grads share a pair when pp = 2 with interleaving), which
    implies it for each direction of traffic alone.
    """
    sent: dict[tuple[int, int], list[Message]] = defaultdict(list)
    received: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for rank in range(schedule.pp):
        sends, receives = messages(schedule, rank)
        for peer, message in sends:
            sent[(rank, peer)].append(message)
        for peer, message in receives:
            received[(peer, rank)].append(message)
    for pair in sorted(set(sent) | set(received)):
        if sent[pair] != received[pair]:
            first = next(i for i, (s, r) in enumerate(zip(sent[pair] + [None], received[pair] + [None])) if s != r)
            raise ScheduleError(f"p2p order mismatch: message {first} from rank {pair[0]} to rank {pair[1]} is "
                                f"{_message(sent[pair], first)} as sent but {_message(received[pair], first)} "
                                "as received")


def _message(sequence: list[Message], index: int) -> str:
    if index >= len(sequence):
        return "nothing"
    traffic, mb, stage = sequence[index]
    return f"{traffic}(mb={mb}, stage={stage})"


def _execute(schedule: Schedule, costs: dict[Kind, float], comm: float) -> list[list[TimedAction]]:
    """Event-driven execution (`_clock`) as timelines of TimedActions."""
    starts, ends = _clock(schedule, costs, comm)
    return [[TimedAction(*timed) for timed in zip(actions, rank_starts, rank_ends)]
            for actions, rank_starts, rank_ends in zip(schedule.actions, starts, ends)]


def _clock(schedule: Schedule, costs: dict[Kind, float], comm: float) -> tuple[list[list[float]], list[list[float]]]:
    """Per rank, the start and end of each of its actions: each rank runs its list in order, an action
    starting when its dependencies (`dependencies`) are done, plus `comm` from another rank.
    Raises ScheduleError on a deadlock.

    The ends of F and B are kept in flat lists indexed by micro-batch · stages + stage, not in a dict
    of Actions: an Action hashes its Enum kind in Python, too slow for the planner, which times
    schedules of a thousand micro-batches (`traits_of`).
    """
    f_kind, b_kind = Kind.F, Kind.B
    f_cost, b_cost, w_cost = costs[Kind.F], costs[Kind.B], costs[Kind.W]  # an Enum hashes in Python: slow per action
    stages, pp, last = schedule.num_stages, schedule.pp, schedule.num_stages - 1
    f_end: list[float | None] = [None] * (schedule.num_microbatches * stages)
    b_end: list[float | None] = [None] * (schedule.num_microbatches * stages)
    starts: list[list[float]] = [[] for _ in schedule.actions]
    ends: list[list[float]] = [[] for _ in schedule.actions]
    remaining = sum(len(actions) for actions in schedule.actions)
    while remaining:
        progressed = False
        for rank, actions in enumerate(schedule.actions):
            rank_starts, rank_ends = starts[rank], ends[rank]
            done = len(rank_ends)
            free = rank_ends[-1] if rank_ends else 0.0
            while done < len(actions):
                action = actions[done]
                kind, stage = action.kind, action.stage
                at = action.microbatch * stages + stage
                if kind is f_kind:  # needs the previous stage's forward
                    ready = f_end[at - 1] if stage else free
                    if ready is None:
                        break
                    if stage and (stage - 1) % pp != rank:
                        ready += comm
                elif kind is b_kind:  # needs its own forward and the next stage's backward
                    ready = f_end[at]
                    if ready is not None and stage < last:
                        grad = b_end[at + 1]
                        if grad is None:
                            break
                        ready = max(ready, grad + comm if (stage + 1) % pp != rank else grad)
                    if ready is None:
                        break
                else:  # W needs its own B
                    ready = b_end[at]
                    if ready is None:
                        break
                start = max(free, ready)
                if kind is f_kind:
                    free = f_end[at] = start + f_cost
                elif kind is b_kind:
                    free = b_end[at] = start + b_cost
                else:
                    free = start + w_cost
                rank_starts.append(start)
                rank_ends.append(free)
                done += 1
                remaining -= 1
                progressed = True
        if not progressed:
            done = [len(rank_ends) for rank_ends in ends]
            finished = {action for actions, count in zip(schedule.actions, done) for action in actions[:count]}
            raise ScheduleError(_deadlock_message(schedule, done, finished))
    return starts, ends


def _deadlock_message(schedule: Schedule, done: list[int], finished: set[Action]) -> str:
    blocked = [(rank, actions[done[rank]]) for rank, actions in enumerate(schedule.actions)
               if done[rank] < len(actions)]
    rank, action = blocked[0]
    missing = next(dep for dep in dependencies(schedule, action) if dep not in finished)
    owner = schedule.rank_of(missing.stage)
    if missing not in schedule.actions[owner]:
        return f"rank {rank} waits for {missing} (needed by {action}), which no rank runs: deadlock"
    owner_next = schedule.actions[owner][done[owner]]
    if owner_next == missing:
        return (f"rank {rank} waits for {missing} (needed by {action}), which rank {owner} cannot start "
                "for lack of its own inputs: deadlock")
    return (f"rank {rank} waits for {missing} (needed by {action}), which rank {owner} runs after "
            f"{owner_next}, itself blocked: deadlock")


def peak_in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most (micro-batch, stage) pairs between their F and their release (B, or W if split)."""
    forward, release = Kind.F, Kind.W if schedule.split_backward else Kind.B
    peaks = []
    for actions in schedule.actions:
        count = peak = 0
        for action in actions:
            kind = action.kind
            if kind is forward:
                count += 1
                if count > peak:
                    peak = count
            elif kind is release:
                count -= 1
        peaks.append(peak)
    return tuple(peaks)


def simulate(schedule: Schedule, f: float = 1.0, b: float = 2.0, w: float | None = None,
             comm: float = 0.0) -> SimResult:
    """Time `schedule` with per-rank costs f (forward), b (whole backward), w (its weight-grad part).

    See the module docstring for the cost convention. Validates the schedule first.
    """
    w = b / 2 if w is None else w
    if min(f, b, w, comm) < 0 or w > b:
        raise ScheduleError(f"costs must be >= 0 with w <= b, got f={f}, b={b}, w={w}, comm={comm}")
    validate(schedule)
    v = schedule.virtual_stages
    split = schedule.split_backward
    per_kind = {Kind.F: f / v, Kind.B: (b - w if split else b) / v, Kind.W: w / v}
    timeline = _execute(schedule, per_kind, comm)
    makespan = max((rank[-1].end for rank in timeline if rank), default=0.0)
    busy = tuple(sum(t.end - t.start for t in rank) for rank in timeline)
    return SimResult(schedule=schedule, timeline=tuple(tuple(rank) for rank in timeline),
                     makespan=makespan, busy=busy, peak_in_flight=peak_in_flight(schedule))


@dataclass(frozen=True)
class ScheduleTraits:
    """What a schedule's actions say about its memory and time: all the planner knows of a schedule.

    in_flight: per rank, the most micro-batches whose activations it holds at once (`peak_in_flight`)
        in whole-rank units: (micro-batch, stage) pairs over v, each stage being 1/v of the rank's layers.
    split_backward: whether the backward runs as B then W (zero-bubble): two walks of the graph.
    bubble: the idle time of a rank (the makespan less its busy time), in units of one micro-batch's
        forward and backward on a rank, timed with the forward, the input-grad and the weight-grad
        passes of equal cost (`simulate`'s f = 1, b = 2, w = 1, Qi et al. 2023's setting) and free
        communication. The step takes (m + bubble) micro-batch times.
    """

    in_flight: tuple[float, ...]
    split_backward: bool
    bubble: float


def schedule_traits(schedule: Schedule) -> ScheduleTraits:
    """The `ScheduleTraits` of a valid `schedule` (`validate`), read off its actions.

    Each action costs a whole number of units (f = v, so a chunk's forward costs 1), so the times
    add up exactly and the bubble is the exact quotient: (p − 1)/v for interleaved 1F1B.
    """
    v, split = schedule.virtual_stages, schedule.split_backward
    starts, ends = _clock(schedule, {Kind.F: 1.0, Kind.B: 1.0 if split else 2.0, Kind.W: 1.0}, 0.0)
    makespan = max((rank_ends[-1] for rank_ends in ends if rank_ends), default=0.0)
    idle = max(makespan - sum(e - s for s, e in zip(*rank)) for rank in zip(starts, ends))
    return ScheduleTraits(in_flight=tuple(peak / v for peak in peak_in_flight(schedule)),
                          split_backward=split, bubble=idle / (3 * v))


@lru_cache(maxsize=4096)
def traits_of(name: str | ScheduleName, pp: int, num_microbatches: int, virtual_stages: int = 1) -> ScheduleTraits:
    """`schedule_traits` of the schedule `build_schedule` makes, kept: the planner asks for thousands of layouts.

    Not validated here, for speed: tests/parallel/pipeline/test_schedules.py validates every schedule `build_schedule` makes.
    """
    return schedule_traits(build_schedule(name, pp, num_microbatches, virtual_stages))


def draw_timeline(source: Schedule | SimResult, path: str | Path, title: str | None = None) -> Path:
    """Draw one row per rank, one box per action (colour = kind, shade = chunk, label = micro-batch) to a PNG.

    A Schedule is simulated with the default costs first. Gaps are bubbles; the
    title carries the bubble fraction.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training hosts
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    result = source if isinstance(source, SimResult) else simulate(source)
    schedule = result.schedule
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, 0.35 * _count(result))), 0.6 * schedule.pp + 1.6))
    for rank, row in enumerate(result.timeline):
        for timed in row:
            _draw_box(ax, schedule, rank, timed, result.makespan)
    ax.set_xlim(0, result.makespan)
    ax.set_ylim(schedule.pp - 0.5, -0.5)
    ax.set_yticks(range(schedule.pp), [f"rank {rank}" for rank in range(schedule.pp)])
    ax.set_xlabel("time (units of the costs f, b, w)")
    ax.set_title(title or _default_title(result))
    legend = [Patch(color=_colour(kind, chunk, schedule.virtual_stages), label=_legend_label(kind, chunk, schedule))
              for kind in _kinds(schedule) for chunk in range(schedule.virtual_stages)]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


_BASE_COLOURS = {Kind.F: (0.20, 0.45, 0.80), Kind.B: (0.90, 0.45, 0.15), Kind.W: (0.25, 0.65, 0.30)}


def _colour(kind: Kind, chunk: int, num_chunks: int) -> tuple[float, float, float]:
    """The kind's colour, lightened towards white for later chunks."""
    mix = 0.55 * chunk / max(num_chunks - 1, 1)
    return tuple(c + (1.0 - c) * mix for c in _BASE_COLOURS[kind])


def _draw_box(ax, schedule: Schedule, rank: int, timed: TimedAction, makespan: float) -> None:
    action = timed.action
    chunk = schedule.chunk_of(action.stage)
    width = timed.end - timed.start
    ax.barh(rank, width, left=timed.start, height=0.8,
            color=_colour(action.kind, chunk, schedule.virtual_stages), edgecolor="black", linewidth=0.5)
    # Labels only where they fit; the colour still tells the kind of a thin box.
    if width / makespan > 0.008:
        ax.text(timed.start + width / 2, rank, str(action.microbatch), ha="center", va="center", fontsize=7)


def _count(result: SimResult) -> int:
    return max(len(row) for row in result.timeline)


def _kinds(schedule: Schedule) -> tuple[Kind, ...]:
    return (Kind.F, Kind.B, Kind.W) if schedule.split_backward else (Kind.F, Kind.B)


def _legend_label(kind: Kind, chunk: int, schedule: Schedule) -> str:
    names = {Kind.F: "forward", Kind.B: "backward (input)" if schedule.split_backward else "backward",
             Kind.W: "weight grad"}
    return names[kind] + (f", chunk {chunk}" if schedule.virtual_stages > 1 else "")


def _default_title(result: SimResult) -> str:
    s = result.schedule
    chunks = f", v={s.virtual_stages}" if s.virtual_stages > 1 else ""
    return f"{s.name}: pp={s.pp}, m={s.num_microbatches}{chunks} — bubble {result.bubble_fraction:.1%}"
