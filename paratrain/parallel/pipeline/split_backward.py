"""The split backward of zero-bubble schedules (ZB-H1): B computes the stage input's gradient, W the weights'.

A split backward computes in B only the gradient of the stage's input, and in W only the weights'
gradients, from where B left off: each parameter's gradient path leaves the input's path at some
operation of the graph (the matmul that reads the weight, the product with a norm's gain); B
records the gradient arriving at those operations, and W runs backward from there to the
parameters alone. So B + W costs one backward (each matmul's two products are split between
them), not a backward and a half.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class WeightWork:
    """Parameters whose gradients leave the input's path at the graph `nodes`; `grads` arrived there
    during B. Parameters whose path never meets the input's start from the stage `output` instead
    (with its gradient), and have no nodes."""

    params: list[torch.Tensor]
    nodes: list
    grads: list[tuple] | None = None
    output: tuple[torch.Tensor, torch.Tensor | None] | None = None


def _grad_node(t: torch.Tensor):
    """The autograd node a tensor's gradient flows into (a leaf's accumulator, made on demand)."""
    return t.grad_fn if t.grad_fn is not None else t.view_as(t).grad_fn.next_functions[0][0]


def input_backward(output: torch.Tensor, grad: torch.Tensor | None, stage_input: torch.Tensor,
                    params: list[torch.Tensor]) -> list[WeightWork]:
    """B of a split backward: the stage input's gradient (into `.grad`), and what W needs to finish.

    The nodes on the input's path are those from which the input's accumulator can be reached; a
    parameter's path joins them at the first such node walking up from the parameter. Pre-hooks on
    those joining nodes keep the gradient each receives while the input's backward runs (which
    computes there only the input's side).
    """
    parents: dict = {}
    todo, seen = [output.grad_fn], {output.grad_fn}
    while todo:  # every node of the stage's graph, and who feeds gradient into it
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is not None:
                parents.setdefault(child, []).append(node)
                if child not in seen:
                    seen.add(child)
                    todo.append(child)
    on_input_path = _above(_grad_node(stage_input), parents, stop=set())
    work: dict = {}  # joining node -> the WeightWork holding it
    apart = WeightWork([], [], output=(output, grad))  # paths that never meet the input's
    for param in params:
        joins = _above(_grad_node(param), parents, stop=on_input_path) & on_input_path
        if not joins:
            apart.params.append(param)
            continue
        groups = {id(work[n]): work[n] for n in joins if n in work}
        merged = WeightWork([param], sorted(joins, key=id))
        for group in groups.values():  # a node shared with other parameters: one W call for all of them
            merged.params += group.params
            merged.nodes = sorted(set(merged.nodes) | set(group.nodes), key=id)
        for node in merged.nodes:
            work[node] = merged
    groups = list({id(g): g for g in work.values()}.values())
    captured: dict = {}
    handles = [node.register_prehook(lambda grads, node=node: captured.__setitem__(node, grads))
               for node in work]
    try:
        torch.autograd.backward(output, grad, inputs=[stage_input], retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    for group in groups:
        group.grads = [captured.get(node) for node in group.nodes]
    if apart.params:
        groups.append(apart)
    return groups


def _above(start, parents: dict, stop: set) -> set:
    """Nodes reachable from `start` against the direction of backward, not going past `stop` (included)."""
    found, todo = {start}, [start]
    while todo:
        for parent in parents.get(todo.pop(), ()):
            if parent not in found:
                found.add(parent)
                if parent not in stop:
                    todo.append(parent)
    return found


def weight_backward(groups: list[WeightWork]) -> None:
    """W of a split backward: from each joining node, with the gradient it got in B, to its parameters.

    Gradients accumulate into `.grad` (so accumulation hooks fire: DDP / ZeRO buckets). A group
    with several joining nodes, one below another, pins each node's incoming gradient to what it
    got in B, so that none is counted twice."""
    from torch.autograd.graph import GradientEdge

    for group in groups:
        if group.output is not None:
            torch.autograd.backward(*group.output, inputs=group.params)
            continue
        edges, grads = [], []
        for node, received in zip(group.nodes, group.grads):
            for i, g in enumerate(received or ()):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            continue
        pins = [node.register_prehook(lambda _, saved=received: saved)
                for node, received in zip(group.nodes, group.grads) if len(group.nodes) > 1 and received]
        try:
            torch.autograd.backward(edges, grads, inputs=group.params)
        finally:
            for pin in pins:
                pin.remove()
