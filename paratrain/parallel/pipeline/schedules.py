"""Pipeline schedules as pure data: the forwards and backwards each rank runs, in order.

A schedule is ``actions[rank]``: the F, B and W actions of that rank, each on
one micro-batch and one global stage. With ``pp`` ranks and ``v`` virtual
stages per rank there are ``S = pp·v`` stages; stage ``s`` lives on rank
``s % pp`` as its chunk ``s // pp`` (Megatron's interleaving: rank r holds
r, r+pp, r+2pp, ...).

Communication is implied by the actions, never listed, so the runtime and the
simulator derive it the same way:

==============  ==============================================  =====================================
action          before it runs                                  after it runs
==============  ==============================================  =====================================
F(mb, s)        s > 0: receive s-1's activation                 s < S-1: send the output to s+1
B(mb, s)        s < S-1: receive the output-grad from s+1       s > 0: send the input-grad to s-1
W(mb, s)        —                                               —
==============  ==============================================  =====================================

Without a split backward, B is the whole backward (input and weight grads)
and there are no W actions; with it (zero-bubble), B computes only the
input-grad and W the weight-grads, later.

Generators (p = pp, m = micro-batches, v = virtual stages):

- ``gpipe``: all forwards, then all backwards (Huang et al. 2019).
- ``1f1b``: p-1-r warmup forwards on rank r, then one forward one backward,
  then the remaining backwards (Narayanan et al. 2021).
- ``interleaved``: 1F1B over v chunks per rank (Narayanan et al. 2021).
- ``zb-h1``: 1F1B with B and W split, W deferred into the bubbles while at
  most p micro-batches are in flight (Qi et al. 2023).

Every generated schedule is deadlock-free and sends point-to-point messages
in the order the receiver posts them; `paratrain.parallel.pipeline.simulator` checks both.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable
from paratrain.errors import ParatrainError, Violation



class ScheduleName(str, Enum):
    """The pipeline schedules, the one list of their names (config, CLI, planner and runtime use it)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"  # Qi et al. 2023: 1F1B with weight gradients deferred into the bubbles

    @classmethod
    def parse(cls, name) -> ScheduleName:
        """The schedule called `name`; ScheduleError naming the choices for an unknown one."""
        try:
            return cls(name)
        except ValueError:
            raise ScheduleError(f"unknown schedule {name!r}; choose one of "
                                f"{', '.join(n.value for n in cls)}") from None


SCHEDULES = tuple(name.value for name in ScheduleName)
DEFAULT_SCHEDULE = ScheduleName.ONE_F_ONE_B  # the default of the trainer, parallelize and the planner


class ScheduleError(ParatrainError, ValueError):
    """A schedule that cannot be built or executed; the message names the field or action and the fix."""


class Kind(str, Enum):
    """What an action computes on one (micro-batch, stage)."""

    F = "F"  # forward
    B = "B"  # backward: the input-grad, and the weight-grads too unless the schedule splits them
    W = "W"  # weight-grads only (split-backward schedules)


@dataclass(frozen=True)
class Action:
    """One forward or backward of one micro-batch on one global stage."""

    kind: Kind
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind.value}(mb={self.microbatch}, stage={self.stage})"


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists; `actions[rank]` is that rank's execution order.

    `segments[rank]` cuts that order into runs whose point-to-point transfers travel together: the
    receives of a run's actions are posted with the sends of the run before it, as one group
    (`paratrain.parallel.pipeline.exchanges.exchanges`). One action per run, except in interleaved 1F1B's
    steady state, where a forward and the backward after it form one run (Megatron's
    send-forward-backward-receive-forward-backward): one action at a time deadlocks there when
    every send waits for its receive.
    """

    name: str
    pp: int
    num_microbatches: int
    virtual_stages: int
    split_backward: bool
    actions: tuple[tuple[Action, ...], ...]
    segments: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        if not self.segments:  # one action per run
            object.__setattr__(self, "segments", tuple((1,) * len(a) for a in self.actions))

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        """The rank holding global `stage`."""
        return stage % self.pp

    def chunk_of(self, stage: int) -> int:
        """Which of its rank's chunks `stage` is (0 .. virtual_stages-1)."""
        return stage // self.pp

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The global stages `rank` holds, chunk 0 first."""
        return tuple(range(rank, self.num_stages, self.pp))

    def __str__(self) -> str:
        rows = [f"{self.name} pp={self.pp} m={self.num_microbatches} v={self.virtual_stages}"]
        for rank, actions in enumerate(self.actions):
            rows.append(f"rank {rank}: " + " ".join(_short(a) for a in actions))
        return "\n".join(rows)


def _short(action: Action) -> str:
    return f"{action.kind.value}{action.microbatch}.{action.stage}"


def build_schedule(name: str | ScheduleName, pp: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule `name` for `pp` ranks and `num_microbatches` micro-batches.

    `virtual_stages` is the number of model chunks per rank; only 'interleaved'
    takes more than one, and it needs at least two. Raises ScheduleError on
    arguments the schedule is not defined for (`schedule_violations`).
    """
    for field, value in (("pp", pp), ("num_microbatches", num_microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{field} must be an integer of at least 1, got {value!r}")
    broken = _schedule_rules(name, pp, virtual_stages, num_microbatches, None)
    if broken:
        raise ScheduleError(broken[0].message)
    name = ScheduleName(name)
    actions = tuple(tuple(_GENERATORS[name](pp, num_microbatches, virtual_stages, rank)) for rank in range(pp))
    segments = ()
    if name in _SEGMENTS:
        segments = tuple(_SEGMENTS[name](pp, num_microbatches, virtual_stages, rank) for rank in range(pp))
    split = any(action.kind is Kind.W for rank_actions in actions for action in rank_actions)
    return Schedule(name=name.value, pp=pp, num_microbatches=num_microbatches, virtual_stages=virtual_stages,
                    split_backward=split, actions=actions, segments=segments)


def chunks_per_rank(schedule: str | ScheduleName, virtual_stages: int) -> int:
    """Model chunks per rank that `schedule` runs when given `virtual_stages`: that many if it interleaves, else 1."""
    name = schedule if isinstance(schedule, ScheduleName) else ScheduleName.parse(schedule)  # the planner's: often
    return virtual_stages if name in _INTERLEAVING else 1


def schedule_violations(schedule: str | ScheduleName, pp: int, virtual_stages: int = 1,
                        num_microbatches: int | None = None, n_layers: int | None = None) -> list[Violation]:
    """Every pipeline-schedule rule the layout breaks: the one place these rules are written.

    `build_schedule` calls it, and the layout rules (`paratrain.parallel.rules`) with what the caller
    knows (the micro-batch count and the number of layers may be unknown: None).
    Why interleaved needs m divisible by pp: micro-batches run in groups of pp (Megatron's
    order); with a short last group the wrap from the last rank to the first stalls or deadlocks.
    """
    if pp == 1:  # no pipeline: the schedule is not used
        return ([Violation("virtual_stages", "--virtual-stages needs pipeline parallelism (--pp > 1)")]
                if virtual_stages > 1 else [])
    return _schedule_rules(schedule, pp, virtual_stages, num_microbatches, n_layers)


def _schedule_rules(schedule, pp: int, virtual_stages: int, num_microbatches: int | None,
                    n_layers: int | None) -> list[Violation]:
    try:
        name = ScheduleName.parse(schedule)
    except ScheduleError as e:
        return [Violation("schedule", str(e))]
    out = []
    interleaved = name in _INTERLEAVING
    if virtual_stages > 1 and not interleaved:
        out.append(Violation("virtual_stages", f"--virtual-stages {virtual_stages} needs --schedule interleaved "
                                               f"(virtual stages are only for 'interleaved'; use 1 with {name.value!r})"))
    if interleaved and virtual_stages < 2:
        out.append(Violation("virtual_stages", "--schedule interleaved needs --virtual-stages 2 or more "
                                               "(use '1f1b' for one stage per rank)"))
    if n_layers is not None and n_layers % (pp * max(virtual_stages, 1)):
        out.append(Violation("layers_pp", f"layers {n_layers} not divisible by --pp × --virtual-stages = "
                                          f"{pp} × {virtual_stages}"))
    if interleaved and num_microbatches and num_microbatches % pp:
        out.append(Violation("microbatches_pp", f"--schedule interleaved needs the micro-batches per step "
                                                f"({num_microbatches}) divisible by --pp {pp}"))
    return out


def _gpipe(pp: int, m: int, v: int, rank: int) -> list[Action]:
    """All forwards, then all backwards in the same micro-batch order (so grads arrive in the order sent)."""
    return [Action(Kind.F, mb, rank) for mb in range(m)] + [Action(Kind.B, mb, rank) for mb in range(m)]


def _one_f_one_b(pp: int, m: int, v: int, rank: int) -> list[Action]:
    """Warmup forwards, one forward one backward, then the remaining backwards.

    Rank r runs p-1-r warmup forwards (fewer when m is smaller): exactly the
    forwards that must be in flight before the first backward comes back from
    the last stage, so rank r holds at most p-r micro-batches.
    """
    forwards = [Action(Kind.F, mb, rank) for mb in range(m)]
    backwards = [Action(Kind.B, mb, rank) for mb in range(m)]
    return _warmup_steady_cooldown(forwards, backwards, min(pp - 1 - rank, m))


def _warmup_steady_cooldown(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """`warmup` forwards, then alternate forward/backward, then the remaining backwards."""
    steady = len(forwards) - warmup
    order = forwards[:warmup]
    for i in range(steady):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[steady:]


def interleaved_order(pp: int, m: int, v: int) -> list[tuple[int, int]]:
    """The (micro-batch, chunk) order in which every rank runs its forwards (m a multiple of pp).

    Micro-batches go in groups of pp: a group runs chunk 0, then chunk 1, ...
    then the next group. Every rank uses this order, and its backwards use it
    with the chunks reversed, so each rank sends to a neighbour in the order
    the neighbour receives: rank r's chunk c feeds rank r+1's chunk c in the
    same order, and rank pp-1's chunk c feeds rank 0's chunk c+1 in the same
    order because a group runs its chunks one after another.
    """
    order = []
    for first in range(0, m, pp):
        order += [(mb, chunk) for chunk in range(v) for mb in range(first, first + pp)]
    return order


def _interleaved_warmup(pp: int, m: int, v: int, rank: int) -> int:
    return min(2 * (pp - 1 - rank) + (v - 1) * pp, m * v)


def _interleaved_segments(pp: int, m: int, v: int, rank: int) -> tuple[int, ...]:
    """Warmup forwards one by one, each steady forward with the backward after it, cooldown backwards one by one."""
    warmup = _interleaved_warmup(pp, m, v, rank)
    steady = m * v - warmup
    return (1,) * warmup + (2,) * steady + (1,) * (m * v - steady)


def _interleaved(pp: int, m: int, v: int, rank: int) -> list[Action]:
    """Interleaved 1F1B: rank r runs 2(p-1-r) + (v-1)·p warmup forwards (Megatron's count), at most m·v.

    The (v-1)·p warmup forwards bring micro-batch 0 to rank r's last chunk;
    2(p-1-r) more keep rank r busy while that forward reaches the last stage
    and its backward comes back. The groups of p micro-batches are why m must
    be a multiple of p: with a short last group the wrap from rank p-1 to
    rank 0 stalls (bubbles above 1F1B's) or, with enough chunks, deadlocks.
    """
    order = interleaved_order(pp, m, v)
    forwards = [Action(Kind.F, mb, chunk * pp + rank) for mb, chunk in order]
    backwards = [Action(Kind.B, mb, (v - 1 - chunk) * pp + rank) for mb, chunk in order]
    return _warmup_steady_cooldown(forwards, backwards, _interleaved_warmup(pp, m, v, rank))


def _zero_bubble_h1(pp: int, m: int, v: int, rank: int) -> list[Action]:
    """ZB-H1: 1F1B's forwards and input-grad backwards, each W deferred by `rank` micro-batches.

    Rank r of 1F1B holds at most p-r micro-batches; counting a micro-batch
    as in flight until its W, rank r can defer r weight-grads and still hold
    at most p. The grads travelling back wait only for input-grads, and the
    deferred W's fill the cooldown, where 1F1B waits for those grads. With
    f = B = W and m >= p the idle time per rank is the forward ramp alone,
    (p-1)·f, against 1F1B's (p-1)·(f+B+W).
    """
    warmup = min(pp - 1 - rank, m)
    order = [Action(Kind.F, mb, rank) for mb in range(warmup)]
    pending: list[Action] = []
    for i in range(m):
        if warmup + i < m:
            order.append(Action(Kind.F, warmup + i, rank))
        order.append(Action(Kind.B, i, rank))
        pending.append(Action(Kind.W, i, rank))
        if len(pending) > rank:
            order.append(pending.pop(0))
    return order + pending


_GENERATORS: dict[ScheduleName, Callable[[int, int, int, int], Iterable[Action]]] = {
    ScheduleName.GPIPE: _gpipe,
    ScheduleName.ONE_F_ONE_B: _one_f_one_b,
    ScheduleName.INTERLEAVED: _interleaved,
    ScheduleName.ZB_H1: _zero_bubble_h1,
}
# Schedules that run v > 1 chunks per rank (`virtual_stages`), and how each cuts its actions into runs
# (`Schedule.segments`; one action per run where none is given).
_INTERLEAVING = (ScheduleName.INTERLEAVED,)
_SEGMENTS: dict[ScheduleName, Callable[[int, int, int, int], tuple[int, ...]]] = {
    ScheduleName.INTERLEAVED: _interleaved_segments,
}
