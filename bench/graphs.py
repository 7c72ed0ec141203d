"""CUDA-graph timing shared by the kernel benches: capture a callable, time replays in interleaved
rounds, and the table rows of ratios (to a floor, to a baseline variant)."""
from __future__ import annotations

import statistics

import torch


def capture(fn):
    """fn captured in a CUDA graph after two warm-up calls on a side stream; returns (graph, output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replay_ms(graph, replays: int = 20) -> float:
    """ms per replay (CUDA events around `replays` back-to-back replays, after one more)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def interleaved(graphs: dict, rounds: int, replays: int = 20) -> dict[str, list[float]]:
    """ms per replay of each graph, one sample per round, the graphs taking turns in every round."""
    times = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            times[name].append(replay_ms(graph, replays))
    return times


def ratio_cells(times: dict[str, list[float]], name: str, base: str, floor_ms: float) -> list[str]:
    """ms (median), x floor, x the base variant, and the spread of the rounds."""
    ms = statistics.median(times[name])
    return [f"{ms:.3f}", f"{ms / floor_ms:.2f}", f"{ms / statistics.median(times[base]):.3f}",
            f"{min(times[name]):.3f}-{max(times[name]):.3f}"]
