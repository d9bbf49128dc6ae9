"""Which activations and gradients a pipeline schedule sends between ranks, and when: the runtime's traffic and the
simulator's checks of it read the same lists.

The runtime posts the sends an action produced together with the receives the next action needs, as one group
(`batch_isend_irecv`), and waits for the whole group: Megatron's send-forward-receive-backward pairing, generalized
to any action list. `exchanges` lists those groups for one rank; `simulator.check_rendezvous` and
`simulator.check_p2p_order` prove them deadlock-free and ordered before a schedule runs.
"""

from __future__ import annotations

from paratrain.parallel.pipeline.schedules import Action, Kind, Schedule

# ('activation' | 'grad', micro-batch, sending stage)
Message = tuple[str, int, int]


def action_transfers(schedule: Schedule, action: Action) -> tuple[list[tuple[int, Message]], list[tuple[int, Message]]]:
    """(what `action` sends after it runs, what it receives before), as (peer rank, message) pairs."""
    mb, stage, last = action.microbatch, action.stage, schedule.num_stages - 1
    sends: list[tuple[int, Message]] = []
    receives: list[tuple[int, Message]] = []
    if action.kind is Kind.F:
        if stage > 0:
            receives.append((schedule.rank_of(stage - 1), ("activation", mb, stage - 1)))
        if stage < last:
            sends.append((schedule.rank_of(stage + 1), ("activation", mb, stage)))
    elif action.kind is Kind.B:
        if stage < last:
            receives.append((schedule.rank_of(stage + 1), ("grad", mb, stage + 1)))
        if stage > 0:
            sends.append((schedule.rank_of(stage - 1), ("grad", mb, stage)))
    return sends, receives


def messages(schedule: Schedule, rank: int) -> tuple[list[tuple[int, Message]], list[tuple[int, Message]]]:
    """The (peer, message) sends and receives of `rank`, in the order the runtime issues them."""
    sends: list[tuple[int, Message]] = []
    receives: list[tuple[int, Message]] = []
    for group_sends, group_receives in exchanges(schedule, rank):
        sends += group_sends
        receives += group_receives
    return sends, receives


def exchanges(schedule: Schedule, rank: int) -> list[tuple[list[tuple[int, Message]], list[tuple[int, Message]]]]:
    """The point-to-point groups of `rank`, one before each run of its actions (`Schedule.segments`) and one
    after the last: the sends of the run before with the receives of the run after, issued together."""
    groups, pending, start = [], [], 0
    for length in schedule.segments[rank]:
        run = schedule.actions[rank][start:start + length]
        start += length
        transfers = [action_transfers(schedule, action) for action in run]
        groups.append((pending, [message for _, receives in transfers for message in receives]))
        pending = [message for sends, _ in transfers for message in sends]
    groups.append((pending, []))
    return groups
